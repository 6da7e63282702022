"""The offline feature store: safetensors shards plus a JSON manifest.

A store is a folder::

    manifest.json                  target identity, data fingerprint, dtype, shard list
    text-00000.safetensors         samples 0..S-1 of the text split
    multimodal-00003.safetensors   ...
    progress/rank-0.jsonl          one line per finished shard (what resume reads)

Each shard holds its samples' tensors concatenated along the token axis, and an
``index`` table that says where each sample's rows start:

    hidden          (R, H)   last-layer post-norm states, store dtype (bf16/fp16/fp32)
    prefix_hidden   (K, H)   the states of leading tokens the shard's samples share (see prefix_plan)
    visual          (V, H)   projector outputs, the image blocks only
    input_ids       (T,)     uint16 when the vocabulary fits, else int32
    loss_mask_bits  (M,)     uint8, the loss mask packed eight tokens a byte
    position_ids    (3, Q)   int32, M-RoPE targets' samples with images only
    top             (R,)     int32, the target's top-1 id at each ``hidden`` row (argmax of its
                             lm_head there): a pruned token loss reads it instead of a
                             full-vocabulary product (stores written before it have none)
    prefix_top      (K,)     int32, the same for ``prefix_hidden``
    index           (N, 11)  int64, columns INDEX_COLUMNS

Only rows training reads are stored. The draft at position t reads h_t as input and is
trained towards h_{t+1} where token t+2 carries loss, so of a sample whose last loss token
sits at index ``last`` it needs h_0 .. h_{last-1}; later rows (at least the final token's)
are left out and read back as zeros. Causal attention makes h_t a function of tokens
0..t, so samples that open with the same tokens (the BOS token, the chat template's
system prompt, up to the first image) have the same states there: a shard stores them
once and each sample records how many of them it shares. Text embeddings are the frozen table applied to the ids, so only the
visual block of ``inputs_embeds`` is stored. A CRC32 per sample (over its rows, visual
rows and ids as stored) is checked on every read; a SHA-256 per shard is in the manifest.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from msd_train.data.dataset import file_digest
from msd_train.paths import user_path
from msd_train.runtime import DTYPES, atomic_file

FORMAT = "msd-train-features"
VERSION = 1
MANIFEST = "manifest.json"
INDEX_COLUMNS = ("token_start", "n_tokens", "hidden_start", "n_hidden", "visual_start", "n_visual",
                 "pos_start", "rope_delta", "crc32", "mask_start", "prefix_len")
_COL = {name: i for i, name in enumerate(INDEX_COLUMNS)}


class FeatureStoreError(ValueError):
    """A store that cannot be used as it is; the message names the file and the fix."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def ids_dtype(vocab: int) -> torch.dtype:
    """The narrowest integer type that holds every token id (LLaVA 32064 fits 16 bits)."""
    return torch.uint16 if vocab <= 1 << 16 else torch.int32


def sha256_file(path: str | Path) -> str:
    return file_digest(path, "sha256")


def as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)


def sample_crc(rows: torch.Tensor, visual: torch.Tensor, ids: torch.Tensor) -> int:
    return zlib.crc32(as_bytes(ids), zlib.crc32(as_bytes(visual), zlib.crc32(as_bytes(rows))))


# ----------------------------------------------------------------------------- layout
def needed_rows(loss_mask) -> int:
    """Rows h_0 .. h_{last-1} that training reads, ``last`` the index of the last loss token."""
    nz = np.flatnonzero(np.asarray(loss_mask))
    return int(nz[-1]) if len(nz) else 0


def prefix_plan(ids: list, image_token_id: int, loss_masks: list) -> tuple[int, list[int]]:
    """Which sample's leading states a shard stores once, and how many of them each sample shares.

    The reference is a sample of the largest group opening with the same 16 tokens (so
    one sample with a custom system prompt does not spoil the others). Sample i shares
    the reference's first P_i tokens: their common prefix, stopped at either's first image
    token and before its needed rows run out.
    """
    seqs = [np.asarray(x) for x in ids]

    def cap(i):
        img = np.flatnonzero(seqs[i] == image_token_id)
        return min(len(seqs[i]), needed_rows(loss_masks[i]), int(img[0]) if len(img) else len(seqs[i]))

    caps = [cap(i) for i in range(len(seqs))]
    heads = [tuple(seqs[i][:min(16, caps[i])].tolist()) for i in range(len(seqs))]
    counts: dict[tuple, int] = {}
    for h in heads:
        counts[h] = counts.get(h, 0) + 1
    ref = heads.index(max(counts, key=lambda h: (counts[h], len(h))))
    out = []
    for i, seq in enumerate(seqs):
        m = min(caps[i], caps[ref])
        diff = np.flatnonzero(seqs[ref][:m] != seq[:m])
        out.append(int(diff[0]) if len(diff) else m)
    return ref, out


