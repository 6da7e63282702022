"""Conversations -> tokenised ``datasets.Dataset`` with loss masks, cached on disk.

The first launch streams the data files' records into an Arrow file on disk (no process
holds them all: :func:`_read_to_disk`), checks every image cheaply, once per file and
process (its header gives the size, its last bytes say whether the file was cut short:
:func:`image_size`), counts each image's visual tokens from that size by the target
family's rule (``Target.image_token_counts``: no pixels are computed here; collate does
that) and tokenises in parallel (``datasets.Dataset.map`` with ``num_proc``, each process
mapping its share of the records from disk, a batch of conversations per tokenizer call:
``Target.encode_many``) into Arrow files under ``data.cache_dir``, one folder per split
(``split-<key>``) with a ``manifest.json`` written last.

Every later launch finds that folder from the data files' content (their sha1, read once
per launch in large blocks: ``benchmarks/data/README.md`` measures it), the target's
identity (name, tokenizer, chat template, image processor) and this code's
``CACHE_VERSION``: a file edited in place is tokenised again even when its size and mtime
were restored, and a touched but unchanged file keeps its cache. The rows are
memory-mapped, not loaded. Images are checked against a listing of their folders (one
``listdir`` per folder, not one ``stat`` per image): an image deleted after caching is a
skipped sample, and one restored after being reported missing is tokenised again. A cache
written by another version of this code or for another target is never used: the launch
says so and tokenises anew.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from msd_train.data.formats import BadSample, BadSampleError, read_conversations
from msd_train.errors import ConfigError
from msd_train.paths import user_path
from msd_train.targets.identity import tokenizer_identity
from msd_train.targets.protocol import TargetProtocol

log = logging.getLogger(__name__)

# 3: visual counts from image headers, memory-mapped split folders with a manifest
CACHE_VERSION = 3
MANIFEST = "manifest.json"


@dataclass
class Split:
    """A tokenised split plus what was skipped on the way."""

    dataset: object  # datasets.Dataset with id, input_ids, loss_mask, images, n_visual, source
    skipped: list[BadSample] = field(default_factory=list)
    #: the cache folder whose usable rows ``dataset`` holds, all of them: ``token_counts`` keeps
    #: its counts there (None: no cache, or rows left out since it was written)
    counts_home: Path | None = None

    def token_counts(self, vocab_size: int):
        """(V,) int64 tensor: how often each target id is an assistant (loss) token over
        ``dataset``. Counted once per cache folder and kept there (``token_counts-V.npy``,
        atomically), so a launch after the first reads no ids for them; a read-only cache, or
        none, counts at each call."""
        import numpy as np
        import torch

        from msd_train.draft.vocabulary import token_counts

        path = None if self.counts_home is None else self.counts_home / f"token_counts-{vocab_size}.npy"
        if path is not None:
            try:
                counts = np.load(path, allow_pickle=False)
                if counts.shape == (vocab_size,) and counts.dtype == np.int64:
                    return torch.from_numpy(counts)
            except (OSError, ValueError):
                pass
        counts = token_counts([self.dataset], vocab_size)
        if path is not None:
            tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}.npy")
            try:
                np.save(tmp, counts.numpy())
                tmp.replace(path)
            except OSError as e:
                log.info("the token counts of %s are not kept (%s): counted again at the next launch", self.counts_home, e)
                tmp.unlink(missing_ok=True)
        return counts

    def __len__(self) -> int:
        return len(self.dataset)


def load_images(paths: list[str]):
    """RGB images; a missing file raises FileNotFoundError naming it (the trainer turns an
    image deleted during a run into a message: relaunching skips that sample), one that does
    not decode :class:`DamagedImage` naming it."""
    from PIL import Image

    images = []
    for p in paths:
        try:
            with Image.open(p) as im:
                images.append(im.convert("RGB"))
        except FileNotFoundError:
            raise
        except Exception as e:  # PIL raises several types for broken files (OSError: image file is truncated)
            err = DamagedImage(f"{p}: {type(e).__name__}: {e}")
            err.filename, err.why = str(p), f"{type(e).__name__}: {e}"
            raise err from None
    return images


#: images found unusable while a run read them (``cache_dir/unusable_images.jsonl``)
UNUSABLE = "unusable_images.jsonl"


class UnusableImage(ValueError):
    """A sample's image that cannot be trained on as the cache holds it: it does not decode
    (its header passed the check when the data was tokenised, its pixels do not), or it
    changed since (another number of visual tokens). ``record``: what
    :func:`record_unusable` keeps so that the next launch leaves the sample out."""

    def __init__(self, message: str, record: dict | None = None):
        super().__init__(message)
        self.record = record or {}

    @classmethod
    def of(cls, row: dict, images: list[str], why: str) -> UnusableImage:
        stats = []
        for image in images:
            try:
                st = os.stat(image)
                stats.append((st.st_size, st.st_mtime_ns))
            except OSError:
                stats.append((None, None))
        record = {"images": [{"image": p, "size": a, "mtime_ns": b} for p, (a, b) in zip(images, stats)],
                  "n_visual": row.get("n_visual"), "source": row.get("source"), "id": row.get("id"), "reason": why}
        name = f"image {images[0]}" if len(images) == 1 else f"one of the images {', '.join(images)}"
        return cls(f"{row.get('source')}, sample {row.get('id')}: {name} {why}; replace it with a whole copy of "
                   f"the original, or remove the sample", record)


def record_unusable(cache_dir, record: dict) -> Path | None:
    """Keep ``record`` (an :class:`UnusableImage`'s) in ``cache_dir``, where every later
    :func:`build_split` of that cache leaves its sample out (``data.on_bad_sample=skip``) or
    refuses it (``error``) while the image is as it was then; None when there is no cache to
    keep it in."""
    if not cache_dir or not record.get("images"):
        return None
    path = Path(user_path(cache_dir)) / UNUSABLE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            for im in record["images"]:
                f.write(json.dumps({**{k: v for k, v in record.items() if k != "images"}, **im}) + "\n")
    except OSError as e:
        log.warning("%s cannot be written (%s): the sample is not left out at the next launch", path, e)
        return None
    return path


def _unusable_images(cache_dir) -> dict[str, dict]:
    """The records of :func:`record_unusable` whose image is still as it was when recorded."""
    out = {}
    try:
        lines = (Path(user_path(cache_dir)) / UNUSABLE).read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            rec = json.loads(line)
            st = os.stat(rec["image"])
        except (ValueError, KeyError, TypeError, OSError):
            continue
        if (st.st_size, st.st_mtime_ns) == (rec.get("size"), rec.get("mtime_ns")):
            out[rec["image"]] = rec
    return out


#: digests this process computed, by (algorithm, path, device, inode, size, mtime, ctime): a launch
#: reads each data file once, though the cache, the resume check and the run's record all ask
_DIGESTS: dict[tuple, str] = {}


def file_digest(path: str | Path, algorithm: str = "sha1") -> str:
    """Hex digest of a file's content, read in 4 MiB chunks (data files and shards can be
    GBs); computed once per process for a file as it is (a file changed since, even with its
    size and mtime restored, has another ctime and is read again)."""
    path = user_path(path)
    st = os.stat(path)
    key = (algorithm, os.path.abspath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _DIGESTS:
        h = hashlib.new(algorithm)
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


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


class DamagedImage(ValueError):
    """An image file that cannot be used as it is (cut short, not an image)."""


# The last bytes a complete file of each format holds (searched for in its tail: some
# writers pad after them).
_END_MARKERS = {"JPEG": b"\xff\xd9", "MPO": b"\xff\xd9", "PNG": b"IEND", "GIF": b"\x3b"}


def image_size(path: str) -> tuple[int, int]:
    """(width, height) of an image read from its header, and a cheap check that the file is
    whole: a JPEG's end-of-image marker, a PNG's IEND chunk, a GIF's trailer in its last
    bytes (a download cut short lacks them); other formats are decoded. Raises
    FileNotFoundError for a missing file and :class:`DamagedImage` for a damaged one."""
    from PIL import Image, UnidentifiedImageError

    try:
        with open(path, "rb") as f:
            try:
                im = Image.open(f)
            except UnidentifiedImageError as e:
                raise DamagedImage(f"UnidentifiedImageError: {e}") from None
            size, fmt = im.size, im.format
            marker = _END_MARKERS.get(fmt)
            if marker is None:
                try:
                    im.load()
                except Exception as e:  # PIL raises several types for broken files
                    raise DamagedImage(f"{type(e).__name__}: {e}") from None
                return size
            end = f.seek(0, os.SEEK_END)
            f.seek(max(end - 1024, 0))
            tail = f.read()
    except IsADirectoryError:
        raise DamagedImage("a folder, not an image file") from None
    if fmt == "PNG" and end < size[0] * size[1] // (8 * 1032):
        # deflate packs at most 1032 bytes into one: a PNG of w x h pixels (one bit each at
        # the least) cannot be smaller than this, whatever its header says
        raise DamagedImage(f"the file holds {end} bytes, too few for the {size[0]}x{size[1]} pixels its header "
                           "claims")
    if marker not in tail.rstrip(b"\x00\r\n ") [-max(len(marker) + 16, 64):]:
        raise DamagedImage(f"the file is cut short: no {fmt} end marker in its last bytes")
    return size


@functools.lru_cache(maxsize=1 << 16)
def _image_size_of(path: str, size: int, mtime_ns: int) -> tuple[int, int]:
    """:func:`image_size` of a file as it is at this size and mtime: an image that many
    conversations share is read once per tokenising process."""
    return image_size(path)


def _checked_image_size(path: str) -> tuple[int, int]:
    st = os.stat(path)  # FileNotFoundError for a missing file
    return _image_size_of(path, st.st_size, st.st_mtime_ns)


def _encode_rows(batch: dict[str, list], target: TargetProtocol, max_length: int, image_root_hint: str) -> dict[str, list]:
    """Tokenise a batch of conversations (one tokenizer call for all), or say in ``bad`` why
    one cannot be used (``missing``: an image file is not there, which a later launch checks
    again)."""
    n = len(batch["messages"])
    out = {"input_ids": [[] for _ in range(n)], "loss_mask": [[] for _ in range(n)], "n_visual": [0] * n,
           "bad": [""] * n, "fix": [""] * n, "missing": [False] * n}
    todo, conversations = [], []
    for i, (messages, paths) in enumerate(zip(batch["messages"], batch["images"])):
        sizes = []
        for p in paths:
            try:
                sizes.append(_checked_image_size(p))
            except FileNotFoundError:
                why = _image_not_found(p, image_root_hint)
                out["bad"][i], out["fix"][i], out["missing"][i] = why["bad"], why["fix"], True
                break
            except Exception as e:  # DamagedImage, or an OSError reading it
                out["bad"][i] = f"image cannot be decoded ({Path(p).name}: {e})"
                out["fix"][i] = f"re-download or remove the image {p}"
                break
        else:
            todo.append(i)
            conversations.append((messages, target.image_token_counts(sizes) if sizes else []))
    image_token_id = target.image_token_id
    for i, (ids, mask) in zip(todo, target.encode_many(conversations)):
        ids, mask, refused = truncate(ids, mask, image_token_id, max_length)
        if refused:
            out["bad"][i], out["fix"][i] = refused
            continue
        out["input_ids"][i], out["loss_mask"][i], out["n_visual"][i] = ids, mask, ids.count(image_token_id)
    return out


def truncate(ids, mask, image_token_id: int, max_length: int):
    """``data.max_length``'s rule: (ids, loss mask, refusal), the sample cut to ``max_length``
    tokens, or ``refusal`` = (reason, fix) when it cannot be used. The one rule the training
    data and ``check_data.py`` share; ``ids`` and ``mask`` are lists or 1-D tensors (what is
    returned is of the same kind)."""
    if len(ids) > max_length:
        # Truncation may only cut text: a partial image block would leave the target's
        # forward with fewer placeholders than visual embeddings.
        if image_token_id in ids[max_length:]:
            return ids, mask, (f"an image block ends after max_length={max_length} (length {len(ids)})",
                               "raise data.max_length or shorten the conversation before the image")
        ids, mask = ids[:max_length], mask[:max_length]
    if not (bool(mask.any()) if hasattr(mask, "any") else any(mask)):
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


@functools.lru_cache(maxsize=1)
def _code_digest() -> str:
    """A digest of the code that turns a conversation into a row (readers, tokenisation,
    chat templates, the target adapters): a cache written by other code is not used."""
    h = hashlib.sha1()
    for folder in (Path(__file__).parent, Path(__file__).parent.parent / "targets"):
        for f in sorted(folder.glob("*.py")):
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:16]


def _digest(obj) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _file_stamp(path: str) -> dict:
    """A data file as a cache records it: path, size, mtime and the sha1 of its content."""
    st = os.stat(user_path(path))
    return {"path": str(user_path(path)), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "sha1": file_digest(path)}


class _SplitCache:
    """The split folders of ``cache_dir``: ``split-<content key>/`` (Arrow files and
    ``manifest.json``, which records each data file's path, size, mtime and sha1). The key
    is a digest of the target's identity and of the data files' content: a file edited in
    place, even with its size and mtime restored (``cp -p``, ``rsync -t``, ``tar``), gets
    another folder; one merely touched or copied keeps its cache."""

    def __init__(self, cache_dir: str, sources: list[dict], identity: dict):
        self.dir = Path(cache_dir)
        self.sources, self.identity = sources, identity
        for s in sources:
            if not user_path(s["path"]).exists():
                raise FileNotFoundError(f"{user_path(s['path'])}: data file not found; check data.*.path")
        self.stamps = [_file_stamp(s["path"]) for s in sources]

    def _entry(self, key: str) -> Path:
        return self.dir / f"split-{key}"

    def find(self) -> tuple[Path | None, str]:
        """(the folder of a finished cache for these files' content and this target, or None; its key)."""
        key = _digest({"identity": self.identity, "digests": [f["sha1"] for f in self.stamps]})
        if self._usable(self._entry(key)):
            return self._entry(key), key
        self._explain_rebuild()
        return None, key

    def _usable(self, entry: Path) -> bool:
        try:
            manifest = json.loads((entry / MANIFEST).read_text())
        except (OSError, ValueError):
            return False
        if manifest.get("identity") != self.identity:
            log.warning("%s does not belong to this launch (another code version or target): not used", entry)
            return False
        return all((entry / f).is_file() for f in manifest["arrow"])

    def _explain_rebuild(self) -> None:
        """One log line saying why an earlier cache of these files is not used (the one
        written for this target and code when there is one)."""
        paths = [s["path"] for s in self.stamps]
        candidates = []
        for manifest_path in sorted(self.dir.glob(f"split-*/{MANIFEST}")):
            try:
                old = json.loads(manifest_path.read_text())
            except (OSError, ValueError):
                continue
            if [f["path"] for f in old.get("files", [])] == paths:
                candidates.append((old.get("identity") != self.identity, manifest_path.parent, old.get("identity") or {}))
        if not candidates:
            return
        _, entry, ident = min(candidates)
        now, data_keys = self.identity, ("max_length", "limit", "sources")
        if ident.get("version") != now["version"] or ident.get("code") != now["code"]:
            why = (f"written by another version of this code (cache version {ident.get('version')}, "
                   f"now {now['version']}; code {ident.get('code')}, now {now['code']})")
        elif any(ident.get(k) != now[k] for k in now if k not in data_keys):
            why = f"written for another target or tokenizer ({ident.get('target')}, now {now['target']})"
        elif any(ident.get(k) != now[k] for k in data_keys):
            why = "written with other data settings (max_length, max_train/max_heldout, format or image_root)"
        else:
            why = "the data files changed since"
        log.warning("the tokenised cache %s is not reused: %s; tokenising again", entry, why)

    def commit(self, built: Path, key: str) -> Path:
        """Move a finished build into place (a rank that lost a race keeps the winner's)."""
        entry = self._entry(key)
        if (entry / MANIFEST).is_file() and self._usable(entry):
            shutil.rmtree(built, ignore_errors=True)  # another process finished the same first
        else:
            shutil.rmtree(entry, ignore_errors=True)  # an unfinished or unusable folder of the same key
            try:
                built.replace(entry)
            except OSError:  # another process moved its build in meanwhile
                shutil.rmtree(built, ignore_errors=True)
        return entry


def _row_features():
    import datasets

    return datasets.Features({
        "id": datasets.Value("string"), "images": datasets.Sequence(datasets.Value("string")),
        "source": datasets.Value("string"), "index": datasets.Value("int64"),
        "input_ids": datasets.Sequence(datasets.Value("int32")), "loss_mask": datasets.Sequence(datasets.Value("int8")),
        "n_visual": datasets.Value("int32"), "bad": datasets.Value("string"), "fix": datasets.Value("string"),
        "missing": datasets.Value("bool")})


def _record_features():
    import datasets

    return datasets.Features({
        "id": datasets.Value("string"),
        "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
        "images": datasets.Sequence(datasets.Value("string")), "source": datasets.Value("string"),
        "index": datasets.Value("int64")})


#: conversations tokenised per tokenizer call (and written per Arrow batch)
BATCH = 256


def _tokenise(rows, target: TargetProtocol, max_length: int, num_proc: int, out: Path, name: str, hint: str):
    """Tokenise ``rows`` (a memory-mapped ``datasets.Dataset``) into Arrow files under ``out``
    (``num_proc`` processes, each mapping its share of the rows from disk)."""
    return rows.map(
        _encode_rows, batched=True, batch_size=BATCH,
        fn_kwargs={"target": target.tokenizing_view(), "max_length": max_length, "image_root_hint": hint},
        remove_columns=["messages"], features=_row_features(),
        num_proc=num_proc if num_proc > 1 and len(rows) > 1 else None,
        cache_file_name=str(out / f"{name}.arrow"), new_fingerprint=f"{name}-{os.getpid()}", desc="tokenising",
    )


def _read_to_disk(sources: list[dict], on_bad_sample: str, path: Path):
    """Stream every source's conversations into the Arrow file ``path``, a batch at a time
    (no list of all records is held): (the rows memory-mapped, or None when there are none;
    the skipped samples as (usable rows before each, BadSample); the images' folders)."""
    import datasets
    from datasets.arrow_writer import ArrowWriter

    skipped, image_dirs, n = [], set(), 0
    batch: list[dict] = []
    with ArrowWriter(features=_record_features(), path=str(path)) as writer:
        for src in sources:
            for rec in read_conversations(src["path"], src.get("format", "auto"), src.get("image_root")):
                if isinstance(rec, BadSample):
                    if on_bad_sample == "error":
                        raise BadSampleError(rec)
                    skipped.append((n, rec))
                    continue
                batch.append(rec)
                n += 1
                image_dirs.update(os.path.dirname(p) for p in rec["images"])
                if len(batch) == BATCH:
                    writer.write_batch({k: [r[k] for r in batch] for k in batch[0]})
                    batch = []
        if batch:
            writer.write_batch({k: [r[k] for r in batch] for k in batch[0]})
        writer.finalize()
    return (datasets.Dataset.from_file(str(path)) if n else None), skipped, image_dirs


def _build(sources: list[dict], target: TargetProtocol, max_length: int, on_bad_sample: str, num_proc: int, limit: int | None,
           identity: dict, out: Path) -> None:
    """Read, tokenise and write one split into the folder ``out`` (its manifest last)."""
    import datasets

    rows, skipped, image_dirs = _read_to_disk(sources, on_bad_sample, out / "records.arrow")
    hint = ",".join(str(s.get("image_root")) for s in sources)
    n = 0 if rows is None else len(rows)
    parts, start, wanted = [], 0, limit if limit else n
    # ``limit``: the first ``limit`` usable conversations; tokenise just enough of the file.
    while start < n and wanted > 0:
        chunk = rows.select(range(start, min(start + wanted, n))) if limit else rows
        ds = _tokenise(chunk, target, max_length, num_proc, out, f"part{len(parts)}", hint)
        parts.append(ds)
        start += len(chunk)
        if on_bad_sample == "error" or not limit:
            break
        wanted -= sum(1 for b in ds.data.column("bad").to_pylist() if not b)
    del rows
    (out / "records.arrow").unlink()  # the tokenised rows are their own files
    ds = datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0] if parts else None
    arrow = [] if ds is None else [Path(f["filename"]).name for f in ds.cache_files]
    # a conversation that cannot be tokenised raises before anything is written to the cache
    if ds is not None and on_bad_sample == "error":
        _select_usable(ds, "error")
    manifest = {"identity": identity, "files": [_file_stamp(s["path"]) for s in sources], "arrow": arrow,
                "skipped": [b.to_dict() for pos, b in skipped if pos < start or not limit], "image_dirs": sorted(image_dirs),
                "rows": 0 if ds is None else len(ds)}
    (out / MANIFEST).write_text(json.dumps(manifest))


def _select_usable(ds, on_bad_sample: str, image_dirs: list[str] | None = None, hint: str = "",
                   unusable: dict[str, dict] | None = None):
    """(the rows that can be trained on, the BadSamples of the others, how many of those were
    usable when tokenised); with ``image_dirs``, a row whose image is no longer listed in its
    folder is one of the others; with ``unusable`` (:func:`_unusable_images`), one whose image
    a run found unusable, as the row holds it (its visual-token count then), is one too."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    table = ds.data.table if hasattr(ds.data, "table") else ds.data
    bad = np.asarray(pc.not_equal(table.column("bad"), "").to_numpy(zero_copy_only=False))
    gone = np.zeros(len(ds), dtype=bool)
    if image_dirs:
        listed = []
        for d in image_dirs:
            try:
                listed += [os.path.join(d, n) for n in os.listdir(d)]
            except OSError:
                pass
        images = table.column("images").combine_chunks()
        if len(pc.list_flatten(images)):
            present = pc.is_in(pc.list_flatten(images), value_set=pa.array(listed, pa.string())).to_numpy(
                zero_copy_only=False)
            parents = pc.list_parent_indices(images).to_numpy()
            gone[np.unique(parents[~present])] = True
    found = {}  # row -> why a run found its image unusable
    if unusable:
        images = table.column("images").combine_chunks()
        if len(pc.list_flatten(images)):
            hit = pc.is_in(pc.list_flatten(images), value_set=pa.array(list(unusable), pa.string())).to_numpy(
                zero_copy_only=False)
            for i in np.unique(pc.list_parent_indices(images).to_numpy()[hit]):
                r = ds[int(i)]
                for p in r["images"]:
                    rec = unusable.get(p)
                    if rec is not None and rec.get("n_visual") in (None, r["n_visual"]):
                        found[int(i)] = {"bad": f"image {p} {rec.get('reason')} (found in training)",
                                         "fix": "replace the image with a whole copy of the original, or remove the "
                                                "sample"}
                        gone[i] = True
    out = []
    for i in np.flatnonzero(bad | gone):
        r = ds[int(i)]
        if int(i) in found and not r["bad"]:
            r = {**r, **found[int(i)]}
        elif gone[i] and not r["bad"]:
            missing = next(p for p in r["images"] if not os.path.exists(p))
            why = _image_not_found(missing, hint)
            r = {**r, **why}
        b = BadSample(r["source"], r["index"], r["id"], r["bad"], r["fix"])
        if on_bad_sample == "error":
            raise BadSampleError(b)
        out.append(b)
    keep = np.flatnonzero(~(bad | gone))
    return (ds if len(keep) == len(ds) else ds.select(keep)), out, int((gone & ~bad).sum())


def _restored(ds) -> bool:
    """Whether an image reported missing when the cache was written is there now."""
    import pyarrow.compute as pc

    table = ds.data.table if hasattr(ds.data, "table") else ds.data
    idx = pc.indices_nonzero(table.column("missing")).to_numpy()
    return any(os.path.exists(p) for i in idx[:10000] for p in ds[int(i)]["images"])


@contextlib.contextmanager
def _writable_cache(cache_dir):
    """Writing the tokenised cache: a folder this launch may not write is one message naming
    ``data.cache_dir`` and the fix (a finished cache there is read without writing)."""
    try:
        yield
    except OSError as e:
        if cache_dir is None or e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        raise ConfigError(
            f"data.cache_dir={cache_dir}: cannot write the tokenised cache there ({e.filename or cache_dir}: "
            f"{e.strerror}); a launch writes it there the first time it reads these data files with this target "
            f"and settings. Give a folder you can write, data.cache_dir=DIR (a node-local disk is fine)") from None


def build_split(
    sources: list[dict],
    target: TargetProtocol,
    max_length: int,
    on_bad_sample: str = "skip",
    cache_dir: str | None = None,
    num_proc: int = 1,
    limit: int | None = None,
) -> Split:
    """Read, validate and tokenise every source of one split, or map the cache of an
    earlier launch (module docstring).

    ``sources`` are config entries ``{path, format, image_root}``. With
    ``on_bad_sample=error`` the first bad sample raises :class:`BadSampleError`;
    with ``skip`` it is counted and returned in ``Split.skipped``.
    """
    import datasets

    if on_bad_sample not in ("skip", "error"):
        raise ValueError(f"data.on_bad_sample={on_bad_sample}: use skip or error")
    if not sources:
        return Split(datasets.Dataset.from_dict({}), [])
    identity = {"version": CACHE_VERSION, "code": _code_digest(), **tokenizer_identity(target),
                "max_length": max_length, "limit": limit, "sources": [[str(user_path(s["path"])), s.get("format", "auto"), str(s.get("image_root"))]
                            for s in sources]}
    identity = json.loads(json.dumps(identity))  # as a manifest holds it
    hint = ",".join(str(s.get("image_root")) for s in sources)
    if cache_dir:
        cache = _SplitCache(cache_dir, sources, identity)
        with _writable_cache(cache_dir):
            cache.dir.mkdir(parents=True, exist_ok=True)
        entry, key = cache.find()
    else:
        cache, entry, key = None, None, ""
    for attempt in range(3):
        if entry is None:
            parent = cache.dir if cache else Path(tempfile.gettempdir())
            with _writable_cache(cache_dir if cache else None):
                built = Path(tempfile.mkdtemp(prefix=".building-", dir=parent))
                try:
                    _build(sources, target, max_length, on_bad_sample, num_proc, limit, identity, built)
                except BaseException:
                    shutil.rmtree(built, ignore_errors=True)
                    raise
                entry = cache.commit(built, key) if cache else built
        manifest = json.loads((entry / MANIFEST).read_text())
        if not manifest["arrow"]:
            ds = datasets.Dataset.from_dict({})
            break
        try:
            ds = datasets.concatenate_datasets([datasets.Dataset.from_file(str(entry / f)) for f in manifest["arrow"]])
        except Exception as e:  # pyarrow's ArrowInvalid, an OSError: a file cut short or overwritten
            if cache is None or attempt == 2:
                raise
            log.warning("the tokenised cache %s is damaged (%s: %s): tokenising again", entry, type(e).__name__,
                        str(e).splitlines()[0][:200] if str(e) else "")
            shutil.rmtree(entry, ignore_errors=True)
            if entry.exists():  # a cache this launch cannot write: built beside it, under another name
                key = f"{key}-{os.getpid()}"
            entry = None
            continue
        if cache is None:
            shutil.rmtree(entry, ignore_errors=True)  # the rows stay mapped; nothing is left behind
        if attempt < 2 and cache is not None and _restored(ds):
            log.info("an image reported missing when %s was written is back: tokenising again", entry)
            shutil.rmtree(entry, ignore_errors=True)
            entry = None
            continue
        break
    skipped = []
    for b in manifest["skipped"]:
        b = BadSample(**b)
        if on_bad_sample == "error":
            raise BadSampleError(b)
        skipped.append(b)
    if len(ds) == 0:
        return Split(datasets.Dataset.from_dict({}), skipped)
    ds, bad, gone = _select_usable(ds, on_bad_sample, manifest["image_dirs"] if cache else None, hint,
                                   _unusable_images(cache_dir) if cache else None)
    ds = ds.remove_columns(["bad", "fix", "missing"])
    # the kept counts are of every usable row; a row left out since (its image is gone) is not in them
    return Split(ds, skipped + bad, entry if cache is not None and not gone else None)


def write_skipped(path: str | Path, skipped: list[BadSample]) -> None:
    """List skipped samples, one JSON object a line, for the user to inspect or fix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for b in skipped:
            f.write(json.dumps(b.to_dict()) + "\n")
