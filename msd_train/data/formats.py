"""Readers for conversation files: ShareGPT, LLaVA-Instruct, and generic ``messages`` JSONL.

Every reader yields the project's one internal shape (see ``msd_train.targets.chat``)::

    {"id": str, "messages": [{"role": "system"|"user"|"assistant", "content": str}],
     "images": [absolute image paths], "source": file, "index": position in file}

or, for a sample that cannot be used, a :class:`BadSample` naming the file, the sample and
the fix. Nothing here raises on one bad sample; the caller decides (``on_bad_sample``).
Files are parsed with the json module rather than ``datasets.load_dataset("json")``
because real dumps mix int and string ids and nested schemas that Arrow refuses to infer.
"""

from __future__ import annotations

import codecs
import json
import os
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from msd_train.errors import ConfigError
from msd_train.paths import user_path
from msd_train.targets.chat import IMAGE_MARKER, count_image_markers

# Roles seen in real ShareGPT / LLaVA dumps, mapped to chat roles.
ROLE_MAP = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "model": "assistant",
    "system": "system",
}


@dataclass
class BadSample:
    """A sample that is not used as written: ``action`` "skipped" (not used at all) or
    "truncated" (its exchanges before the break at ``reason`` are kept: ``kept_exchanges``)."""

    source: str
    index: int
    id: str | None
    reason: str
    fix: str
    action: str = "skipped"
    kept_exchanges: int | None = None

    def message(self) -> str:
        where = f"{self.source}, sample {self.id if self.id is not None else '#' + str(self.index)}"
        if self.action == "truncated":
            n = self.kept_exchanges
            return f"{where}: {self.reason}; kept the {n} exchange{'s' if n != 1 else ''} before it ({self.fix})"
        return f"{where}: {self.reason} ({self.fix})"

    def to_dict(self) -> dict:
        return asdict(self)


class BadSampleError(ValueError):
    """Raised with ``on_bad_sample=error``; the message names file, sample and fix."""

    def __init__(self, bad: BadSample):
        if bad.action == "truncated":
            n = bad.kept_exchanges
            text = (f"{bad.source}, sample {bad.id}: {bad.reason} ({bad.fix}); or set data.on_bad_sample=skip to "
                    f"train on the {n} exchange{'s' if n != 1 else ''} before it")
        else:
            text = bad.message() + "; or set data.on_bad_sample=skip to skip such samples"
        super().__init__(text)
        self.bad = bad


class DataFileError(ConfigError):
    """A data or benchmark file that cannot be read as written; the message names the
    file, the line or record, and the fix (entry points print it as one paragraph)."""


