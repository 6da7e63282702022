#!/usr/bin/env python
"""What a verification of M tokens costs in matrix products on this CPU, and how its rows
round: ``F.linear`` at SmolLM2-135M's shapes (MLP up 576->1536, down 1536->576, lm_head
576->49,153) for M rows, in fp32 (MKL) and bf16 (oneDNN), with the weight as stored (N, K)
and with the same weight stored transposed (a (K, N) buffer viewed as (N, K): the other MKL
code path), at 1 and 2 threads. For each M > 1, ``rows_as_one_row``: whether every row of
the M-row product equals that row's one-row product bit for bit, and ``rows_as_two_rows``:
whether it equals the row of a two-row product (the row twice), which is what the decoder's
plain step computes in bf16 on a CPU (``decoding.plain_rows``).

    python -m lab.studies.real_lm.matmul_rows --out benchmarks/real_lm/results/matmul_rows.json

Read with the decoder benchmark: a forward over M tokens is these products, so the
verification of a chain of k drafts (M = k + 1) costs what this says about M rows.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {"mlp_up": (1536, 576), "mlp_down": (576, 1536), "lm_head": (49153, 576)}
ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 16)


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(1000 * (time.perf_counter() - t0))
    return round(statistics.median(runs), 4)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    out = {"machine": platform.machine(), "torch": torch.__version__, "blas": "mkl" if torch.backends.mkl.is_available()
           else "other", "repeats": args.repeats, "ms": {}, "rounding": {}}
    for dtype in (torch.float32, torch.bfloat16):
        dname = str(dtype).removeprefix("torch.")
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for name, (n, k) in SHAPES.items():
                w = torch.randn(n, k, generator=g).to(dtype)
                wt = w.t().contiguous().t()  # same values, transposed storage
                for m in ROWS:
                    x = torch.randn(1, m, k, generator=g).to(dtype) * 4  # activations of a real model's size
                    reps = max(3, args.repeats // 3) if name == "lm_head" else args.repeats
                    row = {"stored": median_ms(functools.partial(F.linear, x, w), reps),
                           "transposed": median_ms(functools.partial(F.linear, x, wt), reps)}
                    out["ms"].setdefault(dname, {}).setdefault(f"{threads} threads", {}).setdefault(name, {})[m] = row
                    if m > 1:
                        full = F.linear(x, w)[0]
                        one = torch.cat([F.linear(x[:, i : i + 1], w)[0] for i in range(m)])
                        two = torch.cat([F.linear(x[:, [i, i]], w)[0, :1] for i in range(m)])
                        out["rounding"].setdefault(dname, {}).setdefault(f"{threads} threads", {}).setdefault(
                            name, {})[m] = {"rows_as_one_row": torch.equal(full, one),
                                            "rows_as_two_rows": torch.equal(full, two)}
                    print(dname, threads, name, m, row, out["rounding"].get(dname, {}).get(f"{threads} threads", {})
                          .get(name, {}).get(m, ""), flush=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
