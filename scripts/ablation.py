"""MSD's two claims, and the head architecture, on the embedded default, as a committed table.

    python scripts/ablation.py [--heads msd msd3] [--decoders tree chain] [--steps1 N] [--steps2 N]
                               [--jobs N] [--train OVERRIDE ...] [--eval OVERRIDE ...] [--out DIR]

For each head architecture (`head=msd`, the EAGLE-2-style MSD head; `head=msd3`, EAGLE-3's
head with MSD's decoupled visual tokens) trains, on the tiny target, (a) a stage-1-only head,
(b) the stage-1 + stage-2 head, and (c) a stage-1 + stage-2 head with decoupling off (same
stage-1 start, same stage-2 data and steps; only `draft.decouple_visual` differs: stage 1 is
text-only, so decoupling cannot matter there and its run is shared), then evaluates each with
every decoder asked for (tree: EAGLE-2 dynamic tree; chain: k draft tokens per verification)
on the tiny benchmark. MSD predicts b > a (stage 2 teaches visual perception) and b > c
(visual tokens are better fed raw) on image prompts; EAGLE-3 predicts msd3 > msd.

Per head it reports the simulated tau (the held-out validation's k-step self-rollout, last
validation of the stage, from metrics.jsonl), the decoder tau overall and per benchmark
category, the per-position acceptance (eval.py's report.json), and training seconds per
optimizer step (from metrics.jsonl: the run's tokens over its running tokens/s, so the
start-up and export are not counted; under a shared CPU it measures the load as much as the
head). Writes ablation.json and ablation.md with whatever comes out.

Runs are reused: training resumes (`resume=auto`) and a finished stage is not trained again,
an evaluation whose report.json exists and is complete is read rather than repeated, and
`--reuse DIR` takes the msd head's stage 1 and 2 from a finished default run (e.g. runs/tiny).
`--jobs N` runs up to N independent trainings or evaluations at once (stage 1s, then stage
2s, then evaluations).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "WANDB_MODE": "disabled"})


def run_all(cmds: list[list[str]], jobs: int) -> None:
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        list(pool.map(run, cmds))  # list(): re-raises the first failure


def stage_stats(stage_dir: Path) -> dict:
    """Simulated tau (last held-out validation) and seconds per step from a stage's metrics.jsonl."""
    rows = [json.loads(line) for line in (stage_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    val = [r for r in rows if "val/sim_tau" in r]
    train = [r for r in rows if "tokens_per_s" in r]
    out = {"steps": train[-1]["step"] if train else None, "sim_tau": val[-1]["val/sim_tau"] if val else None,
           "sim_tau_split": {k.split("/")[1]: v for k, v in (val[-1] if val else {}).items()
                             if k.startswith("val/") and k.endswith("/sim_tau") and k.count("/") == 2}}
    # tokens_per_s is running (tokens since the launch / seconds since the launch); a resumed
    # run restarts it, so only the rows after the last restart are summed.
    start = max((i for i, r in enumerate(train) if i == 0 or r["step"] != train[i - 1]["step"] + 1), default=0)
    seg = train[start:]
    if seg and seg[-1]["tokens_per_s"]:
        out["s_per_step"] = sum(r["tokens"] for r in seg) / seg[-1]["tokens_per_s"] / len(seg)
    return out


def eval_done(out: Path) -> dict | None:
    f = out / "report.json"
    if not f.exists():
        return None
    r = json.loads(f.read_text())
    return None if r.get("interrupted") else r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", default=str(ROOT / "runs" / "ablation"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "ablation"))
    ap.add_argument("--heads", nargs="+", default=["msd"], choices=["msd", "msd3"], help="head architectures")
    ap.add_argument("--decoders", nargs="+", default=["tree"], choices=["tree", "chain"])
    ap.add_argument("--steps1", type=int, default=None, help="stage-1 steps (default: the config's)")
    ap.add_argument("--steps2", type=int, default=None, help="stage-2 steps (default: the config's)")
    ap.add_argument("--jobs", type=int, default=1, help="independent runs at once")
    ap.add_argument("--train", nargs="*", default=[], help="extra train.py overrides, every stage")
    ap.add_argument("--eval", nargs="*", default=[], help="extra eval.py overrides (e.g. bench.max_per_category=4)")
    ap.add_argument("--reuse", default=None,
                    help="a finished default run (e.g. runs/tiny): take the msd head's a and b from it")
    ap.add_argument("--table-only", action="store_true",
                    help="train and evaluate nothing: write the table from the runs and evaluations there are, "
                         "listing what is missing")
    args = ap.parse_args()
    run_dir = Path(args.run_dir)
    py = sys.executable
    common = ["logging.wandb.mode=disabled", "logging.progress=false", *args.train]
    s1 = [f"train.max_steps={args.steps1}"] if args.steps1 else []
    # A shorter stage 2 keeps the config's curriculum shape: the multimodal share ramps over
    # its first half (75 of 150 steps by default), not over more steps than the stage has.
    s2 = [f"train.max_steps={args.steps2}", f"stage.curriculum.ramp_steps={args.steps2 // 2}"] if args.steps2 else []
    t0 = time.time()
    base = {h: Path(args.reuse) if args.reuse and h == "msd" else run_dir / h for h in args.heads}
    # "coupled" for msd keeps the folder earlier versions of this script trained.
    coupled = {h: run_dir / ("coupled" if h == "msd" else f"{h}-coupled") for h in args.heads}
    fresh = [h for h in args.heads if not (args.reuse and h == "msd")]
    train = (lambda cmds, jobs: None) if args.table_only else run_all
    train([[py, "train.py", "stage=1", f"head={h}", f"run_dir={base[h]}", *common, *s1] for h in fresh], args.jobs)
    train([[py, "train.py", "stage=2", f"head={h}", f"run_dir={base[h]}", *common, *s2] for h in fresh]
            + [[py, "train.py", "stage=2", f"head={h}", f"run_dir={coupled[h]}", "draft.decouple_visual=false",
                f"stage.init_from={base[h] / 'stage1' / 'final'}", *common, *s2] for h in args.heads], args.jobs)
    train_s = time.time() - t0
    variants = {}  # name -> (head folder, stage folder its metrics are in)
    for h in args.heads:
        variants[f"{h} a: stage 1 only"] = base[h] / "stage1"
        variants[f"{h} b: stage 1 + 2 (decoupled)"] = base[h] / "stage2"
        variants[f"{h} c: stage 1 + 2, decoupling off"] = coupled[h] / "stage2"
    evals = {(name, d): run_dir / "eval" / f"{name.split(':')[0].replace(' ', '-')}-{d}"
             for name in variants for d in args.decoders}
    train([[py, "eval.py", f"draft={variants[name] / 'final'}", f"out={out}", f"decoding={d}", "progress=false",
              *args.eval] for (name, d), out in evals.items() if eval_done(out) is None], args.jobs)
    reports = {key: eval_done(out) for key, out in evals.items()}
    rows, missing = {}, []
    for name, stage_dir in variants.items():
        if not (stage_dir / "final").is_dir():
            missing.append(f"{name}: training ({stage_dir} has no final export)")
        row = {"head": name.split()[0], "sim_tau_split": {}, "steps": None,
               **(stage_stats(stage_dir) if (stage_dir / "metrics.jsonl").exists() else {})}
        for d in args.decoders:
            r = reports[(name, d)]
            if r is None:
                missing.append(f"{name}: {d} evaluation")
                row[d] = {"tau": None, "accept_at_pos": [], "per_category": {}, "outputs_match_ar": None}
                continue
            row[d] = {"tau": r["overall"]["tau"], "accept_at_pos": r["overall"]["accept_at_pos"],
                      "per_category": {c: g["tau"] for c, g in r["per_category"].items()},
                      "outputs_match_ar": r["overall"].get("outputs_match_ar"), "n_turns": r["overall"]["n_turns"]}
        rows[name] = row
    done = [r for r in reports.values() if r is not None]
    cats = sorted({c for r in done for c in r["per_category"]})
    splits = sorted({s for row in rows.values() for s in row["sim_tau_split"]})
    first = done[0] if done else {"device": "-"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join([Path(py).name, *sys.argv]), "train_wall_s": round(train_s, 1),
            "decoding": {d: next((r["decoding"] for (_, e), r in reports.items() if e == d and r), None)
                         for d in args.decoders},
            "device": first["device"], "date": time.strftime("%Y-%m-%d"), "missing": missing}
    (out / "ablation.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    f3 = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    lines = ["# Ablation on the embedded tiny target", "",
             f"Command: `{meta['command']}` ({meta['date']}, {meta['device']}"
             + ("" if args.table_only else f"; wall time of the training phase {train_s / 60:.1f} min") + ").", "",
             "sim tau: held-out validation's 5-step self-rollout per held-out split, last validation of the stage "
             "(stage 1 validates on text only). tree / chain tau: tokens committed per target forward on the tiny "
             "benchmark, greedy. s/step: training seconds per optimizer step.", "",
             "| head | steps | s/step | " + " | ".join(f"sim tau {s}" for s in splits) + " | "
             + " | ".join(f"{d} tau" for d in args.decoders)
             + "".join(f" | {d}: {c}" for d in args.decoders for c in cats) + " | matches AR |",
             "|---" * (3 + len(splits) + len(args.decoders) * (1 + len(cats)) + 1) + "|"]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['steps']} | {f3(row.get('s_per_step'))} | "
                     + " | ".join(f3(row["sim_tau_split"].get(s)) for s in splits) + " | "
                     + " | ".join(f3(row[d]["tau"]) for d in args.decoders)
                     + "".join(f" | {f3(row[d]['per_category'].get(c))}" for d in args.decoders for c in cats)
                     + f" | {' / '.join(str(row[d]['outputs_match_ar']) for d in args.decoders)} |")
    lines += ["", "Per-position acceptance (P(position i accepted | earlier ones accepted), overall):", "",
              "| head | decoder | " + " | ".join(f"pos {i}" for i in range(1, 7)) + " |", "|---" * 8 + "|"]
    for name, row in rows.items():
        for d in args.decoders:
            acc = (row[d]["accept_at_pos"] + [None] * 6)[:6]
            lines.append(f"| {name} | {d} | " + " | ".join(f3(a) for a in acc) + " |")
    if missing:
        lines += ["", "Missing (not run to the end in this invocation):", ""] + [f"- {m}" for m in missing]
    (out / "ablation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
