"""Draft vocabularies: which target tokens a head drafts over.

An msd3 head is trained over a fixed draft vocabulary (EAGLE-3's ``d2t``/``t2d``, built by
``draft_vocabulary`` from the stage's token counts). An msd head drafts through the
target's own lm_head, over the whole vocabulary; at decode time it can be restricted to
the ``size`` target tokens its training data used most (``decoding.draft_vocab``). The
decoder verifies every draft token against the target, so a restriction never changes
the output: it only stops the head proposing rare tokens, and makes each draft step's
lm_head (on a small model most of the step: ``benchmarks/real_lm/README.md``)
``V / size`` times cheaper.

Both rules read the target's lm_head over a subset of its vocabulary the same way: a
``VocabSubset`` (the ids, their lm_head rows copied once, the membership mask), which the
token loss over ``draft.train_vocab`` (``draft/loss.py``), the msd3 objective's targets and
an msd head's decode-time restriction all use.

The counts travel with the head: training writes ``token_counts.safetensors`` beside
every export (assistant tokens of the stage's training data); ``scripts/count_tokens.py``
writes it for a head that was exported without one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from msd_train.errors import ConfigError

COUNTS_FILE = "token_counts.safetensors"


def token_counts(datasets, vocab_size: int, batch_size: int = 8192) -> torch.Tensor:
    """How often each target id is an assistant (loss) token in tokenised ``datasets.Dataset``s.
    Training runs this at every stage's start on every rank, so it reads the two columns as
    Arrow a batch at a time, their values flattened without a Python object per row, and counts
    each batch in one ``bincount``."""
    import pyarrow.compute as pc

    counts = np.zeros(vocab_size, dtype=np.int64)
    for ds in datasets:
        if len(ds) == 0:  # an unused split: possibly no columns at all
            continue
        columns = ds.select_columns(["input_ids", "loss_mask"]).with_format("arrow")
        for batch in columns.iter(batch_size=batch_size):
            ids = pc.list_flatten(batch.column("input_ids")).to_numpy()
            mask = pc.list_flatten(batch.column("loss_mask")).to_numpy().astype(bool)
            counts += np.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return torch.from_numpy(counts)


def most_frequent(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` most frequent ids of ``counts`` (V,), ties and unseen ids by id, sorted."""
    order = torch.argsort(-counts.to(torch.long), stable=True)[:size]  # stable: ties keep id order
    return order.sort().values


def draft_vocabulary(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for the ``size`` most frequent target ids of ``counts`` (V,) (ties and
    unseen ids by id), sorted: draft id i is target id i + d2t[i]; t2d[v] marks members."""
    ids = most_frequent(counts, size)
    t2d = torch.zeros(len(counts), dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(size), t2d


class VocabSubset:
    """Target ids ``ids`` (N,), in the order given, with the target lm_head's rows for them,
    copied once (a gather per call would cost what the subset saves): ``subset(x)`` is
    ``lm_head(x)[..., ids]`` at N / V of the product, ``subset.logits(x)`` the same over the
    whole vocabulary with -inf at every other id; ``member`` (V,) marks the ids. Over an
    lm_head that runs on oneDNN (``targets.cpu_linear.PackedLinear``: eval.py in fp32 on a
    CPU) the rows run there too, so a restricted draft step computes as the full one does."""

    def __init__(self, lm_head: torch.nn.Module, ids: torch.Tensor):
        weight = lm_head.weight
        self.ids = ids.to(weight.device)
        self.vocab_size = weight.shape[0]
        self.member = torch.zeros(self.vocab_size, dtype=torch.bool, device=weight.device)
        self.member[self.ids] = True
        self.weight = weight[self.ids].detach().contiguous()
        bias = getattr(lm_head, "bias", None)
        self.bias = None if bias is None else bias[self.ids].detach()
        self._packed = None
        from msd_train.targets.cpu_linear import PackedLinear

        if isinstance(lm_head, PackedLinear):
            rows = torch.nn.Linear(self.weight.shape[1], len(self.ids), bias=self.bias is not None, device="meta")
            rows.weight = torch.nn.Parameter(self.weight, requires_grad=False)
            if self.bias is not None:
                rows.bias = torch.nn.Parameter(self.bias, requires_grad=False)
            self._packed = PackedLinear(rows)

    @property
    def size(self) -> int:
        return len(self.ids)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """(..., N) logits over the subset."""
        return F.linear(x, self.weight, self.bias) if self._packed is None else self._packed(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """(..., V) logits over the whole vocabulary: the subset's, -inf at every other id."""
        return on_target_ids(self(x), self.ids, self.vocab_size)


def on_target_ids(small: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(..., N) logits of target ids ``ids`` put at those ids of a (..., V) row of -inf."""
    out = small.new_full((*small.shape[:-1], vocab_size), float("-inf"))
    return out.index_copy_(-1, ids, small)


def save_counts(folder: str | Path, counts: torch.Tensor) -> Path:
    """Write ``counts`` into a head folder (``COUNTS_FILE``); returns the file."""
    from safetensors.torch import save_file

    path = Path(folder) / COUNTS_FILE
    save_file({"counts": counts.to(torch.long).contiguous()}, str(path))
    return path


def load_counts(folder: str | Path | None) -> torch.Tensor | None:
    """The counts saved in a head folder, or None when it has none."""
    if folder is None or not (Path(folder) / COUNTS_FILE).is_file():
        return None
    from safetensors.torch import load_file

    path = Path(folder) / COUNTS_FILE
    try:
        return load_file(str(path))["counts"]
    except Exception as e:  # safetensors' own error (a header that does not parse), or no "counts"
        raise ConfigError(f"{path}: not the token counts this project writes ({type(e).__name__}: {e}); nothing in "
                          f"it was run or used. Put back the file it was copied from, or write it again with "
                          f"`python scripts/count_tokens.py`") from e


class ReadsTargetLMHead:
    """The head interface's logits for heads whose states the target's own ``lm_head`` reads
    (msd, dflash): all of its rows, or at decode time only those of a draft vocabulary
    (:meth:`restrict_vocabulary`, a :class:`VocabSubset` made once). A head sets
    ``self._vocab = None`` in its ``__init__``."""

    supports_restrict_vocabulary = True
    _vocab: VocabSubset | None

    def logits(self, states: torch.Tensor, target) -> torch.Tensor:
        """The target's lm_head over the head's states (its rows of the draft vocabulary,
        -inf elsewhere, when one is set)."""
        states = states.to(target.dtype)
        return target.lm_head(states) if self._vocab is None else self._vocab.logits(states)

    def logits_on_ids(self, states: torch.Tensor, target) -> tuple[torch.Tensor, torch.Tensor | None]:
        states = states.to(target.dtype)
        return (target.lm_head(states), None) if self._vocab is None else (self._vocab(states), self._vocab.ids)

    def restrict_vocabulary(self, target, ids: torch.Tensor | None) -> None:
        """Draft over target ids ``ids`` only (None: the whole vocabulary again)."""
        if ids is None:
            self._vocab = None
            return
        ids = ids.to(target.lm_head.weight.device)
        if self._vocab is not None and torch.equal(self._vocab.ids, ids):
            return  # already these rows (a benchmark sets it once per prompt)
        self._vocab = VocabSubset(target.lm_head, ids)
