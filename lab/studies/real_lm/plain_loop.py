"""This project's plain decoding loop against transformers' generate() on the real target, per
attention implementation and plain-step row count (``decoding.plain_rows``): ms per new token,
prefill included, the same prompts, every configuration once per round, min over rounds.

    python -m lab.studies.real_lm.plain_loop --bench BENCH.jsonl --out OUT.json \
        [--dtype bfloat16 --samples 3 --new-tokens 64 --rounds 3 --threads 2]

What it answers: what exact bf16 decoding (eager attention, two-row plain steps: docs/decoding.md,
"Fast and exact on a CPU") costs the plain loop, and how the loop compares with generate().
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=str(ROOT / "data/smollm2-llava"))
    ap.add_argument("--bench", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from msd_train.decoding import DecodeConfig, Workspace, generate
    from msd_train.targets import load_target

    items = [json.loads(line) for line in Path(a.bench).read_text().splitlines()[: a.samples]]
    runs, times = {}, {}
    for attn in ("sdpa", "eager"):
        target = load_target(a.target, a.dtype, "cpu", attn_implementation=attn)
        prompts = [target.encode_prompt([{"role": "user", "content": it["turns"][0]}], []) for it in items]
        workspace = Workspace()
        for rows in (1, 2):
            config = DecodeConfig(method="ar", max_new_tokens=a.new_tokens, eos_token_ids=(), plain_rows=rows)
            runs[f"loop {attn} rows={rows}"] = lambda p, c=config, t=target, w=workspace: len(generate(t, None, p, c, workspace=w).tokens)

        def hf(p, t=target):
            ids = p.input_ids[None]
            out = t.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.new_tokens,
                                   min_new_tokens=a.new_tokens, do_sample=False, num_beams=1)
            return out.shape[1] - ids.shape[1]

        runs[f"generate() {attn}"] = hf
        with torch.inference_mode():
            for name in [n for n in runs if attn in n]:
                runs[name](prompts[0])  # warm-up
            for _ in range(a.rounds):
                for name in [n for n in runs if attn in n]:
                    t0, n = time.perf_counter(), 0
                    for p in prompts:
                        n += runs[name](p)
                    times.setdefault(name, []).append(1000 * (time.perf_counter() - t0) / n)
        del target
    ms = {k: round(min(v), 2) for k, v in times.items()}
    res = {"dtype": a.dtype, "threads": a.threads, "samples": a.samples, "new_tokens": a.new_tokens, "rounds": a.rounds,
           "ms_per_token": ms, "all_rounds": times}
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    for k, v in ms.items():
        print(f"{k:<24} {v:7.2f} ms/token")


if __name__ == "__main__":
    main()
