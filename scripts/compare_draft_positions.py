#!/usr/bin/env python
"""Which draft-position convention gives the better Qwen2-VL head: ``draft_positions=1d`` or ``mrope``.

Builds a tiny Qwen2-VL target folder (``msd_train.targets.tiny_qwen``: the embedded tiny
LLaVA's trained language model in a Qwen2-VL with M-RoPE and a random vision tower), then
for each convention trains a head with the project's own commands, same seed and steps::

    python train.py stage=1 target.name_or_path=DIR draft.draft_positions=P run_dir=RUN/P ...
    python train.py stage=2 ...            (from RUN/P/stage1/final)

reads the held-out simulated tau of each stage from its ``metrics.jsonl``, and runs
``python eval.py`` on both stage-2 heads on the tiny benchmark (greedy; tree and chain) for
the decoder's tau per category and exactness against plain decoding. Writes
``OUT/results.json`` and ``OUT/results.md`` (with this command line).

    python scripts/compare_draft_positions.py --steps1 300 --steps2 150
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from msd_train.targets.tiny_qwen import save_tiny_qwen2vl  # noqa: E402

CONVENTIONS = ("1d", "mrope")
METHODS = ("tree", "chain")


def run(cmd: list[str]) -> float:
    """Run one project command from the repository root; returns its wall seconds."""
    print("+", " ".join(cmd), flush=True)
    t0 = time.time()
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "WANDB_MODE": "disabled"})
    return time.time() - t0


def last_validation(metrics: Path) -> dict:
    """The last held-out validation row of a stage's metrics.jsonl (simulated tau and top-1)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    val = [r for r in rows if any(k.startswith("val/") for k in r)]
    if not val:
        raise SystemExit(f"{metrics} has no validation row; did the stage run to its end?")
    last = val[-1]
    return {"step": last.get("step"), **{k[4:]: v for k, v in last.items()
                                         if k.startswith("val/") and k.endswith(("sim_tau", "top1"))}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", default=str(ROOT / "runs" / "qwen_positions"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "qwen_positions"))
    ap.add_argument("--steps1", type=int, default=300, help="stage-1 optimizer steps")
    ap.add_argument("--steps2", type=int, default=150, help="stage-2 optimizer steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-per-category", type=int, default=8, help="bench items per category for eval.py")
    ap.add_argument("--train", nargs="*", default=[], help="extra train.py overrides (both stages, both heads)")
    ap.add_argument("--eval", nargs="*", default=[], help="extra eval.py overrides")
    args = ap.parse_args()
    run_dir, out = Path(args.run_dir).resolve(), Path(args.out).resolve()
    py = sys.executable

    target = save_tiny_qwen2vl(run_dir / "target", ROOT / "data" / "tiny-llava", seed=args.seed)
    tgt = [f"target.name_or_path={target}", "target.chat_template=chatml_qwen"]
    common = [*tgt, "data=tiny", f"data.cache_dir={run_dir / 'cache'}", f"seed={args.seed}",
              "logging.wandb.mode=disabled", "logging.progress=false", "resume=false", *args.train]
    results: dict = {"simulated": {}, "decoder": {}, "wall_s": {}}
    for conv in CONVENTIONS:
        rd = run_dir / conv
        wall = 0.0
        for stage, steps in (("1", args.steps1), ("2", args.steps2)):
            wall += run([py, "train.py", f"stage={stage}", f"run_dir={rd}", f"draft.draft_positions={conv}",
                         f"train.max_steps={steps}", *common])
        results["wall_s"][f"train {conv}"] = round(wall, 1)
        results["simulated"][conv] = {f"stage{s}": last_validation(rd / f"stage{s}" / "metrics.jsonl")
                                      for s in ("1", "2")}
    for conv in CONVENTIONS:
        results["decoder"][conv] = {}
        for method in METHODS:
            ev = run_dir / conv / f"eval-{method}"
            results["wall_s"][f"eval {conv} {method}"] = round(run(
                [py, "eval.py", f"draft={run_dir / conv / 'stage2' / 'final'}", f"out={ev}", *tgt,
                 f"decoding={method}", "threads=1", "progress=false",
                 f"bench.max_per_category={args.max_per_category}", *args.eval]), 1)
            rep = json.loads((ev / "report.json").read_text())
            results["decoder"][conv][method] = {
                "tau": rep["overall"]["tau"], "outputs_match_ar": rep["overall"]["outputs_match_ar"],
                "per_category": {c: r["tau"] for c, r in rep["per_category"].items()},
                "n_items": rep["overall"].get("n_items"), "n_turns": rep["overall"].get("n_turns")}

    results["meta"] = {
        "command": "python " + " ".join([str(Path(sys.argv[0]).relative_to(ROOT)
                                             if Path(sys.argv[0]).resolve().is_relative_to(ROOT) else sys.argv[0]),
                                         *sys.argv[1:]]),
        "target": "tiny Qwen2-VL: data/tiny-llava's trained Llama LM moved into Qwen2VLForConditionalGeneration "
                  "(M-RoPE), random 2-layer vision tower, 36 image tokens (6x6 grid) per 48x48 image",
        "steps": {"stage1": args.steps1, "stage2": args.steps2}, "seed": args.seed,
        "bench": f"tiny, max_per_category={args.max_per_category}, greedy, max_new_tokens 64",
        "device": f"cpu ({platform.machine()}), OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(markdown(results))
    print((out / "results.md").read_text())


def markdown(r: dict) -> str:
    m = r["meta"]
    lines = ["# Draft positions on a tiny Qwen2-VL: `1d` vs `mrope`", "",
             f"Command: `{m['command']}` ({m['date']}, {m['device']}).", "",
             f"Target: {m['target']}. Steps: stage 1 {m['steps']['stage1']}, stage 2 {m['steps']['stage2']}, "
             f"seed {m['seed']}, both heads alike.", "",
             "## Simulated tau (held-out, end of each stage; 1 + sum of products of 5-step rollout agreements)", "",
             "| draft_positions | stage 1 text | stage 1 image | stage 2 text | stage 2 image | stage 2 image top-1 |",
             "|---|---|---|---|---|---|"]
    for conv, s in r["simulated"].items():
        a, b = s["stage1"], s["stage2"]
        lines.append(f"| {conv} | {a.get('text/sim_tau', float('nan')):.3f} | {a.get('mm/sim_tau', float('nan')):.3f} "
                     f"| {b.get('text/sim_tau', float('nan')):.3f} | {b.get('mm/sim_tau', float('nan')):.3f} "
                     f"| {b.get('mm/top1', float('nan')):.3f} |")
    lines += ["", f"## Decoder tau (`python eval.py`, {m['bench']}; tokens per target forward)", ""]
    cats = sorted({c for d in r["decoder"].values() for x in d.values() for c in x["per_category"]})
    lines += ["| draft_positions | method | overall | " + " | ".join(cats) + " | outputs equal plain decoding |",
              "|---|---|---|" + "---|" * len(cats) + "---|"]
    for conv, d in r["decoder"].items():
        for method, x in d.items():
            per = " | ".join(f"{x['per_category'].get(c, float('nan')):.3f}" for c in cats)
            lines.append(f"| {conv} | {method} | {x['tau']:.3f} | {per} | {x['outputs_match_ar']} |")
    lines += ["", "Wall seconds: " + ", ".join(f"{k} {v}" for k, v in r["wall_s"].items()), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
