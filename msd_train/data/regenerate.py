"""Answer training conversations with the target itself, as EAGLE-3 and the serving
frameworks train their heads: the head then learns the target's own distribution, not the
answers some other model wrote.

Used by ``scripts/regenerate_data.py``. Each conversation's user turns are kept; every
assistant turn is replaced by the target's answer to the conversation so far (its own
earlier answers included), greedy or sampled, up to ``max_new_tokens``. A record::

    {"id": ..., "messages": [...regenerated...], "images": [...], "n": position,
     "original": [...the messages as read...], "source": file, "index": position in file,
     "regenerated": {"turns": k, "new_tokens": [...], "stops": [...], "seconds": wall time,
                     "cpu_seconds": this process's CPU time (a throughput a busy machine spoils less)}}

is a ``messages`` JSONL record, so ``data.text`` / ``data.multimodal`` read the merged file
``regenerated.jsonl`` like any other (the extra keys are ignored).

Resuming and sharding: conversation ``n`` (its position among the usable conversations
read, in file order) goes to rank ``n mod W``, which appends its record to
``rank-<r>.jsonl``, one flushed line per conversation. A relaunch (any world size) reads
every rank file, counts the complete lines as done and skips them; a line cut short by a
kill is dropped. Sampling draws from a generator seeded by ``(seed, n)``, so a resumed
conversation is answered as it would have been without the interruption. Rank 0 then
merges the records in ``n`` order into ``regenerated.jsonl`` and writes ``manifest.json``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch

from msd_train.data.formats import BadSample, read_conversations
from msd_train.targets.chat import count_image_markers

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


def read_done(out: Path) -> dict[int, dict]:
    """Records of every complete line of every rank file, by conversation position."""
    done: dict[int, dict] = {}
    for f in sorted(out.glob("rank-*.jsonl")):
        with open(f, encoding="utf-8") as fh:
            for line in fh:
                if not line.endswith("\n"):
                    break  # cut short by a kill: not done
                rec = json.loads(line)
                done.setdefault(rec["n"], rec)
    return done


def drop_partial_line(path: Path) -> None:
    """Cut a last line that has no newline (a write killed half-way) off ``path``."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as fh:
            fh.truncate(data.rfind(b"\n") + 1)


def regenerate_conversation(target, conv: dict, settings: dict, n: int) -> dict:
    """``conv`` with its assistant turns answered by ``target`` (see the module docstring)."""
    from PIL import Image

    from msd_train.decoding.config import DecodeConfig
    from msd_train.decoding.sampling import SamplingParams
    from msd_train.decoding.speculative import generate

    config = DecodeConfig(method="ar", max_new_tokens=int(settings["max_new_tokens"]), sampling=SamplingParams(
        temperature=float(settings["temperature"]), top_p=float(settings["top_p"]), top_k=int(settings["top_k"])))
    gen = torch.Generator(device=target.device).manual_seed(int(settings["seed"]) * 1_000_003 + n)
    t0, c0 = time.time(), time.process_time()
    images = [Image.open(p).convert("RGB") for p in conv["images"]]
    out: list[dict] = []
    new_tokens, stops = [], []
    max_turns = settings.get("max_turns")
    for m in conv["messages"]:
        if m["role"] != "assistant":
            out.append(dict(m))
            continue
        prompt = target.encode_prompt(out, images[: count_image_markers(out)])
        if settings.get("max_prompt_tokens") and len(prompt.input_ids) > int(settings["max_prompt_tokens"]):
            out.pop()  # the question stays unanswered: dropped with its turn
            stops.append("prompt_too_long")
            break
        g = generate(target, None, prompt, config, generator=gen)
        text = g.text.strip()
        if not text:
            out.pop()
            stops.append("empty")
            break
        out.append({"role": "assistant", "content": text})
        new_tokens.append(len(g.tokens))
        stops.append(g.stop_reason)
        if max_turns and len(new_tokens) >= int(max_turns):
            break
    if out and out[-1]["role"] == "user":
        out.pop()
    kept = count_image_markers(out)
    return {"id": conv["id"], "n": n, "messages": out, "images": conv["images"][:kept],
            "original": conv["messages"], "source": conv.get("source"), "index": conv.get("index"),
            "regenerated": {"turns": len(new_tokens), "new_tokens": new_tokens, "stops": stops,
                            "seconds": round(time.time() - t0, 2), "cpu_seconds": round(time.process_time() - c0, 2)}}


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


def regenerate(target, settings: dict, group=None, on_record=None) -> dict | None:
    """Regenerate ``settings["inputs"]`` into ``settings["out"]`` (see the module docstring);
    ``on_record(record)`` is called after each record is written (tests interrupt there).
    Returns the manifest on rank 0, None on other ranks."""
    from tqdm import tqdm

    from msd_train.runtime import atomic_write_text

    rank, world = (group.rank, group.world) if group is not None else (0, 1)
    out = Path(settings["out"])
    convs, bad = read_inputs(list(settings["inputs"]), settings.get("limit"))
    if not convs:
        raise RegenerateError(f"no usable conversation in {[s['path'] for s in settings['inputs']]}; "
                              "check the inputs' paths and format")
    out.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        _check_settings(out, settings, target.name)
    if group is not None:
        group.barrier()
    mine_file = out / f"rank-{rank}.jsonl"
    drop_partial_line(mine_file)
    done = read_done(out)
    todo = [n for n in range(rank, len(convs), world) if n not in done]
    t0, tokens = time.time(), 0
    bar = tqdm(total=len(range(rank, len(convs), world)), initial=len(range(rank, len(convs), world)) - len(todo),
               desc=f"regenerate (rank {rank})", disable=rank != 0 or not settings.get("progress", True),
               mininterval=2.0, unit="conv")
    with open(mine_file, "a", encoding="utf-8") as fh:
        for n in todo:
            rec = regenerate_conversation(target, convs[n], settings, n)
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
            tokens += sum(rec["regenerated"]["new_tokens"])
            bar.update(1)
            bar.set_postfix(tok_s=f"{tokens / max(time.time() - t0, 1e-9):.1f}")
            if on_record is not None:
                on_record(rec)
    bar.close()
    elapsed = time.time() - t0
    if group is not None:
        group.barrier()
    if rank != 0:
        return None
    done = read_done(out)
    missing = [n for n in range(len(convs)) if n not in done]
    if missing:
        raise RegenerateError(f"{out}: conversations {missing[:5]} have no record after every rank finished; relaunch to fill them")
    # A conversation whose first prompt is over max_prompt_tokens (or whose first answer is
    # empty) keeps no exchange: left out, as the readers would refuse it.
    records = [done[n] for n in range(len(convs)) if done[n]["regenerated"]["turns"]]
    atomic_write_text(out / MERGED, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    manifest = {"conversations": len(records), "skipped_samples": len(bad), "unanswered": len(convs) - len(records),
                "turns": sum(r["regenerated"]["turns"] for r in records),
                "new_tokens": sum(sum(r["regenerated"]["new_tokens"]) for r in records),
                "this_launch": {"conversations": len(todo), "new_tokens": tokens, "seconds": round(elapsed, 1),
                                "world": world}, "file": MERGED, "complete": True}
    atomic_write_text(out / "manifest.json", json.dumps(manifest, indent=1) + "\n")
    return manifest
