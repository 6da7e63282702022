"""The stage curriculum: which samples form each global batch, decided from (seed, step).

Every rank and every resume computes the same plan, so nothing about the data order is
communicated or stored beyond two counters. Stage 1 uses share 0 (text only); stage 2
ramps the multimodal share of each global batch from ``start`` to ``end`` over
``ramp_steps`` optimizer steps. MSD's reference draws the modality per sample; here the
number of multimodal samples in a global batch of G is ``share * G`` rounded
stochastically (seeded), so the realised share tracks the schedule within 1/G at every
step and equals it in expectation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def mm_share(step: int, start: float, end: float, ramp_steps: int, schedule: str = "linear") -> float:
    """Scheduled multimodal share at optimizer step ``step`` (0-based)."""
    if ramp_steps <= 0:
        return float(end)
    x = min(max(step / ramp_steps, 0.0), 1.0)
    if schedule == "linear":
        f = x
    elif schedule == "cosine":
        f = 0.5 * (1 - math.cos(math.pi * x))
    elif schedule == "step":
        f = 1.0 if x >= 1.0 else 0.0
    else:
        raise ValueError(f"stage.curriculum.schedule={schedule}: use linear, cosine or step")
    return float(start + (end - start) * f)


def _rng(seed: int, *keys: int) -> np.random.Generator:
    return np.random.default_rng([seed, *keys])


@dataclass
class Stream:
    """An endless, epoch-wise shuffled walk over one dataset; ``position`` draws so far."""

    size: int
    seed: int
    salt: int
    position: int = 0

    def take(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            epoch, offset = divmod(self.position, self.size)
            perm = _rng(self.seed, self.salt, epoch).permutation(self.size)
            k = min(n - len(out), self.size - offset)
            out.extend(int(i) for i in perm[offset:offset + k])
            self.position += k
        return out


@dataclass
class Curriculum:
    """Plans global batches: ``plan(step)`` -> list of (modality, index) of length G."""

    n_text: int
    n_mm: int
    global_batch: int
    seed: int
    start: float = 0.0
    end: float = 0.0
    ramp_steps: int = 0
    schedule: str = "linear"

    def __post_init__(self):
        self.text = Stream(self.n_text, self.seed, 1)
        self.mm = Stream(self.n_mm, self.seed, 2)

    def n_multimodal(self, step: int) -> int:
        share = mm_share(step, self.start, self.end, self.ramp_steps, self.schedule)
        want = share * self.global_batch
        k = int(want) + int(_rng(self.seed, 3, step).random() < want - int(want))
        if self.n_mm == 0:
            k = 0
        if self.n_text == 0:
            k = self.global_batch
        return k

    def plan(self, step: int) -> list[tuple[str, int]]:
        """The global batch of ``step``; advances the streams (call once per step, in order)."""
        k = self.n_multimodal(step)
        items = [("mm", i) for i in self.mm.take(k)] + [("text", i) for i in self.text.take(self.global_batch - k)]
        order = _rng(self.seed, 4, step).permutation(len(items))
        return [items[i] for i in order]

    def state_dict(self) -> dict:
        return {"text": self.text.position, "mm": self.mm.position}

    def load_state_dict(self, state: dict) -> None:
        self.text.position = state["text"]
        self.mm.position = state["mm"]
