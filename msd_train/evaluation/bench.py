"""Benchmarks: lists of multi-turn prompts, each with its images and a category.

Three sources, one item shape (:class:`BenchItem`):

* ``conversations``: ShareGPT / LLaVA-Instruct files (the bundled tiny held-out sets);
  the user turns are the prompts, the reference answers are ignored, each record's
  ``category`` field is kept (default: ``text`` without images, ``image`` with).
* ``jsonl``: MMSpec-shaped JSONL, one ``{id, image: str | list | null, turns: [str],
  category, topic}`` per line; images go before the first turn unless a turn has
  ``<image>``. ``path`` may be the file or an MMSpec split folder (``mmspec.jsonl`` +
  ``images/``). ``bench=mmspec`` is this reader grouped by ``topic``.
* ``hf``: a Hugging Face dataset (``datasets`` is imported only here, only then).

Image captions (read only by the ensemble variant C) come from a record's ``caption``
field (a string, or a list with one per image) or from a source's ``captions`` file, a
JSON object mapping each image path, as the records write it, to its caption.

Items are grouped in the report by one record field, ``group_by`` (default ``category``;
MMSpec: ``topic``). A benchmark may fix its generation length (``max_new_tokens``, see
:func:`bench_decoding`). Each turn's answer is produced by the decoder being measured and
fed into the next turn, as MMSpec's harness does.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from msd_train.errors import ConfigError
from msd_train.paths import user_path
from msd_train.targets.chat import IMAGE_MARKER, count_image_markers

log = logging.getLogger(__name__)

#: MMSpec's split layout: the records and the folder their `image` names are relative to.
MMSPEC_FILE, MMSPEC_IMAGES = "mmspec.jsonl", "images"


class BenchError(ConfigError):
    """A benchmark file or record that cannot be measured as written; the message names
    the file, the record and the fix (eval.py prints it as one paragraph, exit 1)."""


@dataclass
class BenchItem:
    id: str
    category: str
    turns: list[str]  # user turns; "<image>" marks where each image goes
    images: list = field(default_factory=list)  # paths or PIL images, one per marker, in order
    source: str = ""
    captions: list[str] = field(default_factory=list)  # one per image when supplied, else empty

    def check_image_files(self) -> None:
        """Raise FileNotFoundError naming the sample and the fix when an image path has no file."""
        from msd_train.data.dataset import stat_images

        _, missing = stat_images(self.images)
        if missing is not None:
            raise FileNotFoundError(f"{self.source}, sample {self.id}: image {missing} not found; set "
                                    "bench.image_root to the folder the image paths are relative to")

    def load_images(self) -> list:
        from PIL import Image

        self.check_image_files()
        return [(Image.open(img) if isinstance(img, (str, Path)) else img).convert("RGB") for img in self.images]


def _with_markers(turns: list[str], n_images: int) -> list[str]:
    """Put one marker per image before the first turn unless the turns carry markers."""
    have = count_image_markers(turns)
    if have == n_images:
        return turns
    if have == 0 and turns:
        return [(IMAGE_MARKER + "\n") * n_images + turns[0]] + turns[1:]
    raise BenchError(f"{have} {IMAGE_MARKER} markers in the turns but {n_images} images")


def _captions(record, n_images: int, captions: dict | None) -> list[str]:
    """A record's captions, one per image: its own ``caption`` field, else the source's
    ``captions`` map keyed by the record's image paths; [] when any is missing."""
    if not isinstance(record, dict) or n_images == 0:
        return []
    own = record.get("caption", record.get("captions"))
    if own is None and captions:
        paths = record.get("image") or record.get("images") or []
        paths = [paths] if isinstance(paths, str) else list(paths)
        own = [captions.get(str(p)) for p in paths]
    own = [own] if isinstance(own, str) else list(own or [])
    return own if len(own) == n_images and all(isinstance(c, str) and c for c in own) else []


def _read_captions(path: str | None) -> dict | None:
    if not path:
        return None
    try:
        out = json.loads(user_path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"bench captions file {path} not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BenchError(f"bench captions file {path}: not valid JSON ({e}); fix it, or drop the source's "
                         "captions setting") from None
    if not isinstance(out, dict):
        raise BenchError(f"bench captions file {path}: expected a JSON object {{image path: caption}}")
    return out


