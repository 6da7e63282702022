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

from msd_train.targets import Features, TargetProtocol
from msd_train.training.loss import draft_loss_mask
from msd_train.training.objective import Objective


@torch.no_grad()
def rollout_stats(objective: Objective, target: TargetProtocol, feats: Features, loss_mask: torch.Tensor,
                  k: int) -> dict[str, torch.Tensor]:
    """Counts for one batch: per step j, valid chains, correct-so-far chains, correct at j.
    The head's objective (``objective.rollout_hits_in``) says which steps of which chains hit."""
    mask = draft_loss_mask(loss_mask.to(feats.hidden_states.device)).bool()
    hits = objective.rollout_hits_in(target, feats, k, mask)
    B, T = mask.shape
    valid = torch.zeros(k, device=mask.device)
    alive_prev = torch.zeros(k, device=mask.device)
    correct_all = torch.zeros(k, device=mask.device)
    correct_any = torch.zeros(k, device=mask.device)
    chain_ok = torch.ones(B, T, dtype=torch.bool, device=mask.device)  # indexed by anchor
    anchor_valid = mask.clone()
    for j, hit_a in enumerate(hits):
        ok_pos = torch.zeros_like(chain_ok)  # step j of anchor a predicts token a+2+j: a loss position
        ok_pos[:, : T - j] = mask[:, j:]
        anchor_valid = anchor_valid & ok_pos
        valid[j] = anchor_valid.sum()
        alive_prev[j] = (anchor_valid & chain_ok).sum()
        correct_any[j] = (anchor_valid & hit_a).sum()
        chain_ok = chain_ok & hit_a
        correct_all[j] = (anchor_valid & chain_ok).sum()
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
def evaluate_split(objective: Objective, target: TargetProtocol, batches, feature_source, k: int) -> dict[str, object]:
    """Loss and rollout metrics over an iterable of collated batches, as the head's
    training objective (``msd_train.training.objective``) measures them."""
    total = None
    loss_sum, n_tok = 0.0, 0.0
    for batch in batches:
        feats = feature_source(batch)
        dmask = draft_loss_mask(batch["loss_mask"].to(feats.hidden_states.device))
        n = float(dmask.sum())
        loss = objective.eval_loss(target, feats, dmask)
        loss_sum += float(loss)
        n_tok += n
        s = rollout_stats(objective, target, feats, batch["loss_mask"], k)
        total = s if total is None else {key: total[key] + s[key] for key in s}
    if total is None:
        return {}
    out = summarise(total)
    out["loss"] = loss_sum / max(n_tok, 1.0)
    out["tokens"] = n_tok
    return out
