"""Block drafting against stepped heads on SmolLM2-LLaVA, at equal data: dflash, msd and msd3
trained by the product's recipe (``experiment=smollm2_llava``: the same conversations; msd and
dflash read one feature store, msd3 one of its own holding three layers' inputs, ``LAYER_STORES``) on a
shortened schedule, two seeds each; stage 1 (text only: decoupling does not enter) once per
head and seed, stage 2 from it twice, with MSD's visual decoupling on and off (``--visual``). Every launch
is a product command and resumes where it stopped; a finished stage is not run again.

    python -m lab.studies.real_lm.block_compare WORK OUT [--s1 400] [--s2 300] [--heads dflash msd msd3] [--visual on off] [--decode [--repeats 3]]
    python -m lab.studies.real_lm.block_compare WORK OUT --table        # the summary as a Markdown table
    python -m lab.studies.real_lm.block_compare WORK OUT --copy DEST    # what the repository keeps

WORK is the experiment's work folder (its store and splits: docs/recipes.md), OUT the runs
and ``summary.json``: each arm's held-out validation at the end of each stage and its
training time (the launches' wall seconds, and the seconds of its optimizer steps alone: the
equal-CPU-time measure, without start-ups and validation). The dflash arms read the target's last
output (``draft.feature_layers=[30]``), what the msd store holds. ``--decode``: each stage-2 head decodes the held-out bench prompts
(``WORK/splits/bench_text.jsonl`` and ``bench_images.jsonl``, 8 each, 64 new tokens, 2 threads)
beside plain decoding, in its CPU setting (``DECODING``), ``--repeats`` times; ``eval.py``'s report per
arm, bench and run under ``OUT/decode/``, its tau, median speedup (and each run's), exactness and
acceptance per position in the summary.
``--copy DEST``: the summary and the decode reports into DEST with WORK and OUT written so and
the checkout's files relative (refused, before writing, if a path of this machine is left), and
each stage's ``metrics.jsonl`` gzipped (``metrics/ARM/stageN/metrics.jsonl.gz``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from lab.portable import machine_paths, portable
from msd_train.evaluation.cpu_setting import cpu_identity
from msd_train.evaluation.run import described_cpu

ROOT = Path(__file__).resolve().parents[3]
#: each head's overrides of the recipe; msd3 trains over its own draft vocabulary of the recipe's
#: size and unrolls 3 TTT steps (the committed msd3-stage2 head's CPU setting)
HEADS = {"msd": [], "msd3": ["head=msd3", "draft.train_vocab=null", "draft.draft_vocab_size=8192", "draft.ttt_steps=3"],
         "dflash": ["head=dflash", "draft.feature_layers=[30]"]}
#: heads that read a store of their own under WORK rather than the recipe's ``store``: its folder
#: and the target layers whose inputs it holds (msd3 reads three)
LAYER_STORES = {"msd3": ("store-msd3", "[2,15,27]")}
#: each head in the setting it decodes fastest in on a CPU (docs/decoding.md)
DECODING = {"msd": ["decoding=tree_small"], "msd3": ["decoding=tree_small"], "dflash": ["decoding=block"]}
BENCHES = {"text": "bench_text.jsonl", "images": "bench_images.jsonl"}


def store_of(work: Path, head: str) -> tuple[Path, str | None]:
    """The feature store a head's arms read under WORK, and the target layers whose inputs it holds
    (None: the recipe's ``store``)."""
    folder, layers = LAYER_STORES.get(head, ("store", None))
    return work / folder, layers


def launch(args: list[str], log: Path, entry: dict, key: str, save) -> None:
    """One ``train.py`` launch, its wall seconds added to ``entry[key]`` and saved (``save()``) also
    when it stops early (a SIGTERM saves a checkpoint and exits 1: the relaunch resumes, and the
    stage's seconds are the sum over its launches)."""
    machines, here = entry.setdefault("trained_on", []), cpu_identity()
    if here not in machines:  # a stage resumed on another machine trained on both
        machines.append(here)
    t = time.perf_counter()
    with log.open("a") as fh:
        code = subprocess.call([sys.executable, "train.py", *args, "logging.progress=false"], cwd=ROOT,
                               stdout=fh, stderr=subprocess.STDOUT)
    entry[key] = entry.get(key, 0.0) + time.perf_counter() - t
    save()
    if code:
        raise SystemExit(f"block_compare: train.py {' '.join(args)} stopped ({code}); see {log}. "
                         "The same command resumes it.")


def last_validation(stage_dir: Path) -> dict:
    rows = [json.loads(line) for line in (stage_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    val = [r for r in rows if "val/sim_tau" in r]
    return {k: v for k, v in val[-1].items() if k == "step" or k.startswith("val/")} if val else {}


def step_seconds(stage_dir: Path) -> float:
    """The seconds the stage's optimizer steps took (tokens / tokens_per_s of each logged step; a step
    logged again after a resume counted once): training compute without start-up and validation."""
    steps = {}
    for line in (stage_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line) if line.strip() else {}
        if r.get("tokens_per_s"):
            steps[r["step"]] = r["tokens"] / r["tokens_per_s"]
    return sum(steps.values())


def decode(work: Path, out: Path, arm: str, head: str, head_dir: Path, repeats: int = 1) -> dict:
    """The arm's head on each bench beside plain decoding, ``repeats`` times (``OUT/decode/ARM-BENCH``,
    then ``-r2``, ``-r3``...; a finished report is not run again): the first run's tau, acceptance
    and exactness, the median speedup, every run's speedup, and exactness over all runs."""
    results = {}
    for bench, name in BENCHES.items():
        runs, devices = [], []
        for r in range(1, repeats + 1):
            dest = out / "decode" / (f"{arm}-{bench}" + (f"-r{r}" if r > 1 else ""))
            if not (dest / "report.json").is_file():
                cmd = [sys.executable, "eval.py", "target=smollm2_llava", f"draft={head_dir}", *DECODING[head], "bench=jsonl",
                       f"bench.path={work / 'splits' / name}", "bench.max_samples=8", "decoding.max_new_tokens=64",
                       "threads=2", "progress=false", f"out={dest}"]
                log = dest.parent / f"{dest.name}.log"
                log.parent.mkdir(parents=True, exist_ok=True)
                with log.open("w") as fh:
                    if subprocess.call(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT):
                        raise SystemExit(f"block_compare: {' '.join(cmd)} failed; see {log}")
            report = json.loads((dest / "report.json").read_text())
            runs.append(report["overall"])
            devices.append(report.get("device"))
        speedups = [o["speedup"] for o in runs]
        results[bench] = {**{k: runs[0][k] for k in ("tau", "accept_at_pos")},
                          "speedup": statistics.median(speedups), "speedups": speedups,
                          "outputs_match_ar": all(o["outputs_match_ar"] for o in runs), "devices": devices}
    return results


def _cell(v, fmt="{:.3f}") -> str:
    return "-" if v is None else fmt.format(v)


def _acceptance(per_position) -> str:
    """The decoder's acceptance at the first three draft positions (of the drafts that reach each)."""
    return "-" if not per_position else " ".join(f"{a:.2f}" for a in per_position[:3])


def _speedup(bench: dict) -> str:
    """The median speedup, with the range over the runs when there were several."""
    runs = bench.get("speedups") or []
    cell = _cell(bench.get("speedup"), "{:.2f}x")
    return f"{cell} ({min(runs):.2f}-{max(runs):.2f})" if len(runs) > 1 else cell


def _devices(out: Path | None, arm: str, d: dict) -> list[str]:
    """The CPUs an arm's decodes ran on (each report's ``device``, ``cpu (CPU, N threads)``), from its
    summary or, for a summary written before it recorded them, from the reports under ``OUT/decode``."""
    devices = [x for b in BENCHES for x in d.get(b, {}).get("devices") or []]
    if not devices and out is not None:
        for b in BENCHES:  # decode()'s folders: ARM-BENCH, then ARM-BENCH-r2, -r3...
            for report in [out / "decode" / f"{arm}-{b}" / "report.json",
                           *sorted((out / "decode").glob(f"{arm}-{b}-r*/report.json"))]:
                if report.is_file():
                    devices.append(json.loads(report.read_text()).get("device"))
    return [described_cpu(x) or x for x in dict.fromkeys(devices) if x]


def _short(identity: str) -> str:
    """A CPU's name for a table cell: its model name without trademarks and its family / model
    (``AMD EPYC 25/17`` for ``cpu_identity``'s ``AMD EPYC (family 25, model 17, stepping 1; ...)``)."""
    m = re.match(r"(.*?) \(family (\d+), model (\d+)", identity)
    if not m:
        return identity
    name = re.sub(r"\((R|TM)\)| Processor| CPU", "", m.group(1)).strip()
    return f"{name} {m.group(2)}/{m.group(3)}"


def table(summary: dict, out: Path | None = None) -> str:
    """The stage-2 arms: held-out simulated tau and first-position agreement (text, images), the
    seconds of both stages' optimizer steps (``step_seconds``), decoded tau, acceptance at the first
    three positions and speedup per bench, whether outputs equal plain decoding, and the CPUs the arm
    trained (where recorded) and decoded on, each named in full under the table (step seconds and
    speedups hold on theirs)."""
    rows = ["| head | seed | visual path | sim tau text | sim tau images | agree@1 text | agree@1 images | "
            "step s | tau text | acceptance text | speedup text | tau images | acceptance images | speedup images "
            "| outputs = plain | CPU |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    machines: dict[str, str] = {}
    for arm, e in sorted(summary.items()):
        if "decouple_visual" not in e:  # a stage-1 entry: its seconds count in its stage-2 arms
            continue
        v = e.get("stage2", {})
        s1 = summary.get(f"{e['head']}-s{e['seed']}", {}).get("stage1_step_seconds")
        seconds = None if s1 is None or "stage2_step_seconds" not in e else s1 + e["stage2_step_seconds"]
        d = e.get("decode", {})
        exact = [d[b]["outputs_match_ar"] for b in BENCHES if b in d]
        trained = [*summary.get(f"{e['head']}-s{e['seed']}", {}).get("trained_on", []), *e.get("trained_on", [])]
        cpus = [machines.setdefault(x, _short(x)) for x in dict.fromkeys([*trained, *_devices(out, arm, d)])]
        rows.append("| " + " | ".join([
            e["head"], str(e["seed"]), "decoupled" if e["decouple_visual"] else "shared",
            _cell(v.get("val/text/sim_tau")), _cell(v.get("val/mm/sim_tau")),
            _cell(v.get("val/text/agree_cond_1")), _cell(v.get("val/mm/agree_cond_1")),
            _cell(seconds, "{:.0f}"),
            *(cell for b in BENCHES for cell in (
                _cell(d.get(b, {}).get("tau")), _acceptance(d.get(b, {}).get("accept_at_pos")),
                _speedup(d.get(b, {})))),
            ("yes" if all(exact) else "no") if exact else "-", ", ".join(cpus) or "-"]) + " |")
    legend = [f"- {short}: {device}" for device, short in machines.items()]  # a list: one line each in Markdown
    return "\n".join(rows) + "\n" + ("\n" + "\n".join(legend) + "\n" if legend else "")


def copy(work: Path, out: Path, dest: Path) -> list[Path]:
    """``OUT/summary.json`` and every ``OUT/decode/*/report.json`` into ``dest`` without this
    machine's paths (nothing is written while one is left: named), and every finished stage's metrics."""
    files = {Path("summary.json"): out / "summary.json",
             **{r.relative_to(out): r for r in sorted(out.glob("decode/*/report.json"))}}
    copies = {rel: portable(json.loads(src.read_text()), {work: "WORK", out: "OUT"}) for rel, src in files.items()}
    left = [p for rel, c in copies.items() for p in machine_paths(c, str(rel))]
    if left:
        raise SystemExit(f"block_compare: paths of this machine left after the rewrite: {'; '.join(left[:5])}")
    for rel, c in copies.items():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_text(json.dumps(c, indent=1) + "\n")
    metrics = []
    for m in sorted(out.glob("runs/*/stage*/metrics.jsonl")):  # each finished stage's curve, gzipped
        if not (m.parent / "final" / "config.json").is_file():
            continue  # still training: copied once it has finished
        gz = dest / "metrics" / m.parent.parent.name / m.parent.name / "metrics.jsonl.gz"  # (runs/ is git-ignored)
        gz.parent.mkdir(parents=True, exist_ok=True)
        gz.write_bytes(gzip.compress(m.read_bytes(), mtime=0))
        metrics.append(gz)
    return [*(dest / rel for rel in copies), *metrics]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("work", type=Path, help="the experiment's work folder (store, splits)")
    p.add_argument("out", type=Path, help="where the runs and summary.json go")
    p.add_argument("--s1", type=int, default=400, help="stage-1 steps (16 conversations each)")
    p.add_argument("--s2", type=int, default=300, help="stage-2 steps (image share ramped 0 -> 0.5 over half)")
    p.add_argument("--heads", nargs="+", default=list(HEADS), choices=list(HEADS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--visual", nargs="+", default=["on", "off"], choices=["on", "off"],
                   help="the stage-2 arms: decoupled visual path (on), shared (off)")
    p.add_argument("--decode", action="store_true", help="decode the bench prompts with each stage-2 head")
    p.add_argument("--repeats", type=int, default=1, help="decode runs per arm and bench (the median speedup)")
    p.add_argument("--table", action="store_true", help="print OUT/summary.json as a Markdown table and stop")
    p.add_argument("--copy", type=Path, metavar="DEST", help="copy the summary and decode reports, paths masked, and stop")
    a = p.parse_args(argv)
    if a.table or a.copy:
        if not (a.out / "summary.json").is_file():
            raise SystemExit(f"block_compare: no {a.out / 'summary.json'} yet; run the comparison first")
        if a.copy:
            print(f"block_compare: {len(copy(a.work, a.out, a.copy))} files into {a.copy}")
        else:
            print(table(json.loads((a.out / "summary.json").read_text()), a.out), end="")
        return
    for head in a.heads:
        store, layers = store_of(a.work, head)
        if not (store / "manifest.json").is_file():
            own = f" features.path={store} 'features.layers={layers}'" if layers else ""
            raise SystemExit(f"block_compare: no feature store in {store} for the {head} arms; make it first "
                             f"(python scripts/generate_features.py experiment=smollm2_llava recipe.work={a.work} "
                             f"target.dtype=bf16{own})")
    a.out.mkdir(parents=True, exist_ok=True)
    summary_path = a.out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}

    def save() -> None:
        summary_path.write_text(json.dumps(summary, indent=1) + "\n")

    base = ["experiment=smollm2_llava", f"recipe.work={a.work}",
            f"recipe.stages.1.max_steps={a.s1}", f"recipe.stages.1.every={a.s1}",
            f"recipe.stages.2.max_steps={a.s2}", f"recipe.stages.2.every={a.s2}",
            f"recipe.stages.2.curriculum.ramp_steps={max(a.s2 // 2, 1)}"]
    for head in a.heads:
        store, layers = store_of(a.work, head)
        overrides = [*HEADS[head], *([f"features.path={store}"] if layers else [])]
        for seed in a.seeds:
            run = a.out / "runs" / f"{head}-s{seed}"
            arm = summary.setdefault(f"{head}-s{seed}", {"head": head, "seed": seed})
            if not (run / "stage1" / "final" / "config.json").is_file():
                launch([*base, *overrides, "stage=1", f"seed={seed}", f"run_dir={run}"], a.out / f"{head}-s{seed}.log",
                       arm, "stage1_seconds", save)
            arm["stage1"] = last_validation(run / "stage1")
            arm["stage1_step_seconds"] = round(step_seconds(run / "stage1"), 1)
            for visual in a.visual:
                decouple = "true" if visual == "on" else "false"
                name = f"{head}-s{seed}-{visual}"
                two = a.out / "runs" / name
                entry = summary.setdefault(name, {"head": head, "seed": seed, "decouple_visual": decouple == "true"})
                if not (two / "stage2" / "final" / "config.json").is_file():
                    launch([*base, *overrides, "stage=2", f"seed={seed}", f"run_dir={two}",
                            f"stage.init_from={run / 'stage1' / 'final'}", f"draft.decouple_visual={decouple}"],
                           a.out / f"{name}.log", entry, "stage2_seconds", save)
                entry["stage2"] = last_validation(two / "stage2")
                entry["stage2_step_seconds"] = round(step_seconds(two / "stage2"), 1)
                entry["head_dir"] = os.path.relpath(two / "stage2" / "final", a.out)
                if a.decode:
                    entry["decode"] = decode(a.work, a.out, name, head, two / "stage2" / "final", a.repeats)
                save()
    save()
    print(json.dumps({k: {s: v.get(s, {}).get("val/sim_tau") for s in ("stage1", "stage2")} for k, v in summary.items()},
                     indent=1))


if __name__ == "__main__":
    main()