def sample_bytes(n_tokens: int, n_visual: int, n_rows: int, hidden_size: int, itemsize: int,
                 ids_itemsize: int, positions: bool) -> int:
    """Bytes one sample adds to a shard (excluding the shard's shared prefix and header)."""
    return ((n_rows + n_visual) * hidden_size * itemsize + n_tokens * ids_itemsize + math.ceil(n_tokens / 8)
            + 8 * len(INDEX_COLUMNS) + (12 * n_tokens if positions else 0))


# ----------------------------------------------------------------------------- writing
@dataclass
class SampleFeatures:
    """One sample's features as the generator produces them (CPU tensors, full length)."""

    key: str
    input_ids: torch.Tensor  # (n,)
    loss_mask: torch.Tensor  # (n,)
    hidden: torch.Tensor  # (n, H)
    visual: torch.Tensor  # (V, H)
    position_ids: torch.Tensor | None = None  # (3, n) where not trivial
    rope_delta: int = 0
    top: torch.Tensor | None = None  # (n,) the target's top-1 id at each position


def write_shard(path: str | Path, samples: list[SampleFeatures], dtype: torch.dtype, id_dtype: torch.dtype,
                image_token_id: int) -> dict:
    """Write ``samples`` as one shard: to ``path.tmp``, fsynced, then renamed into place.

    Returns the shard's record for the manifest (sample and token counts, bytes, SHA-256).
    """
    path = Path(path)
    if not samples:
        raise ValueError(f"{path}: a shard needs at least one sample")
    H = samples[0].hidden.shape[-1]
    masks = [s.loss_mask for s in samples]
    ref, shares = prefix_plan([s.input_ids.tolist() for s in samples], image_token_id, [m.tolist() for m in masks])
    hidden, visual, ids, bits, pos, index, tops = [], [], [], [], [], [], []
    with_top = all(s.top is not None for s in samples)
    tok = hrow = vrow = prow = mbyte = 0
    for s, P in zip(samples, shares):
        n = len(s.input_ids)
        rows = s.hidden[P:needed_rows(s.loss_mask)].to(dtype)
        vis = s.visual.to(dtype)
        if dtype == torch.float16 and not (torch.isfinite(rows).all() and torch.isfinite(vis).all()):
            raise FeatureStoreError(
                f"sample {s.key}: features overflow float16 (|x| > 65504); set features.dtype=bf16")
        sid = s.input_ids.to(torch.int64).to(id_dtype)
        packed = torch.from_numpy(np.packbits(s.loss_mask.numpy().astype(bool)))
        has_pos = s.position_ids is not None
        index.append([tok, n, hrow, len(rows), vrow, len(vis), prow if has_pos else -1, int(s.rope_delta),
                      sample_crc(rows, vis, sid), mbyte, P])
        hidden.append(rows)
        if with_top:
            tops.append(s.top[P:P + len(rows)].to(torch.int32))
        visual.append(vis)
        ids.append(sid)
        bits.append(packed)
        if has_pos:
            pos.append(s.position_ids.to(torch.int32))
            prow += n
        tok, hrow, vrow, mbyte = tok + n, hrow + len(rows), vrow + len(vis), mbyte + len(packed)
    prefix = samples[ref].hidden[:max(shares)].to(dtype)
    tensors = {
        "hidden": torch.cat(hidden) if hrow else torch.zeros(0, H, dtype=dtype),
        "prefix_hidden": prefix.contiguous(),
        "visual": torch.cat(visual) if vrow else torch.zeros(0, samples[0].visual.shape[-1], dtype=dtype),
        "input_ids": torch.cat(ids),
        "loss_mask_bits": torch.cat(bits),
        "position_ids": torch.cat(pos, dim=1) if pos else torch.zeros(3, 0, dtype=torch.int32),
        "index": torch.tensor(index, dtype=torch.int64),
    }
    if with_top:
        tensors["top"] = torch.cat(tops) if hrow else torch.zeros(0, dtype=torch.int32)
        tensors["prefix_top"] = samples[ref].top[:max(shares)].to(torch.int32).contiguous()
    # One metadata entry: safetensors writes several in hash order, which would make equal
    # shards differ byte-wise (and so in checksum) from one run to the next.
    meta = {"msd_features": json.dumps({
        "format": FORMAT, "version": VERSION, "keys": [s.key for s in samples], "prefix_len": len(prefix),
        "prefix_crc32": sample_crc(prefix, prefix[:0], ids[0][:0]), "index_columns": INDEX_COLUMNS})}
    with atomic_file(path, fsync=True) as tmp:
        save_file(tensors, str(tmp), metadata=meta)
        os.chmod(tmp, 0o666 & ~_umask())  # safetensors creates files private to the writer
    return {"file": path.name, "n_samples": len(samples), "n_tokens": tok, "n_visual": vrow,
            "n_hidden_rows": hrow + len(prefix), "bytes": path.stat().st_size, "sha256": sha256_file(path)}


