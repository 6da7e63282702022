"""The MSD/EAGLE training loss.

    L = w_feat * SmoothL1(f_hat, f) + w_tok * CE(softmax(lm_head f), log_softmax(lm_head f_hat))

summed over loss positions and divided by the number of loss positions in the whole
global batch (all ranks, all accumulation steps), so every token weighs the same whatever
the padding, the micro-batch split or the world size. Softmaxes run in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


def msd_loss(
    pred: torch.Tensor,
    target_hidden: torch.Tensor,
    lm_head: torch.nn.Module,
    mask: torch.Tensor,
    n_tokens: float,
    w_feat: float = 1.0,
    w_tok: float = 0.1,
    index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss summed over ``mask`` positions and divided by ``n_tokens`` (global count).

    ``pred`` and ``target_hidden`` are (B, T, H): the draft's predicted features and the
    target's true next features. ``index`` (``loss_index(mask)`` on the pred's device), when
    given, selects the same positions without a host sync. Returns the loss and detached
    parts (sums, for logging).
    """
    if index is None:
        m = mask.bool()
        p, f, n = pred[m].float(), target_hidden[m].float(), m.sum()
    else:
        p = pred.flatten(0, 1).index_select(0, index).float()
        f = target_hidden.flatten(0, 1).index_select(0, index).float()
        n = torch.full((), index.numel(), dtype=torch.long, device=pred.device)
    feat = F.smooth_l1_loss(p, f, reduction="none").mean(-1).sum()
    with torch.no_grad():
        target_logp = torch.log_softmax(lm_head(f.to(lm_head.weight.dtype)).float(), -1)
    draft_logp = torch.log_softmax(lm_head(p.to(lm_head.weight.dtype)).float(), -1)
    tok = -(target_logp.exp() * draft_logp).sum(-1).sum()
    loss = (w_feat * feat + w_tok * tok) / max(n_tokens, 1.0)
    with torch.no_grad():
        agree = (draft_logp.argmax(-1) == target_logp.argmax(-1)).sum()
    return loss, {"feat_sum": feat.detach(), "tok_sum": tok.detach(), "agree_sum": agree, "n": n}
