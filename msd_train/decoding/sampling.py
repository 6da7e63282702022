"""Token distributions: the warpers (temperature, top-k, top-p) and draws from them.

The same warpers are applied to the target's and the draft's logits, so that the
acceptance test compares the distribution the user asked for (the warped target) with
the one the draft actually proposed from.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from msd_train.checks import check_sampling


@dataclass(frozen=True)
class SamplingParams:
    """``temperature <= 0`` is greedy decoding; ``top_k = 0`` and ``top_p = 1`` disable those warpers.

    ``rank_by`` picks the log-probabilities a sampling draft tree ranks its nodes by:
    ``raw`` (the head's plain log-softmax, as EAGLE-2 ranks; the default, tau 2.687 vs
    2.682 on the tiny benchmark at temperature 0.7, benchmarks/sampling_rank/) or
    ``warped`` (the distribution the target's tokens are drawn from: temperature, top-k,
    top-p applied). Both are lossless: tree nodes are deterministic proposals, accepted
    with the warped target's probability whatever put them in the tree. Greedy trees
    always rank by raw ones.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    rank_by: str = "raw"

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def __post_init__(self):
        check_sampling(dataclasses.asdict(self))  # the bounds: msd_train/checks.py


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Warped next-token probabilities (fp32) over the last dimension.

    Greedy decoding maps to a one-hot distribution on the argmax, so that code written
    for distributions (acceptance tests, draft scores) covers both cases.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1:
        # Keep the smallest set of most likely tokens whose mass reaches top_p (the most
        # likely token always survives).
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def log_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities used to score draft-tree nodes.

    Greedy decoding, and sampling with ``rank_by="raw"``, rank by the draft's raw
    log-softmax; ``rank_by="warped"`` ranks by the warped distribution (tokens the warpers
    removed get ``-inf`` and pad the tree).
    """
    if params.greedy or params.rank_by == "raw":
        return logits.float().log_softmax(-1)
    return logits_to_probs(logits, params).log()


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of ``probs`` (..., V) by inverting the CDF with one uniform each."""
    cdf = probs.float().cumsum(-1)
    u = torch.rand(probs.shape[:-1] + (1,), generator=generator, device=probs.device, dtype=cdf.dtype)
    u = u * cdf[..., -1:]  # rows need not be normalised exactly
    idx = torch.searchsorted(cdf, u, right=True).squeeze(-1)
    return idx.clamp_max(probs.shape[-1] - 1)
