"""The MSD/EAGLE training loss.

    L = w_feat * SmoothL1(f_hat, f) + w_tok * CE(softmax(lm_head f), log_softmax(lm_head f_hat))

summed over loss positions and divided by the number of loss positions in the whole
global batch (all ranks, all accumulation steps), so every token weighs the same whatever
the padding, the micro-batch split or the world size. Softmaxes run in fp32.

The token term runs over chunks of ``chunk`` loss positions: full-vocabulary logits exist
for one chunk at a time (Qwen's 152k vocabulary in fp32 is 0.6 MB per position and copy,
several GB per micro-batch otherwise), and each chunk's gradient with respect to the
draft's features is taken as it is computed, so the backward pass holds an (N, H)
gradient instead of the logits (benchmarks/loss_memory/).

Over a draft vocabulary (``draft.train_vocab=N``, a ``VocabSubset`` of the lm_head): both
distributions are taken over the lm_head's rows of the N target tokens the training data uses most
(softmaxes over those N logits), and positions whose target argmax (over the whole
vocabulary) falls outside them are left out of the token term, as EAGLE-3 trains its
pruned head; the feature term is unchanged. The token term's two products and its
gradient then cost N / V of the full ones; the target's argmax is read from the feature
store where it was stored (``Features.target_top``), else computed once per step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from msd_train.draft.vocabulary import VocabSubset


def draft_loss_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    """Loss positions of the draft: position t predicts token t+2 (and feature t+1).

    Returns a (B, L-1) mask; the draft is trained where token t+2 is an assistant token.
    """
    shifted = torch.zeros_like(loss_mask[:, 1:])
    shifted[:, :-1] = loss_mask[:, 2:]
    return shifted


def loss_index(mask: torch.Tensor) -> torch.Tensor:
    """Flat (B*T) positions of ``mask``, in ``pred[mask]`` order. Made on the host from the
    batch's CPU mask, it lets ``msd_loss`` gather on the device without the host sync that
    boolean indexing of a device tensor costs."""
    return mask.reshape(-1).nonzero().squeeze(1)


#: loss positions whose full-vocabulary logits are held at once (an fp32 copy at 152k vocab: 0.3 GB)
CHUNK = 512


class _TokenLoss(torch.autograd.Function):
    """sum_i w_i CE(softmax(lm_head f_i), log_softmax(lm_head p_i)), each position's top-1
    agreement and its acceptance probability sum_x min(p_target(x), p_draft(x)) (what
    speculative sampling accepts a draft from it with), chunk by chunk; the gradient with
    respect to ``p`` is computed in the forward pass. ``weight``: per-position w_i (None: 1).
    With a ``VocabSubset``: over its rows, positions whose target top-1 ``top`` is outside
    it weighted 0 (no host sync: every position is computed over N rows, then masked)."""

    @staticmethod
    def forward(ctx, p, f, lm_head, chunk, vocab=None, top=None, weight=None):
        want_grad = ctx.needs_input_grad[0]
        tok = torch.zeros((), dtype=torch.float32, device=p.device)
        hit = torch.zeros(p.shape[0], dtype=torch.bool, device=p.device)
        overlap = torch.zeros(p.shape[0], dtype=torch.float32, device=p.device)
        grad = torch.zeros_like(p) if want_grad else None
        head = lm_head if vocab is None else vocab
        dtype = lm_head.weight.dtype
        for s in range(0, p.shape[0], chunk):
            target_logp = torch.log_softmax(head(f[s:s + chunk].to(dtype)).float(), -1)
            keep = None if vocab is None else vocab.member[top[s:s + chunk]].float()
            if weight is not None:
                keep = weight[s:s + chunk].float() if keep is None else keep * weight[s:s + chunk].float()
            with torch.enable_grad():
                pc = p[s:s + chunk].detach().requires_grad_(want_grad)
                draft_logp = torch.log_softmax(head(pc.to(dtype)).float(), -1)
                per = -(target_logp.exp() * draft_logp).sum(-1)
                part = per.sum() if keep is None else (per * keep).sum()
                if want_grad:
                    grad[s:s + chunk] = torch.autograd.grad(part, pc)[0]
            tok += part.detach()
            overlap[s:s + chunk] = torch.minimum(target_logp, draft_logp.detach()).exp().sum(-1)
            if vocab is None:
                hit[s:s + chunk] = draft_logp.argmax(-1) == target_logp.argmax(-1)
            else:  # a target top-1 outside the vocabulary is a miss, as in decoding
                hit[s:s + chunk] = (vocab.ids[draft_logp.argmax(-1)] == top[s:s + chunk]) & vocab.member[top[s:s + chunk]]
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(hit, overlap)
        return tok, hit, overlap

    @staticmethod
    def backward(ctx, grad_tok, grad_hit, grad_overlap):
        (grad,) = ctx.saved_tensors
        return grad * grad_tok, None, None, None, None, None, None


def lm_head_argmax(lm_head: torch.nn.Module, hidden: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """``lm_head(hidden).argmax(-1)`` over (..., H), without building all the logits at once."""
    flat = hidden.reshape(-1, hidden.shape[-1]).to(lm_head.weight.dtype)
    top = torch.cat([lm_head(flat[s:s + chunk]).argmax(-1) for s in range(0, flat.shape[0], chunk)])
    return top.reshape(hidden.shape[:-1])


def msd_loss(
    pred: torch.Tensor,
    target_hidden: torch.Tensor,
    lm_head: torch.nn.Module,
    mask: torch.Tensor,
    n_tokens: float,
    w_feat: float = 1.0,
    w_tok: float = 0.1,
    index: torch.Tensor | None = None,
    chunk: int = CHUNK,
    vocab: VocabSubset | None = None,
    target_top: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss summed over ``mask`` positions and divided by ``n_tokens`` (global count).

    ``pred`` and ``target_hidden`` are (B, T, H): the draft's predicted features and the
    target's true next features. ``index`` (``loss_index(mask)`` on the pred's device), when
    given, selects the same positions without a host sync. ``chunk``: loss positions whose
    logits are built at once (the result does not depend on it). ``vocab``: the token term
    over a draft vocabulary (module docstring); ``target_top`` (B, T), the target's top-1
    id at each of ``target_hidden``'s positions where the caller has it (a feature store),
    spares the full-vocabulary product that finds it. ``weight`` (one per selected position,
    in ``index`` / ``pred[mask]`` order): each position's terms weighted by it (None: 1).
    Returns the loss and detached parts (sums, for logging, and per selected position
    ``hit``, its top-1 agreement, and ``overlap``, sum_x min(p_target, p_draft): the
    probability that speculative sampling accepts a token drafted there).
    """
    if index is None:
        m = mask.bool()
        p, f, n = pred[m].float(), target_hidden[m].float(), m.sum()
        top = None if target_top is None else target_top[m]
    else:
        p = pred.flatten(0, 1).index_select(0, index).float()
        f = target_hidden.flatten(0, 1).index_select(0, index).float()
        n = torch.full((), index.numel(), dtype=torch.long, device=pred.device)
        top = None if target_top is None else target_top.flatten().index_select(0, index)
    feat = F.smooth_l1_loss(p, f, reduction="none").mean(-1)
    feat = feat.sum() if weight is None else (feat * weight).sum()
    if vocab is not None and (top is None or bool((top < 0).any())):
        top = lm_head_argmax(lm_head, f.detach(), chunk)  # not stored: one full-vocabulary product
    tok, hit, overlap = _TokenLoss.apply(p, f.detach(), lm_head, max(int(chunk), 1), vocab,
                                         None if vocab is None else top.to(p.device),
                                         None if weight is None else weight.detach())
    loss = (w_feat * feat + w_tok * tok) / max(n_tokens, 1.0)
    return loss, {"feat_sum": feat.detach(), "tok_sum": tok.detach(), "agree_sum": hit.sum(), "n": n,
                  "hit": hit, "overlap": overlap}
