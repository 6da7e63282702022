"""Plain decoding on the real target: this project's loop vs transformers' generate(), and the
speculative cycle's split, on one held-out ShareGPT prompt; the measurements are
lab/bench/decoder_table.py's own (bench_plain, bench_cycle), run on a loaded target and a trained
head instead of the random 7B-shaped ones.

    python -m lab.studies.real_lm.plain_vs_generate --draft RUN/stage1/final \
        --bench bench.jsonl --out benchmarks/real_lm/plain_vs_generate.json [--repeats 3 --new-tokens 32]
"""

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[3]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=str(ROOT / "data/smollm2-llava"))
    ap.add_argument("--draft", required=True)
    ap.add_argument("--bench", required=True)
    ap.add_argument("--item", type=int, default=0, help="which benchmark line's first turn")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cycle", action="store_true", help="also bench_cycle (tree verify sizes, draft, accept)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from lab.bench import decoder_table
    from msd_train.hub.load import load_head
    from msd_train.targets import load_target

    device = torch.device("cpu")
    target = load_target(a.target, torch.float32, device)
    draft = load_head(a.draft, target)
    line = open(a.bench, encoding="utf-8").read().splitlines()[a.item]
    q = json.loads(line)["turns"][0]
    prompt = target.encode_prompt([{"role": "user", "content": q}], [])
    args = SimpleNamespace(repeats=a.repeats, warmup=a.warmup, new_tokens=a.new_tokens, threads=a.threads,
                           hf_caches=["dynamic", "static"])
    t0 = time.time()
    bandwidth = decoder_table.bench_bandwidth(device, args)
    plain = decoder_table.bench_plain(target, prompt, args, device, bandwidth)
    res = {"prompt_tokens": int(prompt.input_ids.numel()), "threads": a.threads, "bandwidth": bandwidth,
           "plain": plain, "draft": a.draft}
    if a.cycle:
        res["cycle"] = decoder_table.bench_cycle(target, draft, prompt, args, device, plain["project_ar_ms_per_token"] / 1e3)
    res["seconds"] = round(time.time() - t0, 1)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(plain, indent=1))


if __name__ == "__main__":
    main()
