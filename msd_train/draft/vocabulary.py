"""Draft vocabularies: which target tokens a head drafts over.

An msd3 head is trained over a fixed draft vocabulary (EAGLE-3's ``d2t``/``t2d``, built by
``draft_vocabulary`` from the stage's token counts). An msd head drafts through the
target's own lm_head, over the whole vocabulary; at decode time it can be restricted to
the ``size`` target tokens its training data used most (``decoding.draft_vocab``). The
decoder verifies every draft token against the target, so a restriction never changes
the output: it only stops the head proposing rare tokens, and makes each draft step's
lm_head (on a small model most of the step: ``benchmarks/real_lm/README.md``)
``V / size`` times cheaper.

The counts travel with the head: training writes ``token_counts.safetensors`` beside
every export (assistant tokens of the stage's training data); ``scripts/count_tokens.py``
writes it for a head that was exported without one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

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

    return load_file(str(Path(folder) / COUNTS_FILE))["counts"]
