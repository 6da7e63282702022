"""MSD's two claims on the embedded default, as a committed table.

    python scripts/ablation.py [--steps1 N] [--steps2 N] [--out benchmarks/ablation]

Trains, on the tiny target, (a) a stage-1-only head, (b) the stage-1 + stage-2 head, and
(c) a stage-1 + stage-2 head with decoupling off (same stage-1 start, same stage-2 data
and steps; only `draft.decouple_visual` differs), then evaluates each with the tree
decoder on the tiny benchmark. MSD predicts b > a (stage 2 teaches visual perception) and
b > c (visual tokens are better fed raw) on image prompts. Writes ablation.json and
ablation.md with whatever comes out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "WANDB_MODE": "disabled"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", default=str(ROOT / "runs" / "ablation"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "ablation"))
    ap.add_argument("--steps1", type=int, default=None, help="stage-1 steps (default: the config's)")
    ap.add_argument("--steps2", type=int, default=None, help="stage-2 steps (default: the config's)")
    ap.add_argument("--eval", nargs="*", default=[], help="extra eval.py overrides")
    ap.add_argument("--reuse", default=None,
                    help="a finished default run (e.g. runs/tiny): take heads a and b from it, train only c")
    args = ap.parse_args()
    run_dir = Path(args.run_dir)
    py = sys.executable
    common = ["logging.wandb.mode=disabled", "logging.progress=false"]
    s1 = [f"train.max_steps={args.steps1}"] if args.steps1 else []
    s2 = [f"train.max_steps={args.steps2}"] if args.steps2 else []
    t0 = time.time()
    msd = Path(args.reuse) if args.reuse else run_dir / "msd"
    if not args.reuse:
        run([py, "train.py", "stage=1", f"run_dir={msd}", *common, *s1])
        run([py, "train.py", "stage=2", f"run_dir={msd}", *common, *s2])
    run([py, "train.py", "stage=2", f"run_dir={run_dir / 'coupled'}", "draft.decouple_visual=false",
         f"stage.init_from={msd / 'stage1' / 'final'}", *common, *s2])
    train_s = time.time() - t0
    heads = {"a: stage 1 only": msd / "stage1" / "final",
             "b: stage 1 + 2 (MSD)": msd / "stage2" / "final",
             "c: stage 1 + 2, decoupling off": run_dir / "coupled" / "stage2" / "final"}
    reports = {}
    for name, head in heads.items():
        out = run_dir / "eval" / name[0]
        run([py, "eval.py", f"draft={head}", f"out={out}", *args.eval])
        reports[name] = json.loads((out / "report.json").read_text())
    cats = sorted({c for r in reports.values() for c in r["per_category"]})
    table = {name: {"overall": r["overall"]["tau"], **{c: r["per_category"][c]["tau"] for c in r["per_category"]},
                    "outputs_match_ar": r["overall"].get("outputs_match_ar")} for name, r in reports.items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join([Path(py).name, *sys.argv]), "train_wall_s": round(train_s, 1),
            "decoding": next(iter(reports.values()))["decoding"], "device": next(iter(reports.values()))["device"],
            "date": time.strftime("%Y-%m-%d")}
    (out / "ablation.json").write_text(json.dumps({"meta": meta, "tau": table}, indent=1) + "\n")
    lines = ["# MSD ablation on the embedded tiny target", "",
             f"Command: `{meta['command']}` ({meta['date']}, {meta['device']}; training {train_s / 60:.1f} min).",
             "tau = tokens committed per target forward (tree decoding, greedy), per benchmark category.", "",
             "| head | overall | " + " | ".join(cats) + " | matches AR |", "|---" * (len(cats) + 3) + "|"]
    for name, row in table.items():
        lines.append(f"| {name} | {row['overall']:.3f} | " + " | ".join(f"{row.get(c, float('nan')):.3f}" for c in cats)
                     + f" | {row['outputs_match_ar']} |")
    (out / "ablation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
