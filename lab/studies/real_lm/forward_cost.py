#!/usr/bin/env python
"""Where a speculative cycle's time goes on this CPU: the target's forward over T new
tokens on a cached prompt (T=1 is a plain decoding step), the lm_head over R rows, and one
head step, each timed on the loaded SmolLM2-LLaVA target; then what a chain of k drafts
costs in plain steps and the tau it needs to break even.

    OMP_NUM_THREADS=1 python -m lab.studies.real_lm.forward_cost --target data/smollm2-llava \
        --draft HEAD --out benchmarks/real_lm/results/forward_cost.json

The head's cost is measured without its lm_head (``head.step``) and the lm_head apart, so the
share of the 49k-token output layer is visible.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch


def timed(fn, repeats: int) -> dict:
    fn()  # warm-up
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(1000 * (time.perf_counter() - t0))
    return {"min_ms": round(min(runs), 2), "median_ms": round(statistics.median(runs), 2),
            "max_ms": round(max(runs), 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="data/smollm2-llava")
    p.add_argument("--draft", required=True, help="an msd head export for this target")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from msd_train.hub import load_head
    from msd_train.targets import load_target

    target = load_target(args.target, "float32", "cpu", None, None, False, "sdpa")
    head = load_head(args.draft)
    lm = target.model
    width = lm.config.text_config.hidden_size
    vocab = lm.lm_head.weight.shape[0]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, vocab - 1, (1, args.prompt_tokens), generator=g)
    out: dict = {"target": args.target, "draft": args.draft, "threads": torch.get_num_threads(),
                 "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads", "torch": torch.__version__,
                 "prompt_tokens": args.prompt_tokens, "vocab": vocab, "hidden": width, "repeats": args.repeats}
    with torch.inference_mode():
        first = lm(input_ids=prompt, use_cache=True)
        cache = getattr(first, "cache", None) or first.past_key_values
        L = prompt.shape[1]

        def target_forward(T):
            ids = torch.randint(100, vocab - 1, (1, T), generator=g)

            def run():
                lm(input_ids=ids, cache=cache, use_cache=True, position_ids=torch.arange(L, L + T)[None])
                cache.crop(-T)  # back to the prompt (transformers >= 5.23 takes a negative count)
            return run

        out["target_forward"] = {T: timed(target_forward(T), args.repeats) for T in (1, 2, 3, 4, 6, 8, 16)}
        out["lm_head"] = {R: timed(lambda R=R: lm.lm_head(torch.randn(1, R, width)), args.repeats) for R in (1, 4, 8)}
        hidden = torch.randn(1, 1, width)
        embeds = torch.randn(1, 1, width)
        state = head.project(hidden)
        out["head_step_without_lm_head"] = timed(lambda: head.step(embeds, state, use_cache=False), args.repeats)
    plain = out["target_forward"][1]["median_ms"]
    step = out["head_step_without_lm_head"]["median_ms"] + out["lm_head"][1]["median_ms"]
    chain = {}
    for k in (1, 2, 3, 5):
        verify = out["target_forward"].get(k + 1, {}).get("median_ms")
        if verify is None:
            continue
        cycle = k * step + verify
        chain[k] = {"cycle_ms": round(cycle, 1), "cycle_in_plain_steps": round(cycle / plain, 2),
                    "break_even_tau": round(cycle / plain, 2), "lm_head_share_of_drafting": round(
                        out["lm_head"][1]["median_ms"] / step, 2)}
    out["chain_model"] = chain
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
