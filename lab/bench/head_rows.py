"""What one draft step costs as the number of batch rows (ensemble variants) grows.

    python -m lab.bench.head_rows [--draft runs/tiny/stage2/final] [--threads 1]

Times, for R = 1..4 rows over the same prompt (the M prefix repeated R times): one head step
(one query per row, over the prompt's cache) plus the lm_head, and the bare `linear` of each
of the head's weight shapes on an R-row input. Medians of interleaved repeats. Explains the
ensemble's drafting overhead on a CPU: when the weights fit in cache, the work grows with
the rows. Writes benchmarks/ensemble/head_rows_<device>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from lab.cli import at_least
from msd_train.evaluation.run import describe_device

ROOT = Path(__file__).resolve().parents[2]


def _median_ms(fns: dict, repeats: int) -> dict:
    """Interleaved repeats of every callable; medians in ms."""
    times = {k: [] for k in fns}
    for f in fns.values():  # warm-up
        f()
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: round(1000 * statistics.median(v), 4) for k, v in times.items()}


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default=str(ROOT / "runs/tiny/stage2/final"))
    ap.add_argument("--threads", type=at_least(1), default=1)
    ap.add_argument("--repeats", type=at_least(1), default=300)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not Path(args.draft).is_dir():
        sys.exit(f"--draft {args.draft}: no such folder; train the tiny head first (README)")
    from PIL import Image

    from msd_train.decoding import prefill
    from msd_train.decoding.ensemble import EnsembleDrafter
    from msd_train.hub.load import load_head
    from msd_train.targets import load_target

    target = load_target(str(ROOT / "data/tiny-llava"), "auto", "cpu")
    draft = load_head(args.draft, target)
    image = Image.open(ROOT / "data/tiny/images/shapes/heldout_00000.png").convert("RGB")
    prompt = target.encode_prompt([{"role": "user", "content": "<image>\nDescribe the image."}], [image])

    steps = {}
    for rows in (1, 2, 3, 4):
        state = prefill(target, EnsembleDrafter(draft, ("M",) * rows, "ibed", 32), prompt)
        e = target.embed_tokens(torch.tensor([[5]]))
        h = state.pending_hidden[None].expand(rows, -1, -1)
        pos = target.continue_positions(state.drafter.cache.length, 1, None)
        one = torch.ones(1, 1, dtype=torch.bool)

        def step(state=state, e=e, h=h, pos=pos, one=one):
            # writes one slot past the committed length; the cache's length does not move
            out = state.drafter.head(e, h, pos, one)
            target.lm_head(out).softmax(-1)

        steps[rows] = step
    step_ms = _median_ms(steps, args.repeats)

    c = draft.config
    shapes = {"fc": (c.hidden_size, 2 * c.hidden_size), "q/k/v/o": (c.hidden_size, c.hidden_size),
              "mlp up/gate": (c.intermediate_size, c.hidden_size), "mlp down": (c.hidden_size, c.intermediate_size),
              "lm_head": (target.vocab_size, c.hidden_size)}
    linear = {}
    for name, (n_out, n_in) in shapes.items():
        w = torch.randn(n_out, n_in)
        inputs = {r: torch.randn(r, n_in) for r in (1, 2, 3, 4)}
        fns = {r: (lambda x=inputs[r], w=w: torch.nn.functional.linear(x, w)) for r in inputs}
        linear[name] = {"shape": [n_out, n_in], "us": {r: round(1000 * ms, 2) for r, ms in
                                                       _median_ms(fns, args.repeats * 3).items()}}

    device = describe_device(torch.device("cpu"))
    result = {
        "command": " ".join(["python", "-m", "lab.bench.head_rows", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device, "load_average": os.getloadavg(), "draft": os.path.relpath(args.draft, ROOT),
        "head": {"hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
                 "layers": c.num_hidden_layers, "vocab": target.vocab_size},
        "head_step_ms_by_rows": step_ms,
        "head_step_relative_to_one_row": {r: round(ms / step_ms[1], 3) for r, ms in step_ms.items()},
        "linear_us_by_rows": linear,
    }
    out = ROOT / "benchmarks" / "ensemble" / "head_rows_cpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("head_step_ms_by_rows", "head_step_relative_to_one_row")}, indent=1))
    for name, v in linear.items():
        print(f"{name:12s} {v['shape']}: " + ", ".join(f"{r} rows {us} us" for r, us in v["us"].items()))


if __name__ == "__main__":
    from msd_train.errors import run_main

    run_main(main)  # a known failure (a missing path, a full disk, Ctrl-C): one line, exit non-zero
