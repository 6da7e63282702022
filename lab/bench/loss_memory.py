"""Peak host memory of the training loss (forward + backward) at Qwen's vocabulary, on CPU.

Each configuration runs in a fresh process; the number reported is the growth of the
process's peak resident set over what it held before the loss (the lm_head, the features),
i.e. what the loss itself adds: full-vocabulary logits, their softmaxes, the gradient.
The logits' share does not depend on the hidden size, so a smaller ``--hidden`` than the
target's keeps the CPU time short without changing what is measured.

    python -m lab.bench.loss_memory --out benchmarks/loss_memory/chunked.json
    # a single pass over all positions (msd_train at 8af0b5c), measured by this same script:
    PYTHONPATH=/path/to/that/checkout python -m lab.bench.loss_memory --out .../unchunked.json
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

from lab.cli import at_least

ROOT = Path(__file__).resolve().parents[2]  # `python -m lab.bench.loss_memory` runs from here


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def one(args) -> dict:
    """One measurement, in this process."""
    import torch

    import msd_train
    from msd_train.training.loss import msd_loss

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False).to(dtype).requires_grad_(False)
    pred = torch.randn(1, args.tokens, args.hidden, dtype=dtype, requires_grad=True)
    target = torch.randn(1, args.tokens, args.hidden, dtype=dtype)
    mask = torch.ones(1, args.tokens, dtype=torch.long)
    before = peak_mb()
    t0 = time.perf_counter()
    kw = {} if args.chunk is None else {"chunk": args.chunk}
    loss, _ = msd_loss(pred, target, head, mask, float(args.tokens), **kw)
    loss.backward()
    seconds = time.perf_counter() - t0
    return {"tokens": args.tokens, "vocab": args.vocab, "hidden": args.hidden, "dtype": args.dtype,
            "chunk": kw.get("chunk", "default"), "loss_peak_mb": round(peak_mb() - before, 1),
            "baseline_mb": round(before, 1), "seconds": round(seconds, 2), "loss": float(loss),
            "msd_train": str(Path(msd_train.__file__).parent)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=at_least(1), nargs="+", default=[512, 2048], help="loss positions per micro-batch")
    ap.add_argument("--vocab", type=at_least(1), default=152064, help="Qwen2-VL / Qwen2.5-VL")
    ap.add_argument("--hidden", type=at_least(1), default=1024)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--chunk", type=at_least(1), default=None, help="msd_loss's chunk (default: the library's)")
    ap.add_argument("--threads", type=at_least(1), default=2)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        args.tokens = args.tokens[0]
        print(json.dumps(one(args)))
        return
    rows = []
    for n in args.tokens:
        cmd = [sys.executable, "-m", "lab.bench.loss_memory", "--one", "--tokens", str(n), "--vocab", str(args.vocab), "--hidden",
               str(args.hidden), "--dtype", args.dtype, "--threads", str(args.threads)]
        if args.chunk is not None:
            cmd += ["--chunk", str(args.chunk)]
        row = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout.splitlines()[-1])
        print(json.dumps(row))
        rows.append(row)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(rows[0]["msd_train"]).parent).stdout.strip() if rows else ""
    result = {"rows": rows, "commit_of_msd_train": commit, "machine": platform.platform(),
              "command": " ".join(["python", "-m", "lab.bench.loss_memory", *(argv or sys.argv[1:])])}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    from msd_train.errors import run_main

    run_main(main)  # a known failure (a missing path, a full disk, Ctrl-C): one line, exit non-zero
