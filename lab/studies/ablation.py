"""MSD's two claims, and the head architecture, on the embedded default, as a committed table.

    python -m lab.studies.ablation [--heads msd msd3] [--decoders tree chain] [--steps1 N] [--steps2 N]
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
`--jobs N` runs up to N trainings or evaluations at once, each as soon as what it starts from
is there (a stage 2 after its stage 1, an evaluation after its training).

`--seeds 0 1 2` repeats every training with each `seed=` (the head's initialisation and the
data order); seed 0 keeps the folders of a one-seed run (RUN_DIR/msd, ...), seed s > 0 uses
RUN_DIR/seed{s}/. The table gives each cell's mean over the seeds and, with more than one,
its sample standard deviation (mean ± sd); ablation.json keeps every seed's numbers.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from lab.cli import at_least

ROOT = Path(__file__).resolve().parents[2]


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "WANDB_MODE": "disabled"})


class Jobs:
    """Commands in chains (each command after the one before it in its chain), at most ``n``
    running at once, a free slot going to the waiting command of lowest priority (trainings
    before evaluations: the trainings are what the rest waits on); ``wait`` re-raises the
    first failure (its chain stops there)."""

    def __init__(self, n: int):
        self.free = max(1, n)
        self.cv = threading.Condition()
        self.waiting: list[tuple[int, int]] = []  # heap of (priority, arrival)
        self.arrivals = itertools.count()
        self.threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []

    def _run(self, cmd: list[str], priority: int) -> None:
        ticket = (priority, next(self.arrivals))
        with self.cv:
            heapq.heappush(self.waiting, ticket)
            self.cv.wait_for(lambda: self.free > 0 and self.waiting[0] == ticket)
            heapq.heappop(self.waiting)
            self.free -= 1
            self.cv.notify_all()
        try:
            run(cmd)
        finally:
            with self.cv:
                self.free += 1
                self.cv.notify_all()

    def chain(self, cmds: list[list[str]], then=None, priority: int = 0) -> None:
        """Run ``cmds`` one after another in the background, then call ``then()`` (which may add chains)."""
        def go():
            try:
                for cmd in cmds:
                    self._run(cmd, priority)
                if then is not None:
                    then()
            except BaseException as e:  # noqa: BLE001 (reported by wait)
                self.errors.append(e)
        t = threading.Thread(target=go)
        self.threads.append(t)
        t.start()

    def wait(self) -> None:
        while any(t.is_alive() for t in self.threads):
            for t in list(self.threads):
                t.join()
        if self.errors:
            raise self.errors[0]


def spread(values: list[float | None]) -> dict:
    """Mean, sample standard deviation (None for one value) and the values, over the seeds that have one."""
    vals = [v for v in values if v is not None]
    return {"mean": statistics.fmean(vals) if vals else None,
            "sd": statistics.stdev(vals) if len(vals) > 1 else None, "n": len(vals), "values": values}


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


def finished(stage_dir: Path) -> bool:
    """Whether a stage's training has finished (it writes ``final/`` at its end)."""
    return (stage_dir / "final" / "config.json").is_file()


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
    ap.add_argument("--steps1", type=at_least(1), default=None, help="stage-1 steps (default: the config's)")
    ap.add_argument("--steps2", type=at_least(1), default=None, help="stage-2 steps (default: the config's)")
    ap.add_argument("--jobs", type=at_least(1), default=1, help="independent runs at once")
    ap.add_argument("--seeds", nargs="+", type=at_least(0), default=[0], help="train every head with each seed")
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
    variants = {}  # name -> {seed: stage folder its head and metrics are in}
    evals = {}  # (name, decoder) -> {seed: evaluation folder}
    jobs = Jobs(args.jobs)
    for seed in args.seeds:
        root = run_dir if seed == 0 else run_dir / f"seed{seed}"
        seeded = [*common, f"seed={seed}"]
        for h in args.heads:
            reused = bool(args.reuse) and h == "msd" and seed == 0
            base = Path(args.reuse) if reused else root / h
            # "coupled" for msd keeps the folder earlier versions of this script trained.
            coupled = root / ("coupled" if h == "msd" else f"{h}-coupled")
            names = {f"{h} a: stage 1 only": base / "stage1", f"{h} b: stage 1 + 2 (decoupled)": base / "stage2",
                     f"{h} c: stage 1 + 2, decoupling off": coupled / "stage2"}
            ev = {}
            for name, stage_dir in names.items():
                variants.setdefault(name, {})[seed] = stage_dir
                for d in args.decoders:
                    out = root / "eval" / f"{name.split(':')[0].replace(' ', '-')}-{d}"
                    evals.setdefault((name, d), {})[seed] = out
                    if eval_done(out) is None:
                        ev.setdefault(name, []).append(
                            [py, "eval.py", f"draft={stage_dir / 'final'}", f"out={out}", f"decoding={d}",
                             "progress=false", *args.eval])
            if args.table_only:
                continue
            a, b, c = names
            # a stage with a final export has finished: not launched again (train.py would only say so)
            s2b = [] if reused or finished(base / "stage2") else [
                [py, "train.py", "stage=2", f"head={h}", f"run_dir={base}", *seeded, *s2]]
            s2c = [] if finished(coupled / "stage2") else [
                [py, "train.py", "stage=2", f"head={h}", f"run_dir={coupled}", "draft.decouple_visual=false",
                 f"stage.init_from={base / 'stage1' / 'final'}", *seeded, *s2]]

            def after_stage1(ev=ev, a=a, b=b, c=c, s2b=s2b, s2c=s2c):
                for cmd in ev.get(a, []):
                    jobs.chain([cmd], priority=1)
                jobs.chain(s2b, then=lambda: [jobs.chain([cmd], priority=1) for cmd in ev.get(b, [])])
                jobs.chain(s2c, then=lambda: [jobs.chain([cmd], priority=1) for cmd in ev.get(c, [])])
            jobs.chain([] if reused or finished(base / "stage1") else [[py, "train.py", "stage=1", f"head={h}", f"run_dir={base}", *seeded, *s1]],
                       then=after_stage1)
    jobs.wait()
    train_s = time.time() - t0
    rows, missing = {}, []
    decodings = {}
    for name, stages in variants.items():
        per_seed = {}
        for seed, stage_dir in stages.items():
            if not (stage_dir / "final").is_dir():
                missing.append(f"{name}, seed {seed}: training ({stage_dir} has no final export)")
            row = {"sim_tau_split": {}, "steps": None,
                   **(stage_stats(stage_dir) if (stage_dir / "metrics.jsonl").exists() else {})}
            for d in args.decoders:
                r = eval_done(evals[(name, d)][seed])
                if r is None:
                    missing.append(f"{name}, seed {seed}: {d} evaluation")
                    row[d] = None
                    continue
                decodings.setdefault(d, r["decoding"])
                decodings.setdefault("device", r["device"])
                row[d] = {"tau": r["overall"]["tau"], "accept_at_pos": r["overall"]["accept_at_pos"],
                          "per_category": {c: g["tau"] for c, g in r["per_category"].items()},
                          "outputs_match_ar": r["overall"].get("outputs_match_ar"), "n_turns": r["overall"]["n_turns"]}
            per_seed[seed] = row
        seeds = list(per_seed)
        got = lambda f, rs=[per_seed[s] for s in seeds]: spread([f(r) for r in rs])  # noqa: E731
        splits = sorted({k for r in per_seed.values() for k in r["sim_tau_split"]})
        agg = {"head": name.split()[0], "seeds": seeds, "steps": [per_seed[s]["steps"] for s in seeds],
               "s_per_step": got(lambda r: r.get("s_per_step")),
               "sim_tau": got(lambda r: r.get("sim_tau")),
               "sim_tau_split": {k: got(lambda r, k=k: r["sim_tau_split"].get(k)) for k in splits}}
        for d in args.decoders:
            done = [per_seed[s][d] for s in seeds if per_seed[s][d] is not None]
            cats = sorted({c for r in done for c in r["per_category"]})
            npos = max((len(r["accept_at_pos"]) for r in done), default=0)
            agg[d] = {"tau": got(lambda r, d=d: r[d] and r[d]["tau"]),
                      # position i's acceptance averages the seeds whose evaluation reached position i
                      "accept_at_pos": [got(lambda r, d=d, i=i, n=npos: r[d] and (r[d]["accept_at_pos"] + [None] * n)[i])
                                        for i in range(npos)],
                      "per_category": {c: got(lambda r, d=d, c=c: r[d] and r[d]["per_category"].get(c))
                                       for c in cats},
                      "outputs_match_ar": all(r["outputs_match_ar"] for r in done) if done else None,
                      "n_turns": [r["n_turns"] for r in done]}
        rows[name] = {**agg, "per_seed": {str(s): r for s, r in per_seed.items()}}
    cats = sorted({c for row in rows.values() for d in args.decoders for c in row[d]["per_category"]})
    splits = sorted({s for row in rows.values() for s in row["sim_tau_split"]})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(["python -m lab.studies.ablation", *sys.argv[1:]]), "train_wall_s": round(train_s, 1),
            "seeds": args.seeds, "decoding": {d: decodings.get(d) for d in args.decoders},
            "device": decodings.get("device", "-"), "date": time.strftime("%Y-%m-%d"), "missing": missing}
    (out / "ablation.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")

    def cell(x: dict | None) -> str:
        if x is None or x["mean"] is None:
            return "-"
        return f"{x['mean']:.3f}" + ("" if x["sd"] is None else f" ± {x['sd']:.3f}")
    n_seeds = len(args.seeds)
    lines = ["# Ablation on the embedded tiny target", "",
             f"Command: `{meta['command']}` ({meta['date']}, {meta['device']}"
             + ("" if args.table_only else f"; wall time of the training and evaluation {train_s / 60:.1f} min")
             + ").", "",
             "sim tau: held-out validation's 5-step self-rollout per held-out split, last validation of the stage "
             "(stage 1 validates on text only). tree / chain tau: tokens committed per target forward on the tiny "
             "benchmark, greedy. s/step: training seconds per optimizer step."
             + (f" Each cell: mean ± sample standard deviation over {n_seeds} seeds ({', '.join(map(str, args.seeds))})."
                if n_seeds > 1 else ""), "",
             "| head | steps | s/step | " + " | ".join(f"sim tau {s}" for s in splits) + " | "
             + " | ".join(f"{d} tau" for d in args.decoders)
             + "".join(f" | {d}: {c}" for d in args.decoders for c in cats) + " | matches AR |",
             "|---" * (3 + len(splits) + len(args.decoders) * (1 + len(cats)) + 1) + "|"]
    for name, row in rows.items():
        steps = sorted({s for s in row["steps"] if s is not None})
        lines.append(f"| {name} | {'/'.join(map(str, steps)) or '-'} | {cell(row['s_per_step'])} | "
                     + " | ".join(cell(row["sim_tau_split"].get(s)) for s in splits) + " | "
                     + " | ".join(cell(row[d]["tau"]) for d in args.decoders)
                     + "".join(f" | {cell(row[d]['per_category'].get(c))}" for d in args.decoders for c in cats)
                     + f" | {' / '.join(str(row[d]['outputs_match_ar']) for d in args.decoders)} |")
    lines += ["", "Per-position acceptance (P(position i accepted | earlier ones accepted), overall"
              + (", mean ± sd over the seeds whose evaluation reached position i" if n_seeds > 1 else "") + "):", "",
              "| head | decoder | " + " | ".join(f"pos {i}" for i in range(1, 7)) + " |", "|---" * 8 + "|"]
    for name, row in rows.items():
        for d in args.decoders:
            acc = (row[d]["accept_at_pos"] + [None] * 6)[:6]
            lines.append(f"| {name} | {d} | " + " | ".join(cell(a) for a in acc) + " |")
    if missing:
        lines += ["", "Missing (not run to the end in this invocation):", ""] + [f"- {m}" for m in missing]
    (out / "ablation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

if __name__ == "__main__":
    from msd_train.errors import run_main

    run_main(main)  # a known failure (a missing path, a full disk, Ctrl-C): one line, exit non-zero
