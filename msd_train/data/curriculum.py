"""The stage curriculum: which samples form each global batch, decided from (seed, step).

Every rank and every resume computes the same plan, so nothing about the data order is
communicated or stored beyond two counters. Stage 1 uses share 0 (text only); stage 2
ramps the multimodal share of each global batch from ``start`` to ``end`` over
``ramp_steps`` optimizer steps. MSD's reference draws the modality per sample; here the
number of multimodal samples in a global batch of G is ``share * G`` rounded
stochastically (seeded), so the realised share tracks the schedule within 1/G at every
step and equals it in expectation.

Length bucketing (``train.bucket_window=W``): conversations vary in length (the target's
answers to ShareGPT prompts: 35% of a random micro-batch of 4 is padding), and every padded
position costs a forward and backward of the head (and of the target online). With W > 0,
each epoch's shuffled order is cut into windows of W samples, each window sorted by length
and its global-batch-sized groups shuffled; each global batch is then sorted by length
before it is split into micro-batches. Samples still meet the head once per epoch, in an
order fixed by (seed, epoch) as before: resume and ranks are unchanged.
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


def sample_lengths(dataset) -> np.ndarray:
    """Token count of each sample of a tokenised ``datasets.Dataset`` (length bucketing)."""
    if len(dataset) == 0:
        return np.zeros(0, dtype=np.int64)
    ids = dataset.select_columns(["input_ids"]).with_format("numpy")
    return np.fromiter((len(r) for b in ids.iter(batch_size=4096) for r in b["input_ids"]), dtype=np.int64,
                       count=len(dataset))


def _rng(seed: int, *keys: int) -> np.random.Generator:
    return np.random.default_rng([seed, *keys])


@dataclass
class Stream:
    """An endless, epoch-wise shuffled walk over one dataset; ``position`` draws so far.
    With ``lengths`` and ``window``: bucketed by length (module docstring), in groups of ``group``."""

    size: int
    seed: int
    salt: int
    position: int = 0
    lengths: np.ndarray | None = None
    window: int = 0
    group: int = 1

    def order(self, epoch: int) -> np.ndarray:
        perm = _rng(self.seed, self.salt, epoch).permutation(self.size)
        if not self.window or self.lengths is None:
            return perm
        out = []
        rng = _rng(self.seed, self.salt, epoch, 5)
        for w in range(0, self.size, self.window):
            part = perm[w:w + self.window]
            part = part[np.argsort(self.lengths[part], kind="stable")]
            groups = [part[g:g + self.group] for g in range(0, len(part), self.group)]
            out.extend(groups[i] for i in rng.permutation(len(groups)))
        return np.concatenate(out)

    def take(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            epoch, offset = divmod(self.position, self.size)
            perm = self.order(epoch)
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
    #: length bucketing (module docstring): each dataset's sample lengths, and the window
    text_lengths: np.ndarray | None = None
    mm_lengths: np.ndarray | None = None
    bucket_window: int = 0

    def __post_init__(self):
        bucket = {"window": int(self.bucket_window), "group": self.global_batch}
        self.text = Stream(self.n_text, self.seed, 1, lengths=self.text_lengths, **bucket)
        self.mm = Stream(self.n_mm, self.seed, 2, lengths=self.mm_lengths, **bucket)

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
        items = [items[i] for i in order]
        if self.bucket_window:  # micro-batches of similar lengths
            lengths = {"mm": self.mm_lengths, "text": self.text_lengths}
            items.sort(key=lambda it: int(lengths[it[0]][it[1]]))
        return items

    def state_dict(self) -> dict:
        return {"text": self.text.position, "mm": self.mm.position}

    def load_state_dict(self, state: dict) -> None:
        self.text.position = state["text"]
        self.mm.position = state["mm"]
