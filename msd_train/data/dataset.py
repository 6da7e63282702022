"""Conversations -> tokenised ``datasets.Dataset`` with loss masks, cached on disk.

Tokenisation goes through ``datasets.Dataset.map`` so a 665k-conversation file is
tokenised once (in parallel with ``num_proc``) and reused from the Arrow cache on every
later launch and on every rank. Images are opened here to count their visual tokens and
to catch missing or corrupt files before training starts; pixels are computed again at
collate time rather than stored.

The cache key covers what the samples read: the data files' digests and every image's
path, size and modification time (one ``stat`` per image per launch). Images are also
checked for existence at every launch, before the cache is consulted, so an image deleted
after caching is a skipped sample, and one restored after being reported missing is used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from msd_train.data.formats import BadSample, BadSampleError, read_conversations
from msd_train.paths import user_path

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

CACHE_VERSION = 2  # 2: salvaged exchanges (formats.py) and image identity in the key


@dataclass
class Split:
    """A tokenised split plus what was skipped on the way."""

    dataset: object  # datasets.Dataset with id, input_ids, loss_mask, images, n_visual, source
    skipped: list[BadSample] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.dataset)


def load_images(paths: list[str]):
    """RGB images; a missing file raises FileNotFoundError naming it (the trainer turns an
    image deleted during a run into a message: relaunching skips that sample)."""
    from PIL import Image

    images = []
    for p in paths:
        with Image.open(p) as im:
            images.append(im.convert("RGB"))
    return images


def file_digest(path: str | Path, algorithm: str = "sha1") -> str:
    """Hex digest of a file, read in 4 MiB chunks (data files and shards can be GBs)."""
    h = hashlib.new(algorithm)
    with open(user_path(path), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def stat_images(paths) -> tuple[list, str | None]:
    """(path, size, mtime) of each image path, and the first path with no file behind it
    (None when every one has one): the one existence check of training data and
    benchmarks, one ``stat`` per image. Entries that are not paths (PIL images from a Hub
    dataset) are passed over."""
    out = []
    for p in paths:
        if not isinstance(p, (str, os.PathLike)):
            continue
        try:
            st = os.stat(p)
        except OSError:
            return out, str(p)
        if not stat.S_ISREG(st.st_mode):
            return out, str(p)
        out.append((str(p), st.st_size, st.st_mtime_ns))
    return out, None


def _image_not_found(path: str, image_root) -> dict:
    """Why a sample whose image is missing cannot be used, and the fix."""
    return {"bad": f"image {Path(path).name} not found at {path}",
            "fix": f"check image_root={image_root} or remove the sample"}


def _encode_row(row: dict, target, max_length: int, image_root_hint: str) -> dict:
    """Tokenise one conversation, or say in ``bad`` why it cannot be used."""
    empty = {"input_ids": [], "loss_mask": [], "n_visual": 0, "bad": "", "fix": ""}
    try:
        images = load_images(row["images"])
    except FileNotFoundError as e:  # deleted since build_split checked it
        return {**empty, **_image_not_found(str(e.filename or ""), image_root_hint)}
    except Exception as e:  # PIL raises several types for broken files
        return {**empty, "bad": f"image cannot be decoded ({type(e).__name__}: {e})",
                "fix": "re-download or remove the image"}
    enc = target.encode(row["messages"], images)
    ids, mask, refused = truncate(enc.input_ids, enc.loss_mask, target.image_token_id, max_length)
    if refused:
        return {**empty, "bad": refused[0], "fix": refused[1]}
    return {"input_ids": ids.tolist(), "loss_mask": mask.tolist(), "n_visual": int((ids == target.image_token_id).sum()),
            "bad": "", "fix": ""}


def truncate(ids: torch.Tensor, mask: torch.Tensor, image_token_id: int, max_length: int):
    """``data.max_length``'s rule: (ids, loss mask, refusal), the sample cut to ``max_length``
    tokens, or ``refusal`` = (reason, fix) when it cannot be used. The one rule the training
    data and ``check_data.py`` share."""
    if len(ids) > max_length:
        # Truncation may only cut text: a partial image block would leave the target's
        # forward with fewer placeholders than visual embeddings.
        visual = ids == image_token_id
        if visual.any() and int(visual.nonzero().max()) >= max_length:
            return ids, mask, (f"an image block ends after max_length={max_length} (length {len(ids)})",
                               "raise data.max_length or shorten the conversation before the image")
        ids, mask = ids[:max_length], mask[:max_length]
    if int(mask.sum()) == 0:
        return ids, mask, (f"no assistant tokens left within max_length={max_length}",
                           "raise data.max_length or shorten the first user turn")
    return ids, mask, None


def split_limit(data_cfg, name: str) -> int | None:
    """How many usable conversations split ``name`` contributes, the first in file order:
    ``data.max_heldout`` for a held-out split, ``data.max_train`` (null: all) for a training one.
    The one rule the recipe, the feature store and ``check_data.py`` share."""
    if name.startswith("heldout"):
        return int(data_cfg.max_heldout)
    n = data_cfg.get("max_train")
    return None if n is None else int(n)


def build_split(
    sources: list[dict],
    target,
    max_length: int,
    on_bad_sample: str = "skip",
    cache_dir: str | None = None,
    num_proc: int = 1,
    limit: int | None = None,
) -> Split:
    """Read, validate and tokenise every source of one split.

    ``sources`` are config entries ``{path, format, image_root}``. With
    ``on_bad_sample=error`` the first bad sample raises :class:`BadSampleError`;
    with ``skip`` it is counted and returned in ``Split.skipped``.
    """
    import datasets

    if on_bad_sample not in ("skip", "error"):
        raise ValueError(f"data.on_bad_sample={on_bad_sample}: use skip or error")
    rows, skipped = [], []
    images = hashlib.sha1()
    for src in sources:
        for rec in read_conversations(src["path"], src.get("format", "auto"), src.get("image_root")):
            if not isinstance(rec, BadSample):
                stamp, missing = stat_images(rec["images"])
                if missing is not None:
                    why = _image_not_found(missing, src.get("image_root"))
                    rec = BadSample(rec["source"], rec["index"], rec["id"], why["bad"], why["fix"])
                else:
                    images.update(json.dumps(stamp).encode())
            if isinstance(rec, BadSample):
                if on_bad_sample == "error":
                    raise BadSampleError(rec)
                skipped.append(rec)
                continue
            rows.append(rec)
            if limit and len(rows) >= limit:
                break
    if not rows:
        return Split(datasets.Dataset.from_dict({}), skipped)

    key = json.dumps({
        "v": CACHE_VERSION, "files": [(s["path"], file_digest(s["path"]), str(s.get("image_root"))) for s in sources],
        "target": target.name, "template": target.chat_template, "max_length": max_length,
        "vocab": len(target.tokenizer), "limit": limit, "images": images.hexdigest(),
    }, sort_keys=True)
    fingerprint = hashlib.sha1(key.encode()).hexdigest()[:16]
    ds = datasets.Dataset.from_list(rows)
    kwargs = {}
    if cache_dir:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        kwargs["cache_file_name"] = str(Path(cache_dir) / f"tokenised-{fingerprint}.arrow")
    roots = ",".join(str(s.get("image_root")) for s in sources)
    ds = ds.map(
        _encode_row,
        fn_kwargs={"target": target.tokenizing_view(), "max_length": max_length, "image_root_hint": roots},
        remove_columns=["messages"],
        num_proc=num_proc if num_proc > 1 else None,
        new_fingerprint=fingerprint,
        desc="tokenising",
        **kwargs,
    )
    bad_idx = [i for i, b in enumerate(ds["bad"]) if b]
    if bad_idx:
        for i in bad_idx:
            r = ds[i]
            bad = BadSample(r["source"], r["index"], r["id"], r["bad"], r["fix"])
            if on_bad_sample == "error":
                raise BadSampleError(bad)
            skipped.append(bad)
        keep = sorted(set(range(len(ds))) - set(bad_idx))
        ds = ds.select(keep)
    ds = ds.remove_columns(["bad", "fix"])
    return Split(ds, skipped)


def write_skipped(path: str | Path, skipped: list[BadSample]) -> None:
    """List skipped samples, one JSON object a line, for the user to inspect or fix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for b in skipped:
            f.write(json.dumps(b.to_dict()) + "\n")
