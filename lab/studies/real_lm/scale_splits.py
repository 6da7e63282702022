"""The splits of the scale runs (benchmarks/real_lm/README.md), from the
committed regenerated conversations (data/smollm2-llava-regen/*.jsonl.xz), deterministically.

    python -m lab.studies.real_lm.scale_splits OUT_DIR [--text-train N] [--heldout 150]

OUT_DIR gets
  text_train.jsonl     ShareGPT first turns in prefix order before --bench-from, the target's
                       answers (all of them by default); when --text-train asks for more than were
                       answered, the next prefix conversations follow with ShareGPT's own first
                       answer, their id ending in "#sharegpt"
  text_heldout.jsonl   the --heldout answered conversations after the training ones
  mm_train.jsonl       easy-VQA training images with the target's answers: its own questions and
                       short requests, then the described-and-followed-up conversations
                       (images-describe), all but the last --heldout // 2 of each
  mm_heldout.jsonl     the last --heldout // 2 of each kind, alternating (a validation that reads
                       the first 64 sees both kinds)
  bench_text.jsonl     --bench-n first user turns (20-400 characters) from prefix conversation
                       --bench-from on: none of them regenerated, so no split holds them
  bench_images.jsonl   make_image_data.py's held-out questions (--images): photographs and easy-VQA
                       *test* images
  bench_heldout_text64.jsonl  the first user turns of text_heldout's conversations 65-128, which
                       validation (data.max_heldout=64) never reads: a larger decoded held-out set
  splits.json          counts, answered-by, the files' digests
Conversations the target did not answer (a prompt over the regeneration's budget) are left out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
from pathlib import Path

from lab.studies.real_lm.scale_data import OUT as REGEN
from lab.studies.real_lm.scale_data import _absolute

ROOT = Path(__file__).resolve().parents[3]
PREFIX = ROOT / "data" / "sharegpt-v3-prefix.jsonl"


def answered(name: str, before: int | None = None) -> tuple[list[dict], int]:
    """The regenerated records the target answered, in their input order (those of input index
    ``before`` on left out), and the highest input index regenerated (answered or not) below it."""
    path = REGEN / name
    if not path.is_file():
        raise SystemExit(f"{path} is missing: it is committed with the repository (git checkout it), or "
                         f"made by the regeneration of data/README.md (\"The scale data\") then scale_data.py pack")
    with lzma.open(path, "rt", encoding="utf-8") as fh:
        recs = sorted((json.loads(line) for line in fh), key=lambda r: r["n"])
    if before is not None:
        recs = [r for r in recs if r["index"] < before]
    return ([{"id": r["id"], "messages": r["messages"], "images": [_absolute(p) for p in r["images"]]}
             for r in recs if r["regenerated"]["turns"] >= 1], max(r["index"] for r in recs))


def prefix_first_exchanges(start: int):
    """(index, conversation) of ShareGPT's own first exchange, prefix conversation ``start`` on."""
    role = {"human": "user", "gpt": "assistant"}
    with open(PREFIX, encoding="utf-8") as fh:
        for k, line in enumerate(fh):
            if k < start:
                continue
            c = json.loads(line)
            turns = c.get("conversations") or []
            if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
                yield k, {"id": f"{c['id']}#sharegpt", "images": [],
                          "messages": [{"role": role[t["from"]], "content": t["value"]} for t in turns[:2]]}


def write(path: Path, rows: list[dict]) -> str:
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    path.write_text(data, encoding="utf-8")
    return hashlib.sha1(data.encode()).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--text-train", type=int, default=None, help="default: every answered conversation")
    ap.add_argument("--heldout", type=int, default=150)
    ap.add_argument("--bench-from", type=int, default=15000)
    ap.add_argument("--bench-n", type=int, default=16)
    ap.add_argument("--images", required=True, help="make_image_data.py's folder (its held-out questions)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    text, last_index = answered("text.jsonl.xz", before=a.bench_from)
    held_text = text[-a.heldout:]
    train_text = text[: len(text) - a.heldout][: a.text_train]
    n_target = len(train_text)
    if a.text_train is not None and n_target < a.text_train:  # the rest with ShareGPT's answers, after every regenerated conversation
        for k, conv in prefix_first_exchanges(last_index + 1):
            if k >= a.bench_from or len(train_text) >= a.text_train:
                break
            train_text.append(conv)
    train_mm, held_kinds = [], []
    for part in ("images.jsonl.xz", "images-describe.jsonl.xz"):
        images, _ = answered(part)
        half = a.heldout // 2
        train_mm += images[: len(images) - half]
        held_kinds.append(images[-half:])
    held_mm = [r for pair in zip(*held_kinds) for r in pair]

    bench_text = []
    with open(PREFIX, encoding="utf-8") as fh:
        for k, line in enumerate(fh):
            if k < a.bench_from:
                continue
            turns = json.loads(line).get("conversations") or []
            q = turns[0]["value"].strip() if turns and turns[0].get("from") == "human" else ""
            if 20 <= len(q) <= 400:
                bench_text.append({"id": f"sharegpt-{k}", "image": None, "turns": [q], "category": "sharegpt"})
            if len(bench_text) >= a.bench_n:
                break
    bench_images = [json.loads(line) for line in open(Path(a.images) / "bench_images.jsonl", encoding="utf-8")]
    bench_heldout = [{"id": r["id"], "turns": [next(m["content"] for m in r["messages"] if m["role"] == "user")],
                      "category": "sharegpt-heldout"} for r in held_text[64:128]]
    files = {"text_train.jsonl": train_text, "text_heldout.jsonl": held_text, "mm_train.jsonl": train_mm,
             "mm_heldout.jsonl": held_mm, "bench_text.jsonl": bench_text, "bench_images.jsonl": bench_images,
             "bench_heldout_text64.jsonl": bench_heldout}
    summary = {"files": {name: {"rows": len(rows), "sha1": write(out / name, rows)} for name, rows in files.items()},
               "text_train_answered_by_target": n_target,
               "text_train_with_sharegpt_answers": len(train_text) - n_target,
               "regenerated_prefix_conversations": last_index + 1, "bench_from": a.bench_from}
    (out / "splits.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
