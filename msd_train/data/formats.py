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

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from msd_train.targets.chat import IMAGE_MARKER

# Roles seen in real ShareGPT / LLaVA dumps, mapped to chat roles.
ROLE_MAP = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "model": "assistant",
    "system": "system",
}


@dataclass
class BadSample:
    source: str
    index: int
    id: str | None
    reason: str
    fix: str

    def message(self) -> str:
        return f"{self.source}, sample {self.id if self.id is not None else '#' + str(self.index)}: {self.reason} ({self.fix})"

    def to_dict(self) -> dict:
        return asdict(self)


class BadSampleError(ValueError):
    """Raised with ``on_bad_sample=error``; the message names file, sample and fix."""

    def __init__(self, bad: BadSample):
        super().__init__(bad.message() + "; or set data.on_bad_sample=skip to skip such samples")
        self.bad = bad


def _records(path: Path) -> Iterator[tuple[int, object]]:
    """(index, record) pairs of a JSON array file or a JSONL file; broken lines become errors."""
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
                "fix the file or convert it to JSONL, one conversation per line, so that one "
                "broken record does not spoil the rest"
            ) from None
        yield from enumerate(data)
        return
    for lineno, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as e:
            yield lineno, BadSample(str(path), lineno, None, f"line {lineno + 1} is not valid JSON ({e.msg})",
                                    "fix or delete that line")


def detect_format(record: dict) -> str:
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "llava" if "image" in record else "sharegpt"
    raise ValueError("cannot tell the format: expected a 'conversations' or 'messages' field")


def _normalise(messages: list[dict], src: str, index: int, sid: str) -> list[dict] | BadSample:
    """Check roles and alternation; drop leading assistant turns and trailing user turns."""
    def bad(reason, fix):
        return BadSample(src, index, sid, reason, fix)

    out = []
    for m in messages:
        if m["role"] == "system":
            if out:
                return bad("system message after the first turn", "move it to the start or drop it")
            if m["content"].strip():
                out.append(m)
            continue
        out.append(m)
    body = [m for m in out if m["role"] != "system"]
    system = [m for m in out if m["role"] == "system"]
    # ShareGPT dumps often open with the assistant (a greeting) or end on an unanswered
    # question; neither carries a trainable (user, assistant) pair, so they are trimmed.
    while body and body[0]["role"] == "assistant":
        body = body[1:]
    while body and body[-1]["role"] == "user":
        body = body[:-1]
    if not body:
        return bad("no user/assistant exchange", "each conversation needs a user turn followed by an assistant turn")
    for i, m in enumerate(body):
        want = "user" if i % 2 == 0 else "assistant"
        if m["role"] != want:
            return bad(f"turn {i} is from {m['role']} but {want} was expected (turns must alternate)",
                       "merge or remove the repeated turn")
        if not m["content"].strip():
            return bad(f"turn {i} ({m['role']}) is empty", "remove the empty turn and its pair")
    return system + body


def _turns(raw_turns, src, index, sid, role_key, content_key) -> list[dict] | BadSample:
    if not isinstance(raw_turns, list) or not raw_turns:
        return BadSample(src, index, sid, "empty or missing conversation", "give it at least one exchange")
    out = []
    for j, t in enumerate(raw_turns):
        if not isinstance(t, dict) or role_key not in t:
            return BadSample(src, index, sid, f"turn {j} has no '{role_key}'", f"each turn needs '{role_key}' and '{content_key}'")
        role = ROLE_MAP.get(str(t[role_key]).lower())
        if role is None:
            return BadSample(src, index, sid, f"turn {j} has unknown role {t[role_key]!r}",
                             f"use one of {sorted(ROLE_MAP)}")
        content = t.get(content_key)
        if content is None:
            content = ""
        if not isinstance(content, str):
            return BadSample(src, index, sid, f"turn {j} content is not text", "store the turn's text as a string")
        out.append({"role": role, "content": content})
    return out


def read_conversations(path: str | Path, fmt: str = "auto", image_root: str | Path | None = None) -> Iterator[dict | BadSample]:
    """Yield normalised conversations (or BadSample) from one file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: data file not found; check data.*.path")
    src = str(path)
    root = Path(image_root) if image_root else path.parent
    for index, rec in _records(path):
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
        if f == "messages":
            turns = _turns(rec.get("messages"), src, index, sid, "role", "content")
            images = rec.get("images") or []
        else:
            turns = _turns(rec.get("conversations"), src, index, sid, "from", "value")
            images = rec.get("image") or []
        if isinstance(turns, BadSample):
            yield turns
            continue
        if isinstance(images, str):
            images = [images]
        msgs = _normalise(turns, src, index, sid)
        if isinstance(msgs, BadSample):
            yield msgs
            continue
        n_markers = sum(m["content"].count(IMAGE_MARKER) for m in msgs)
        if images and n_markers == 0 and len(images) == 1:
            # LLaVA entries occasionally lack the marker; LLaVA's own loader prepends it.
            first = next(i for i, m in enumerate(msgs) if m["role"] == "user")
            msgs[first] = {**msgs[first], "content": IMAGE_MARKER + "\n" + msgs[first]["content"]}
            n_markers = 1
        if n_markers != len(images):
            yield BadSample(src, index, sid, f"{n_markers} <image> markers but {len(images)} images",
                            "give one <image> marker per image")
            continue
        yield {"id": sid, "messages": msgs, "images": [str(root / p) for p in images],
               "source": src, "index": index}
