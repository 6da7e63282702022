"""Split the merged regenerated ShareGPT conversations into training and held-out files, write
the same conversations with their original ShareGPT answers, and a benchmark JSONL of
ShareGPT prompts no run trained on.

    python -m lab.studies.real_lm.make_data REGEN_DIR/regenerated.jsonl PREFIX.jsonl OUT_DIR

OUT_DIR gets regen_train.jsonl, orig_train.jsonl (same conversations, first exchange as
ShareGPT has it: the regeneration used max_turns=1), heldout_regen.jsonl (the last
``--heldout`` regenerated conversations: validation for both runs, on the target's own
answers) and bench.jsonl (first user turns of prefix conversations from ``--bench-from`` on,
at most ``--bench-max-chars`` long, ``--bench-n`` of them).
"""

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("regenerated")
    ap.add_argument("prefix")
    ap.add_argument("out")
    ap.add_argument("--heldout", type=int, default=14)
    ap.add_argument("--bench-from", type=int, default=1000)
    ap.add_argument("--bench-n", type=int, default=12)
    ap.add_argument("--bench-max-chars", type=int, default=400)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    recs = [json.loads(line) for line in open(a.regenerated, encoding="utf-8")]
    train, held = recs[: len(recs) - a.heldout], recs[len(recs) - a.heldout:]

    def first_exchange(msgs):
        i = next(k for k, m in enumerate(msgs) if m["role"] == "assistant")
        return msgs[: i + 1]

    def write(name, rows):
        with open(out / name, "w", encoding="utf-8") as fh:
            for r in rows:
                fh.write(json.dumps(r, ensure_ascii=False) + "\n")

    write("regen_train.jsonl", [{"id": r["id"], "messages": r["messages"]} for r in train])
    write("orig_train.jsonl", [{"id": r["id"], "messages": first_exchange(r["original"])} for r in train])
    write("heldout_regen.jsonl", [{"id": r["id"], "messages": r["messages"]} for r in held])
    bench = []
    with open(a.prefix, encoding="utf-8") as fh:
        for k, line in enumerate(fh):
            if k < a.bench_from:
                continue
            conv = json.loads(line)
            turns = conv.get("conversations") or []
            if not turns or turns[0].get("from") != "human":
                continue
            q = turns[0]["value"].strip()
            if 20 <= len(q) <= a.bench_max_chars:
                bench.append({"id": f"sharegpt-{k}", "image": None, "turns": [q], "category": "sharegpt"})
            if len(bench) >= a.bench_n:
                break
    write("bench.jsonl", bench)
    print(f"{len(train)} training, {len(held)} held-out conversations; {len(bench)} benchmark prompts -> {out}")


if __name__ == "__main__":
    main()