def load_conversations(path: str, image_root: str | None = None, fmt: str = "auto",
                       captions: str | None = None, group_by: str = "category") -> list[BenchItem]:
    """ShareGPT / LLaVA-Instruct / messages files through the training data readers; a
    conversation that breaks mid-way keeps its turns before the break (with a warning)."""
    from msd_train.data.formats import BadSample, read_conversations, read_records

    raw = dict(read_records(user_path(path), strict=True))  # by the index read_conversations gives
    if not raw:
        raise BenchError(f"{path}: no records (an empty file); give the benchmark's conversations, or remove "
                         "this source from the bench's sources")
    caption_map = _read_captions(captions)
    items = []
    for conv in read_conversations(path, fmt, image_root):
        if isinstance(conv, BadSample) and conv.action == "truncated":
            log.warning("%s", conv.message())
            continue
        if isinstance(conv, BadSample):
            raise BenchError(conv.message() + "; a benchmark measures every record it lists")
        turns = [m["content"] for m in conv["messages"] if m["role"] == "user"]
        record = raw.get(conv["index"], {})
        category = record.get(group_by) if isinstance(record, dict) else None
        category = category or ("image" if conv["images"] else "text")
        items.append(BenchItem(conv["id"], str(category), turns, list(conv["images"]), str(path),
                               _captions(record, len(conv["images"]), caption_map)))
    return items


def load_jsonl(path: str, image_root: str | None = None, group_by: str = "category") -> list[BenchItem]:
    """MMSpec-shaped JSONL: ``{id, image, turns, category, topic}`` per line, grouped by
    the field ``group_by``. ``path``: the file, or an MMSpec split folder (``mmspec.jsonl``
    and ``images/``). ``image_root`` (default: that ``images/``, else the file's folder)
    is what relative image paths are relative to."""
    path = user_path(path)
    if path.is_dir():
        if not (path / MMSPEC_FILE).is_file():
            raise FileNotFoundError(f"bench.path={path}: a folder without {MMSPEC_FILE}; pass the .jsonl file, or "
                                    f"an MMSpec split folder ({MMSPEC_FILE} + {MMSPEC_IMAGES}/)")
        default_root, path = path / MMSPEC_IMAGES, path / MMSPEC_FILE
    elif path.is_file():
        default_root = path.parent
    else:
        raise FileNotFoundError(f"bench.path={path}: no such file or folder")
    from msd_train.data.formats import read_records

    root = user_path(image_root) if image_root else default_root
    items = []
    for i, (_, rec) in enumerate(read_records(path, strict=True)):
        if not isinstance(rec, dict):
            raise BenchError(f"{path}, record {i + 1}: not a JSON object ({type(rec).__name__}); write one "
                             "{id, image, turns, ...} object per line")
        sid = str(rec.get("id", f"{path.stem}-{i}"))
        turns = rec.get("turns")
        if isinstance(turns, str):
            turns = [turns]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise BenchError(f"{path}, record {i + 1} (sample {sid}): 'turns' is {turns!r}; give a non-empty list "
                             "of non-empty strings, the user turns in order")
        images = rec.get("image") or rec.get("images") or []
        images = [images] if isinstance(images, str) else images
        if not isinstance(images, list) or not all(isinstance(p, str) for p in images):
            raise BenchError(f"{path}, record {i + 1} (sample {sid}): 'image' is {images!r}; give an image path, "
                             "a list of them, or null")
        images = [str(root / p) for p in images]
        try:
            turns = _with_markers(turns, len(images))
        except BenchError as e:
            raise BenchError(f"{path}, record {i + 1} (sample {sid}): {e}; give one {IMAGE_MARKER} marker per "
                             "image, or none (the images then go before the first turn)") from None
        items.append(BenchItem(sid, str(rec.get(group_by) or "default"), turns, images, str(path),
                               _captions(rec, len(images), None)))
    if not items:
        raise BenchError(f"{path}: no records (an empty file); write one {{id, image, turns, ...}} object per line")
    if items and group_by != "category" and all(it.category == "default" for it in items):
        log.warning("%s: no record has the field %r that bench.group_by names; every item is in one group",
                    path, group_by)
    return items


