"""Vocabulary mapping between a released head and the target it runs with.

The released LLaVA-1.5 heads carry the original LLaVA vocabulary (32000 rows, the Vicuna
tokenizer); `llava-hf` targets have 32064 rows: the same 32000 tokens, then `<image>`,
`<pad>` and padding to a multiple of 64 appended. Token ids below the released size
mean the same token in both; the appended ids have no released counterpart (the
original LLaVA code puts no embedding row behind its image placeholder: image slots
get projector outputs). Qwen2-VL heads share the target's vocabulary, so their mapping
is the identity.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VocabMap:
    """Ids and embedding rows between a released vocabulary and a target's.

    The two vocabularies agree on ids `0 .. shared-1` (`shared = min(sizes)`); ids at or
    past `shared` exist on one side only.
    """

    released_size: int
    target_size: int

    @property
    def shared(self) -> int:
        return min(self.released_size, self.target_size)

    def _map(self, ids: torch.Tensor, size_from: int, missing: int | None, what: str) -> torch.Tensor:
        ids = torch.as_tensor(ids)
        if ((ids < 0) | (ids >= size_from)).any():
            bad = ids[(ids < 0) | (ids >= size_from)].unique()[:8].tolist()
            raise ValueError(f"{what}: token ids {bad} are outside a vocabulary of {size_from}")
        absent = ids >= self.shared
        if absent.any():
            if missing is None:
                bad = ids[absent].unique()[:8].tolist()
                raise ValueError(
                    f"{what}: token ids {bad} have no counterpart (the two vocabularies share ids "
                    f"0..{self.shared - 1}); pass missing=<id> to substitute one"
                )
            ids = ids.masked_fill(absent, missing)
        return ids

    def ids_to_target(self, ids: torch.Tensor, missing: int | None = None) -> torch.Tensor:
        """Released-vocabulary ids -> target ids (the identity on shared ids)."""
        return self._map(ids, self.released_size, missing, "released -> target")

    def ids_to_released(self, ids: torch.Tensor, missing: int | None = None) -> torch.Tensor:
        """Target ids -> released ids; appended ids (e.g. `<image>`, `<pad>`) raise unless
        `missing` gives a substitute."""
        return self._map(ids, self.target_size, missing, "target -> released")

    def rows_to_target(self, released_rows: torch.Tensor, fill: torch.Tensor | None = None) -> torch.Tensor:
        """A released embedding table [released_size, H] -> [target_size, H].

        Rows the released table lacks come from `fill` (normally the target's own table:
        its image and padding rows), else zeros.
        """
        self._check_rows(released_rows, self.released_size, "released")
        out = released_rows.new_zeros(self.target_size, released_rows.shape[1])
        if fill is not None:
            self._check_rows(fill, self.target_size, "fill")
            out.copy_(fill)
        out[: self.shared] = released_rows[: self.shared]
        return out

    def rows_to_released(self, target_rows: torch.Tensor) -> torch.Tensor:
        """A target embedding table [target_size, H] -> [released_size, H] (its first rows)."""
        self._check_rows(target_rows, self.target_size, "target")
        if self.target_size < self.released_size:
            raise ValueError(
                f"the target has {self.target_size} embedding rows, fewer than the released "
                f"vocabulary's {self.released_size}: rows {self.target_size}.. cannot be made up"
            )
        return target_rows[: self.released_size].clone()

    @staticmethod
    def _check_rows(rows: torch.Tensor, size: int, what: str) -> None:
        if rows.ndim != 2 or rows.shape[0] != size:
            raise ValueError(f"{what} embedding must be [{size}, hidden], got {list(rows.shape)}")


@dataclass
class EmbeddingCheck:
    """Does a released `embed_tokens` equal the target's table on the shared ids?"""

    released_rows: int
    target_rows: int
    compared_rows: int
    mismatched_rows: int
    max_abs_diff: float
    dtype: str

    @property
    def ok(self) -> bool:
        return self.mismatched_rows == 0 and self.released_rows <= self.target_rows

    def message(self) -> str:
        if self.ok:
            return (f"embed_tokens: the released {self.released_rows} rows equal the target's first "
                    f"{self.compared_rows} rows (compared in {self.dtype})")
        extra = (f"; the released table has {self.released_rows - self.target_rows} rows more than the target"
                 if self.released_rows > self.target_rows else "")
        return (f"embed_tokens: {self.mismatched_rows} of {self.compared_rows} shared rows differ from the "
                f"target's (max |diff| {self.max_abs_diff:.3g}, compared in {self.dtype}){extra}. The head was "
                f"probably trained for another target (or another revision of it): expect low acceptance")

    def as_dict(self) -> dict:
        return {"ok": self.ok, "released_rows": self.released_rows, "target_rows": self.target_rows,
                "compared_rows": self.compared_rows, "mismatched_rows": self.mismatched_rows,
                "max_abs_diff": self.max_abs_diff, "dtype": self.dtype}


def check_embedding(released: torch.Tensor, target: torch.Tensor) -> EmbeddingCheck:
    """Compare the released table with the target's on the shared ids, row by row.

    Both are cast to the coarser of the two dtypes (a fp16 head against a bf16-loaded
    target is compared in bf16), so a faithful copy compares equal.
    """
    vmap = VocabMap(released.shape[0], target.shape[0])
    n = vmap.shared
    coarse = max((released.dtype, target.dtype), key=lambda d: torch.finfo(d).eps)
    a = released[:n].to(coarse).float().cpu()
    b = target[:n].to(coarse).float().cpu()
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"embed_tokens width {a.shape[1]} does not match the target's hidden size {b.shape[1]}")
    diff = (a - b).abs()
    row_diff = diff.amax(dim=1)
    return EmbeddingCheck(
        released_rows=released.shape[0], target_rows=target.shape[0], compared_rows=n,
        mismatched_rows=int((row_diff > 0).sum()), max_abs_diff=float(row_diff.max()) if n else 0.0,
        dtype=str(coarse).replace("torch.", ""),
    )