# ----------------------------------------------------------------------------- reading
@dataclass
class StoredSample:
    """One sample as read back: ``hidden`` rows start at ``prefix_len``; rows past them are zeros."""

    key: str
    input_ids: torch.Tensor  # (n,) int64
    loss_mask: torch.Tensor  # (n,) int64
    prefix: torch.Tensor  # (P, H)
    rows: torch.Tensor  # (r, H) rows P .. P+r-1
    visual: torch.Tensor  # (V, H)
    position_ids: torch.Tensor | None
    rope_delta: int
    top: torch.Tensor | None = None  # (P + r,) int64: the target's top-1 at the prefix and stored rows

    def hidden(self) -> torch.Tensor:
        """The (n, H) states, zeros where training reads none."""
        n, P = len(self.input_ids), len(self.prefix)
        out = torch.zeros(n, self.rows.shape[-1], dtype=self.rows.dtype)
        out[:P] = self.prefix
        out[P:P + len(self.rows)] = self.rows
        return out


def shard_metadata(handle) -> dict:
    """The JSON metadata of an open shard: format, keys, prefix length and checksum."""
    meta = handle.metadata() or {}
    if "msd_features" not in meta:
        raise FeatureStoreError("a shard without msd-train feature metadata (not written by generate_features, "
                                "or by an older version); regenerate the store")
    return json.loads(meta["msd_features"])


def parse_manifest(mpath: Path) -> dict:
    """The JSON of a store's manifest; a cut or hand-edited file is named with the fix."""
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FeatureStoreError(
            f"{mpath} is damaged (cut short or edited: {e}); run the command that made the store again "
            f"(`python scripts/generate_features.py features.path={mpath.parent}` with the same target and data): "
            f"it checks the finished shards, keeps them, and rewrites {MANIFEST}") from None
    if not isinstance(manifest, dict):
        raise FeatureStoreError(f"{mpath} is not a feature store manifest (a JSON object); regenerate the store")
    return manifest


def read_manifest(path: str | Path) -> dict:
    path = user_path(path)
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise FeatureStoreError(
            f"{path}: no {MANIFEST}; not a feature store (generate one with "
            f"`python scripts/generate_features.py features.path={path}`)")
    manifest = parse_manifest(mpath)
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise FeatureStoreError(f"{mpath}: format {manifest.get('format')} v{manifest.get('version')} is not "
                                f"{FORMAT} v{VERSION}; regenerate the store with this version")
    return manifest