def read_text(path: Path) -> str:
    """The file as UTF-8 text (a byte-order mark is allowed); anything else is an error
    naming the file, the line of the first undecodable byte and the fix."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataFileError(
            f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at line {line}, byte offset {e.start}); "
            f"re-encode the file as UTF-8, e.g. `iconv -f latin1 -t utf-8 {path} > {path.stem}.utf8{path.suffix}` "
            "(use the file's real encoding in place of latin1)"
        ) from None


def read_records(path: Path, strict: bool = False) -> Iterator[tuple[int, object]]:
    """(index, record) pairs of a JSON array file (index: the position in the array) or of
    a JSONL file (index: the 0-based line number; blank lines are skipped), read a chunk at a
    time: memory stays bounded by the largest record, not the file (a 1 GB array is never
    held whole).

    A file that is not UTF-8, or a JSON array that does not parse, is an error naming the
    file, the line and the fix (raised where the reading reaches it: records before it have
    been yielded). A JSONL line that does not parse becomes a :class:`BadSample` (one broken
    line need not spoil a training set; the caller's ``on_bad_sample`` decides) or, with
    ``strict``, an error naming the file and the line (a benchmark measures every item it
    lists or none).
    """
    with open(path, "rb") as f:
        decoder = codecs.getincrementaldecoder("utf-8-sig")()
        head, eof = "", False
        while not head.lstrip() and not eof:
            chunk = f.read(1 << 16)
            eof = not chunk
            try:
                head += decoder.decode(chunk, final=eof)
            except UnicodeDecodeError:
                read_text(path)  # raises the error naming the line and byte offset
                raise
        if head.lstrip().startswith("["):
            yielded = 0
            try:
                for record in _array_items(f, decoder, head, eof):
                    yield yielded, record
                    yielded += 1
                return
            except (_NotStreamable, UnicodeDecodeError):
                pass
            # the array does not parse as it streams: parse it whole for json's own message
            try:
                data = json.loads(read_text(path))
            except json.JSONDecodeError as e:
                raise DataFileError(
                    f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); fix the file there, "
                    "or write it as JSONL, one record per line"
                    + ("" if strict else ", so that one broken record does not spoil the rest")
                ) from None
            yield from list(enumerate(data))[yielded:]
            return
        f.seek(0)
        lineno = 0
        for n, raw in enumerate(f):
            try:
                text = raw.decode("utf-8-sig" if n == 0 else "utf-8")
            except UnicodeDecodeError:
                read_text(path)  # raises the error naming the line and byte offset
                raise
            # the lines str.splitlines sees in the decoded text (it also splits at \r, \x1c..)
            for line in text.splitlines():
                lineno += 1
                if not line.strip():
                    continue
                try:
                    yield lineno - 1, json.loads(line)
                except json.JSONDecodeError as e:
                    if strict:
                        raise DataFileError(f"{path}, line {lineno}: not valid JSON ({e.msg} at column {e.colno}); "
                                            "fix or delete that line") from None
                    yield lineno - 1, BadSample(str(path), lineno - 1, None,
                                                f"line {lineno} is not valid JSON ({e.msg})", "fix or delete that line")


class _NotStreamable(Exception):
    """The array does not parse as it is read; :func:`read_records` parses it whole to name the error."""


_JSON_SPACE = re.compile(r"[ \t\n\r]*")
_CHUNK = 1 << 23  # characters of an array file read at a time


def _array_items(f, decoder, buf: str, eof: bool) -> Iterator[object]:
    """The items of the JSON array whose text starts in ``buf`` and continues in the binary
    file ``f`` (decoded by ``decoder``), one at a time; raises :class:`_NotStreamable` where
    the text is not a valid array."""
    scan = json.JSONDecoder().raw_decode
    pos = 0

    def more() -> None:
        nonlocal buf, pos, eof
        chunk = f.read(_CHUNK)
        eof = not chunk
        buf = buf[pos:] + decoder.decode(chunk, final=eof)
        pos = 0

    def next_char() -> str:
        nonlocal pos
        while True:
            pos = _JSON_SPACE.match(buf, pos).end()
            if pos < len(buf):
                return buf[pos]
            if eof:
                return ""
            more()

    if next_char() != "[":
        raise _NotStreamable
    pos += 1
    if next_char() == "]":
        pos += 1
    else:
        while True:
            next_char()
            while True:
                try:
                    item, end = scan(buf, pos)
                except json.JSONDecodeError:
                    if eof:
                        raise _NotStreamable from None
                    more()  # the item may continue in the next chunk
                    continue
                if end == len(buf) and not eof:
                    more()  # a number or literal may continue in the next chunk
                    continue
                break
            pos = end
            yield item
            c = next_char()
            pos += 1
            if c == "]":
                break
            if c != ",":
                raise _NotStreamable
    if next_char() != "":
        raise _NotStreamable  # text after the array


def detect_format(record: dict) -> str:
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "llava" if "image" in record else "sharegpt"
    raise ValueError("cannot tell the format: expected a 'conversations' or 'messages' field")


def _read_turns(raw_turns, role_key: str, content_key: str) -> tuple[list[dict], tuple[int, str, str] | None]:
    """The messages of a conversation up to its first break, and the break (turn index,
    reason, fix) or None.

    A break is a turn that cannot be used: no role, an unknown role, content that is not
    text, a system message after the first turn, a turn that does not alternate, an empty
    turn. What comes before it is valid. ShareGPT dumps often open with the assistant (a
    greeting) or end on an unanswered question; neither carries a trainable (user,
    assistant) pair, so they are trimmed without counting as a break.
    """
    out: list[dict] = []
    expect, opened = "user", False  # opened: a user or assistant turn was seen
    for j, t in enumerate(raw_turns):
        if not isinstance(t, dict) or role_key not in t:
            return out, (j, f"turn {j} has no '{role_key}'", f"each turn needs '{role_key}' and '{content_key}'")
        role = ROLE_MAP.get(str(t[role_key]).lower())
        if role is None:
            return out, (j, f"turn {j} has unknown role {t[role_key]!r}", f"use one of {sorted(ROLE_MAP)}")
        content = t.get(content_key)
        content = "" if content is None else content
        if not isinstance(content, str):
            return out, (j, f"turn {j} content is not text", "store the turn's text as a string")
        if role == "system":
            if opened:
                return out, (j, f"turn {j}: system message after the first turn", "move it to the start or drop it")
            if content.strip():
                out.append({"role": role, "content": content})
            continue
        opened = True
        if role == "assistant" and expect == "user" and not any(m["role"] == "user" for m in out):
            continue  # a leading greeting
        if role != expect:
            return out, (j, f"turn {j} is from {role} but {expect} was expected (turns must alternate)",
                         "merge or remove the repeated turn")
        if not content.strip():
            return out, (j, f"turn {j} ({role}) is empty", "remove the empty turn and its pair")
        out.append({"role": role, "content": content})
        expect = "assistant" if role == "user" else "user"
    return out, None


def _answered_after(raw_turns, start: int, role_key: str, content_key: str) -> bool:
    """Whether an assistant answer with text is at or after turn ``start``: if not, a
    break there loses nothing that could be trained on (an unanswered last question)."""
    for t in raw_turns[start:]:
        if isinstance(t, dict) and ROLE_MAP.get(str(t.get(role_key, "")).lower()) == "assistant":
            content = t.get(content_key)
            if isinstance(content, str) and content.strip():
                return True
    return False


def read_conversations(path: str | Path, fmt: str = "auto", image_root: str | Path | None = None) -> Iterator[dict | BadSample]:
    """Yield normalised conversations (or BadSample) from one file."""
    path = user_path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: data file not found; check data.*.path")
    src = str(path)
    root = user_path(image_root) if image_root else path.parent
    for index, rec in read_records(path):
        if isinstance(rec, BadSample):
            yield rec
            continue
        if not isinstance(rec, dict):
            yield BadSample(src, index, None, "record is not a JSON object", "each sample must be an object")
            continue
        sid = rec.get("id", rec.get("sample_id"))
        sid = str(sid) if sid is not None else f"{path.stem}-{index}"
        f = fmt if fmt != "auto" else None
        try:
            f = f or detect_format(rec)
        except ValueError as e:
            yield BadSample(src, index, sid, str(e), "use ShareGPT, LLaVA-Instruct or messages JSONL")
            continue
        role_key, content_key, turns_key, images_key = (
            ("role", "content", "messages", "images") if f == "messages" else ("from", "value", "conversations", "image"))
        raw_turns = rec.get(turns_key)
        images = rec.get(images_key) or []
        if isinstance(images, str):
            images = [images]
        if not isinstance(raw_turns, list) or not raw_turns:
            yield BadSample(src, index, sid, "empty or missing conversation", "give it at least one exchange")
            continue
        msgs, broken = _read_turns(raw_turns, role_key, content_key)
        system = [m for m in msgs if m["role"] == "system"]
        body = [m for m in msgs if m["role"] != "system"]
        body = body[: len(body) - len(body) % 2]  # whole (user, assistant) exchanges only
        if not body:
            _, reason, fix = broken or (0, "no user/assistant exchange",
                                        "each conversation needs a user turn followed by an assistant turn")
            yield BadSample(src, index, sid, reason, fix)
            continue
        if broken is not None and not _answered_after(raw_turns, broken[0], role_key, content_key):
            broken = None  # no answer at or after the break: a trimmed tail, nothing lost
        msgs = system + body
        # Markers in the whole conversation decide how images pair with turns; a cut
        # conversation keeps the images whose markers it keeps (markers follow image order).
        n_all = count_image_markers(t[content_key] for t in raw_turns if isinstance(t, dict) and content_key in t)
        n_markers = count_image_markers(msgs)
        if images and n_all == 0 and len(images) == 1:
            # LLaVA entries occasionally lack the marker; LLaVA's own loader prepends it.
            first = next(i for i, m in enumerate(msgs) if m["role"] == "user")
            msgs[first] = {**msgs[first], "content": IMAGE_MARKER + "\n" + msgs[first]["content"]}
            n_all = n_markers = 1
        if n_all != len(images):
            yield BadSample(src, index, sid, f"{n_all} <image> markers but {len(images)} images",
                            "give one <image> marker per image")
            continue
        if broken is not None:
            _, reason, fix = broken
            if n_markers < n_all:
                reason += f" (and {n_all - n_markers} of its {n_all} images with it)"
            yield BadSample(src, index, sid, reason, fix + " to keep the rest", action="truncated",
                            kept_exchanges=len(body) // 2)
        escaped = next((p for p in images[:n_markers] if not _inside(root, p)), None)
        if escaped is not None:
            yield BadSample(src, index, sid, f"image path {escaped!r} is outside image_root={root} (an absolute path "
                            f"elsewhere, or one that climbs out with '..')",
                            "write image paths relative to image_root, inside it, or point image_root at the "
                            "folder that holds them")
            continue
        yield {"id": sid, "messages": msgs, "images": [str(root / p) for p in images[:n_markers]],
               "source": src, "index": index}


def _inside(root: Path, image) -> bool:
    """Whether a data file's image path names a file inside ``root``: a relative path that does
    not climb out of it with ``..``, or an absolute one under ``root`` (judged by their text; a
    symlink the user put inside ``root`` is followed as the user set it up)."""
    if not isinstance(image, str) or not image or "\x00" in image or image.startswith("~"):
        return False
    if os.path.isabs(image):
        base = os.path.normpath(os.path.abspath(root))
        return os.path.commonpath([base, os.path.normpath(image)]) == base
    return not os.path.normpath(image).split(os.sep)[0] == ".."