def load_hf(dataset: str, split: str = "test", subset: str | None = None, revision: str | None = None,
            id_field: str | None = "id", image_field: str | None = "image", turns_field: str = "question",
            category_field: str | None = None, category: str | None = None, caption_field: str | None = None,
            max_samples: int | None = None) -> list[BenchItem]:
    """A Hub dataset: ``turns_field`` holds one question (str) or several turns (list)."""
    try:
        import datasets
    except ImportError:
        raise ImportError("bench=hf needs the `datasets` package: pip install datasets") from None
    ds = datasets.load_dataset(dataset, subset, split=split, revision=revision)
    if max_samples:
        ds = ds.select(range(min(int(max_samples), len(ds))))
    items = []
    for i, rec in enumerate(ds):
        if turns_field not in rec:
            raise BenchError(f"{dataset} [{split}]: no field {turns_field!r}; fields: {sorted(rec)}; "
                             "set bench.turns_field")
        turns = rec[turns_field]
        turns = [turns] if isinstance(turns, str) else list(turns)
        images = rec.get(image_field) if image_field else None
        images = [] if images is None else images if isinstance(images, list) else [images]
        sid = str(rec.get(id_field, i)) if id_field else str(i)
        cat = str(rec.get(category_field)) if category_field and rec.get(category_field) is not None else None
        caps = _captions({"caption": rec.get(caption_field)}, len(images), None) if caption_field else []
        try:
            turns = _with_markers(turns, len(images))
        except BenchError as e:
            raise BenchError(f"{dataset} [{split}], record {i} (sample {sid}): {e}; set bench.turns_field and "
                             "bench.image_field to the question and image fields") from None
        items.append(BenchItem(sid, cat or category or dataset.split("/")[-1], turns, images, f"{dataset}[{split}]",
                               caps))
    return items


def load_bench(cfg: dict) -> list[BenchItem]:
    """Items of the benchmark a ``conf/bench/*.yaml`` describes (a plain dict)."""
    kind = cfg.get("kind", "conversations")
    if kind == "conversations":
        items = []
        for src in cfg["sources"]:
            items += load_conversations(src["path"], src.get("image_root"), src.get("format", "auto"),
                                        src.get("captions"), grouped_by(cfg))
    elif kind == "jsonl":
        if not cfg.get("path"):
            raise BenchError("bench=jsonl needs bench.path=FILE.jsonl (and bench.image_root=DIR for relative images)")
        items = load_jsonl(cfg["path"], cfg.get("image_root"), grouped_by(cfg))
    elif kind == "hf":
        if not cfg.get("dataset"):
            raise BenchError("bench=hf needs bench.dataset=OWNER/NAME (and bench.split, bench.turns_field, ...)")
        keys = ("split", "subset", "revision", "id_field", "image_field", "turns_field", "category_field", "category",
                "caption_field")
        items = load_hf(cfg["dataset"], max_samples=cfg.get("max_samples"),
                        **{k: cfg[k] for k in keys if cfg.get(k) is not None})
    else:
        raise BenchError(f"bench.kind={kind!r}: choose conversations, jsonl or hf")
    return select(items, cfg.get("max_per_category"), cfg.get("max_samples"), cfg.get("max_turns"))


def grouped_by(cfg: dict) -> str:
    """The record field the report's groups come from."""
    if cfg.get("kind") == "hf":
        return cfg.get("category_field") or "dataset"
    return cfg.get("group_by") or "category"


def generation_length(cfg: dict, default: int) -> int:
    """New tokens a turn on the benchmark ``cfg`` describes: its own ``max_new_tokens``
    when it fixes one (MMSpec's harness generates up to 1024), else ``default``
    (``decoding.max_new_tokens`` of eval.py, ``max_new_tokens`` of scripts/serve_check.py).
    One rule for both, so that their reports on one benchmark measure the same length."""
    n = cfg.get("max_new_tokens")  # checked with the other settings (validate.check_eval)
    if n is None or int(n) == int(default):
        return int(default)
    log.info("bench=%s generates up to %d new tokens a turn (bench.max_new_tokens; the default %d is not used)",
             cfg.get("name", "?"), int(n), int(default))
    return int(n)


def bench_decoding(cfg: dict, config):
    """The decoding settings with what the benchmark fixes: ``max_new_tokens``
    (``generation_length``). A benchmark's own setting wins over
    ``decoding.max_new_tokens``, so that its numbers compare with published ones; change it
    with ``bench.max_new_tokens=N``."""
    n = generation_length(cfg, config.max_new_tokens)
    return config if n == config.max_new_tokens else dataclasses.replace(config, max_new_tokens=n)


def select(items: list[BenchItem], max_per_category: int | None = None, max_samples: int | None = None,
           max_turns: int | None = None) -> list[BenchItem]:
    """The first items of each category (file order), then the first ``max_samples``."""
    if max_per_category:
        seen: dict[str, int] = {}
        kept = []
        for it in items:
            if seen.get(it.category, 0) < int(max_per_category):
                seen[it.category] = seen.get(it.category, 0) + 1
                kept.append(it)
        items = kept
    if max_samples:
        items = items[: int(max_samples)]
    if max_turns:
        out = []
        for it in items:
            turns = it.turns[: int(max_turns)]
            n = count_image_markers(turns)
            out.append(BenchItem(it.id, it.category, turns, it.images[:n], it.source, it.captions[:n]))
        items = out
    return items
