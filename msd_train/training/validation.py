"""Held-out metrics: loss, k-step self-rollout agreement, simulated tau.

A k-step self-rollout drafts k tokens from every held-out position: step 1 reads the
target's true features, step j > 1 reads the draft's own prediction from step j-1 (its
guess of the next feature), as it would while drafting a chain. Step j at position t
therefore belongs to the chain anchored at t - j + 1. A chain is correct at step j when
the draft's top-1 token equals the target's top-1 token there. We report per step

- unconditional agreement: P(step j correct),
- conditional agreement: P(step j correct | steps 1..j-1 correct),

and the simulated acceptance length tau = 1 + sum_j prod_{i<=j} cond_i, which is what a
chain of k drafts would commit per target forward under greedy verification.

This is a proxy: the context positions of each rollout step also carry predicted
features, where real drafting keeps true features for committed tokens.
"""

from __future__ import annotations

import torch

from msd_train.training.loss import draft_loss_mask, lm_head_argmax, msd_loss


@torch.no_grad()
def rollout_stats(draft, target, feats, loss_mask: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """Counts for one batch: per step j, valid chains, correct-so-far chains, correct at j."""
    inputs = draft.target_inputs(feats)
    hidden = inputs["hidden_states"]
    mask = draft_loss_mask(loss_mask.to(hidden.device)).bool()
    target_top = lm_head_argmax(target.lm_head, feats.hidden_states[:, 1:])
    B, T = mask.shape
    valid = torch.zeros(k, device=hidden.device)
    alive_prev = torch.zeros(k, device=hidden.device)
    correct_all = torch.zeros(k, device=hidden.device)
    correct_any = torch.zeros(k, device=hidden.device)
    h_in = hidden
    chain_ok = torch.ones(B, T, dtype=torch.bool, device=hidden.device)  # indexed by anchor
    anchor_valid = mask.clone()
    for j in range(k):
        out = draft(**{**inputs, "hidden_states": h_in.to(inputs["input_embeds"].dtype)}).last_hidden_state
        top = lm_head_argmax(target.lm_head, out)
        hit = top == target_top  # at position t: step j of the chain anchored at t - j
        # Re-index by anchor a = t - j: positions j..T-1 map to anchors 0..T-1-j.
        hit_a = torch.zeros_like(chain_ok)
        hit_a[:, : T - j] = hit[:, j:]
        ok_pos = torch.zeros_like(chain_ok)
        ok_pos[:, : T - j] = mask[:, j:]
        anchor_valid = anchor_valid & ok_pos
        valid[j] = anchor_valid.sum()
        alive_prev[j] = (anchor_valid & chain_ok).sum()
        correct_any[j] = (anchor_valid & hit_a).sum()
        chain_ok = chain_ok & hit_a
        correct_all[j] = (anchor_valid & chain_ok).sum()
        # Next step reads this step's prediction of the following feature.
        nxt = hidden.clone()
        nxt[:, 1:] = out[:, :-1].to(hidden.dtype)
        h_in = nxt
    return {"valid": valid, "alive_prev": alive_prev, "correct_all": correct_all, "correct_any": correct_any}


def summarise(stats: dict[str, torch.Tensor]) -> dict[str, object]:
    valid = stats["valid"].clamp_min(1)
    uncond = (stats["correct_any"] / valid).tolist()
    cond = (stats["correct_all"] / stats["alive_prev"].clamp_min(1)).tolist()
    tau, prod = 1.0, 1.0
    for c in cond:
        prod *= c
        tau += prod
    return {"agree_uncond": uncond, "agree_cond": cond, "sim_tau": tau, "top1": uncond[0]}


@torch.no_grad()
def evaluate_split(draft, target, batches, feature_source, k: int) -> dict[str, object]:
    """Loss and rollout metrics over an iterable of collated batches."""
    total = None
    loss_sum, n_tok = 0.0, 0.0
    for batch in batches:
        feats = feature_source(batch)
        out = draft(**draft.target_inputs(feats)).last_hidden_state
        dmask = draft_loss_mask(batch["loss_mask"].to(out.device))
        n = float(dmask.sum())
        loss, _ = msd_loss(out, feats.hidden_states[:, 1:], target.lm_head, dmask, n_tokens=1.0)
        loss_sum += float(loss)
        n_tok += n
        s = rollout_stats(draft, target, feats, batch["loss_mask"], k)
        total = s if total is None else {key: total[key] + s[key] for key in s}
    if total is None:
        return {}
    out = summarise(total)
    out["loss"] = loss_sum / max(n_tok, 1.0)
    out["tokens"] = n_tok
    return out