class FeatureStore:
    """Memory-mapped read access to a finished store: ``store.read(key) -> StoredSample``.

    ``verify``: ``quick`` checks at open that every shard exists with its recorded size,
    ``full`` also checks every shard's SHA-256 (reads the whole store), ``none`` skips
    both. Each sample's CRC32 is checked on read in all modes but ``none``.
    """

    def __init__(self, path: str | Path, verify: str = "quick", max_open: int = 64):
        if verify not in ("none", "quick", "full"):
            raise ValueError(f"features.verify={verify}: use none, quick or full")
        self.path = user_path(path)
        self.manifest = read_manifest(self.path)
        if not self.manifest.get("complete"):
            raise FeatureStoreError(
                f"{self.path}: generation has not finished ({len(self.manifest.get('shards', []))} shards "
                f"recorded); re-run the same generate_features command to resume it")
        self.verify = verify
        self.dtype = DTYPES[self.manifest["dtype"]]
        self.shards = self.manifest["shards"]
        self.max_open = max_open
        self._open: OrderedDict[int, object] = OrderedDict()
        self._prefix: dict[int, torch.Tensor] = {}
        self.index: dict[str, tuple[int, int]] = {}
        self._tables: list[torch.Tensor] = []
        bad = []
        for s, rec in enumerate(self.shards):
            f = self.path / rec["file"]
            if verify != "none":
                if not f.is_file():
                    bad.append(f"{f}: missing")
                    continue
                if f.stat().st_size != rec["bytes"]:
                    bad.append(f"{f}: {f.stat().st_size} bytes, the manifest says {rec['bytes']} (truncated or replaced)")
                    continue
                if verify == "full" and sha256_file(f) != rec["sha256"]:
                    bad.append(f"{f}: SHA-256 differs from the manifest (corrupt)")
                    continue
            try:
                h = safe_open(str(f), "pt")
            except Exception as e:  # safetensors' own error: a header that does not parse (not a shard)
                raise FeatureStoreError(
                    f"{f}: not a safetensors shard ({type(e).__name__}: {e}); nothing in it was run or used. "
                    f"Re-run generate_features with the same features.path: it regenerates the shards that fail "
                    f"its checks") from e
            with h:
                meta = shard_metadata(h)
                if tuple(meta.get("index_columns", ())) != INDEX_COLUMNS:
                    raise FeatureStoreError(f"{f}: written by another version of the store layout; regenerate the store")
                keys = meta["keys"]
                self._tables.append(h.get_tensor("index"))
            for j, key in enumerate(keys):
                self.index[key] = (s, j)
        if bad:
            raise FeatureStoreError(
                "feature store shards failed verification:\n  " + "\n  ".join(bad)
                + "\nre-run generate_features with the same features.path: it regenerates exactly these shards")

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, key: str) -> bool:
        return key in self.index

    def _handle(self, s: int):
        h = self._open.get(s)
        if h is None:
            h = safe_open(str(self.path / self.shards[s]["file"]), "pt")
            self._open[s] = h
            if len(self._open) > self.max_open:
                self._open.popitem(last=False)
        else:
            self._open.move_to_end(s)
        return h

    def _prefix_rows(self, s: int, h) -> torch.Tensor:
        if s not in self._prefix:
            prefix = h.get_tensor("prefix_hidden")
            crc = shard_metadata(h)["prefix_crc32"]
            if self.verify != "none" and sample_crc(prefix, prefix[:0], prefix.new_zeros(0)) != crc:
                raise FeatureStoreError(f"{self.path / self.shards[s]['file']}: shared prefix rows fail their "
                                        "checksum (corrupt shard); re-run generate_features to regenerate it")
            self._prefix[s] = prefix
        return self._prefix[s]

    def read(self, key: str) -> StoredSample:
        if key not in self.index:
            raise FeatureStoreError(
                f"sample {key} is not in the feature store {self.path}; the store was generated from other data "
                f"(regenerate it with the current data config)")
        s, j = self.index[key]
        row = self._tables[s][j].tolist()
        c = {name: row[i] for name, i in _COL.items()}
        h = self._handle(s)
        n = c["n_tokens"]
        ids = h.get_slice("input_ids")[c["token_start"]:c["token_start"] + n]
        rows = h.get_slice("hidden")[c["hidden_start"]:c["hidden_start"] + c["n_hidden"]]
        visual = h.get_slice("visual")[c["visual_start"]:c["visual_start"] + c["n_visual"]]
        if self.verify != "none" and sample_crc(rows, visual, ids) != c["crc32"]:
            raise FeatureStoreError(
                f"{self.path / self.shards[s]['file']}: sample {key} fails its checksum (corrupt shard); re-run "
                f"generate_features with features.path={self.path} to regenerate the shard")
        bits = h.get_slice("loss_mask_bits")[c["mask_start"]:c["mask_start"] + math.ceil(n / 8)]
        mask = torch.from_numpy(np.unpackbits(bits.numpy())[:n].astype(np.int64))
        pos = None
        if c["pos_start"] >= 0:
            pos = h.get_slice("position_ids")[:, c["pos_start"]:c["pos_start"] + n].to(torch.int64)
        top = None
        if "top" in h.keys():
            P = c["prefix_len"]
            top = torch.cat([self._prefix_top(s, h)[:P],
                             h.get_slice("top")[c["hidden_start"]:c["hidden_start"] + c["n_hidden"]]]).to(torch.int64)
        return StoredSample(key, ids.to(torch.int64), mask, self._prefix_rows(s, h)[:c["prefix_len"]], rows,
                            visual, pos, c["rope_delta"], top)

    def _prefix_top(self, s: int, h) -> torch.Tensor:
        key = ("top", s)
        if key not in self._prefix:
            self._prefix[key] = h.get_tensor("prefix_top")
        return self._prefix[key]
