"""transformers' generate() on the decoder benchmark's prompts, timed as eval.py times decoding:
new tokens over wall-clock seconds, prefill included, totals over the prompts (greedy, stopping
at the target's end of turn, up to --new-tokens a prompt). The denominator of "speedup over
generate()" in benchmarks/real_lm/README.md.

    python -m lab.studies.real_lm.generate_speed --bench BENCH.jsonl --out OUT.json \
        [--samples 8 --new-tokens 64 --threads 2 --repeats 3 --dtype bfloat16 --attn sdpa]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[3]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=str(ROOT / "data/smollm2-llava"))
    ap.add_argument("--bench", required=True)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", help="the target's dtype (eval.py's target.dtype)")
    ap.add_argument("--attn", default="sdpa", help="attention implementation (target.attn_implementation)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from msd_train.targets import load_target

    target = load_target(a.target, a.dtype, torch.device("cpu"), attn_implementation=a.attn)
    items = [json.loads(line) for line in open(a.bench, encoding="utf-8").read().splitlines()[: a.samples]]
    prompts = []
    for it in items:
        images = [Image.open(it["image"]).convert("RGB")] if it.get("image") else []
        text = ("<image>\n" if images else "") + it["turns"][0]
        prompts.append(target.encode_prompt([{"role": "user", "content": text}], images))
    stops = target.eos_token_ids  # what the project's decoder stops at

    def run(p):
        ids = p.input_ids[None]
        extra = {k: (v.to(target.dtype) if v.is_floating_point() else v) for k, v in p.pixel.items()}
        out = target.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.new_tokens,
                                    do_sample=False, num_beams=1, eos_token_id=stops, pad_token_id=stops[0],
                                    use_cache=True, **extra)
        return out[0, ids.shape[1]:].tolist()

    with torch.inference_mode():
        run(prompts[0])  # warm-up
        totals, tokens = [], None
        for _ in range(a.repeats):
            t0, outs = time.perf_counter(), []
            for p in prompts:
                outs.append(run(p))
            totals.append(time.perf_counter() - t0)
            tokens = outs
    n = sum(len(t) for t in tokens)
    res = {"bench": a.bench, "samples": len(prompts), "threads": a.threads, "max_new_tokens": a.new_tokens,
           "dtype": a.dtype, "attn_implementation": a.attn,
           "new_tokens": n, "seconds": [round(t, 3) for t in totals],
           "tokens_per_s": round(n / statistics.median(totals), 3), "tokens": tokens}
    Path(a.out).write_text(json.dumps(res) + "\n")
    print(f"generate(): {n} new tokens, {res['tokens_per_s']} tokens/s (median of {a.repeats})")


if __name__ == "__main__":
    main()
