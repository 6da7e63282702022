#!/usr/bin/env python
"""Which draft-position convention gives the better Qwen2-VL head: ``draft_positions=1d`` or ``mrope``.

Builds a tiny Qwen2-VL target folder (``lab.targets.tiny_qwen``: the embedded tiny
LLaVA's trained language model in a Qwen2-VL with M-RoPE and a random vision tower), then
for each convention trains a head with the project's own commands, same seed and steps::

    python train.py stage=1 target.name_or_path=DIR draft.draft_positions=P run_dir=RUN/P ...
    python train.py stage=2 ...            (from RUN/P/stage1/final)

reads the held-out simulated tau of each stage from its ``metrics.jsonl``, and runs
``python eval.py`` on both stage-2 heads on the tiny benchmark (greedy; tree and chain) for
the decoder's tau per category and exactness against plain decoding. Writes
``OUT/results.json`` and ``OUT/results.md`` (with this command line).

    python -m lab.studies.draft_positions --steps1 150 --steps2 150 --seeds 0 1 --train eval.every=150
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

from lab.cli import at_least
from lab.targets.tiny_qwen import save_tiny_qwen2vl

ROOT = Path(__file__).resolve().parents[2]

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


def train_and_eval(args, run_dir: Path, seed: int, tgt: list[str], results: dict) -> None:
    """Both conventions for one seed: stage 1 + 2, then eval.py (tree and chain) on the stage-2 head."""
    py = sys.executable
    common = [*tgt, "data=tiny", f"data.cache_dir={run_dir / 'cache'}", f"seed={seed}",
              "logging.wandb.mode=disabled", "logging.progress=false", "resume=false", *args.train]
    for conv in CONVENTIONS:
        rd = run_dir / f"seed{seed}" / conv
        key = f"seed{seed} {conv}"
        for stage, steps in (("1", args.steps1), ("2", args.steps2)):
            if args.reuse and (rd / f"stage{stage}" / "final" / "config.json").is_file():
                continue
            results["wall_s"][f"{key} stage{stage}"] = round(run(
                [py, "train.py", f"stage={stage}", f"run_dir={rd}", f"draft.draft_positions={conv}",
                 f"train.max_steps={steps}", *common]), 1)
        results["simulated"][key] = {f"stage{s}": last_validation(rd / f"stage{s}" / "metrics.jsonl")
                                     for s in ("1", "2")}
        results["decoder"][key] = {}
        for method in METHODS:
            ev = rd / f"eval-{method}"
            if not (args.reuse and (ev / "report.json").is_file()):
                results["wall_s"][f"{key} eval {method}"] = round(run(
                    [py, "eval.py", f"draft={rd / 'stage2' / 'final'}", f"out={ev}", *tgt,
                     f"decoding={method}", "threads=1", "progress=false",
                     f"bench.max_per_category={args.max_per_category}", *args.eval]), 1)
            rep = json.loads((ev / "report.json").read_text())
            results["decoder"][key][method] = {
                "tau": rep["overall"]["tau"], "outputs_match_ar": rep["overall"]["outputs_match_ar"],
                "per_category": {c: r["tau"] for c, r in rep["per_category"].items()}}


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", default=str(ROOT / "runs" / "qwen_positions"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "qwen_positions"))
    ap.add_argument("--steps1", type=at_least(1), default=150, help="stage-1 optimizer steps")
    ap.add_argument("--steps2", type=at_least(1), default=150, help="stage-2 optimizer steps")
    ap.add_argument("--seeds", type=at_least(0), nargs="+", default=[0], help="training seeds (head init, data order)")
    ap.add_argument("--target-seed", type=at_least(0), default=0, help="seeds the target's random vision tower")
    ap.add_argument("--max-per-category", type=at_least(1), default=8, help="bench items per category for eval.py")
    ap.add_argument("--reuse", action="store_true",
                    help="keep stages and evals already finished under --run-dir (same arguments; runs are "
                         "deterministic) instead of running them again")
    ap.add_argument("--train", nargs="*", default=[], help="extra train.py overrides (both stages, both heads)")
    ap.add_argument("--eval", nargs="*", default=[], help="extra eval.py overrides")
    args = ap.parse_args()
    run_dir, out = Path(args.run_dir).resolve(), Path(args.out).resolve()

    target = run_dir / "target"
    if not (args.reuse and (target / "config.json").is_file()):
        save_tiny_qwen2vl(target, ROOT / "data" / "tiny-llava", seed=args.target_seed)
    tgt = [f"target.name_or_path={target}", "target.chat_template=chatml_qwen"]
    results: dict = {"simulated": {}, "decoder": {}, "wall_s": {}}
    for seed in args.seeds:
        train_and_eval(args, run_dir, seed, tgt, results)

    summary = {}
    for conv in CONVENTIONS:
        keys = [f"seed{s} {conv}" for s in args.seeds]
        sim = [results["simulated"][k]["stage2"] for k in keys]
        summary[conv] = {f"sim_tau_{m}": mean([x[f"{m}/sim_tau"] for x in sim]) for m in ("text", "mm")}
        for method in METHODS:
            dec = [results["decoder"][k][method] for k in keys]
            summary[conv][f"{method}_tau"] = mean([d["tau"] for d in dec])
            for cat in dec[0]["per_category"]:
                summary[conv][f"{method}_tau/{cat}"] = mean([d["per_category"][cat] for d in dec])
            summary[conv][f"{method}_outputs_match_ar"] = all(d["outputs_match_ar"] for d in dec)
    results["mean_over_seeds"] = summary
    results["meta"] = {
        "command": "python -m lab.studies.draft_positions " + shlex.join(sys.argv[1:]),
        "target": "tiny Qwen2-VL (lab/targets/tiny_qwen.py): data/tiny-llava's trained Llama LM (4 layers, "
                  "hidden 256) moved into Qwen2VLForConditionalGeneration with M-RoPE (section "
                  "[16, 8, 8]), random 2-layer vision tower; a 48x48 image is a 6x6 grid of 36 tokens",
        "steps": {"stage1": args.steps1, "stage2": args.steps2}, "seeds": args.seeds,
        "bench": f"tiny, max_per_category={args.max_per_category}, greedy, max_new_tokens 64",
        "device": f"cpu ({platform.machine()}), OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, "
                  "2 cores shared with other engineers' jobs (wall times are not comparable)",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(markdown(results))
    print((out / "results.md").read_text())


def markdown(r: dict) -> str:
    m, nan = r["meta"], float("nan")
    lines = ["# Draft positions on a tiny Qwen2-VL: `1d` vs `mrope`", "",
             f"Command: `{m['command']}` ({m['date']}; {m['device']}).", "",
             f"Target: {m['target']}. Each head: `python train.py stage=1` ({m['steps']['stage1']} steps) then "
             f"`stage=2` ({m['steps']['stage2']} steps), `data=tiny`, `draft.draft_positions=1d|mrope`; seeds "
             f"{m['seeds']}, both conventions alike. Stage 1 is text only, where M-RoPE's three rows are equal "
             "to the token index, so both conventions give the same stage-1 head.", "",
             "## Simulated tau (held-out, end of stage; 1 + sum of products of 5-step rollout agreements)", "",
             "| run | stage 1 text | stage 2 text | stage 2 image | stage 2 image top-1 |", "|---|---|---|---|---|"]
    for key, s in r["simulated"].items():
        a, b = s["stage1"], s["stage2"]
        lines.append(f"| {key} | {a.get('text/sim_tau', nan):.3f} | {b.get('text/sim_tau', nan):.3f} "
                     f"| {b.get('mm/sim_tau', nan):.3f} | {b.get('mm/top1', nan):.3f} |")
    for conv, x in r["mean_over_seeds"].items():
        lines.append(f"| **mean {conv}** | | {x['sim_tau_text']:.3f} | {x['sim_tau_mm']:.3f} | |")
    lines += ["", f"## Decoder tau (`python eval.py`, {m['bench']}; tokens per target forward)", ""]
    cats = sorted({c for d in r["decoder"].values() for x in d.values() for c in x["per_category"]})
    lines += ["| run | method | overall | " + " | ".join(cats) + " | outputs equal plain decoding |",
              "|---|---|---|" + "---|" * len(cats) + "---|"]
    for key, d in r["decoder"].items():
        for method, x in d.items():
            per = " | ".join(f"{x['per_category'].get(c, nan):.3f}" for c in cats)
            lines.append(f"| {key} | {method} | {x['tau']:.3f} | {per} | {x['outputs_match_ar']} |")
    for conv, x in r["mean_over_seeds"].items():
        for method in METHODS:
            per = " | ".join(f"{x.get(f'{method}_tau/{c}', nan):.3f}" for c in cats)
            lines.append(f"| **mean {conv}** | {method} | {x[f'{method}_tau']:.3f} | {per} "
                         f"| {x[f'{method}_outputs_match_ar']} |")
    lines += ["", "Wall seconds (shared machine): " + ", ".join(f"{k} {v}" for k, v in r["wall_s"].items()), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    from msd_train.errors import run_main

    run_main(main)  # a known failure (a missing path, a full disk, Ctrl-C): one line, exit non-zero
