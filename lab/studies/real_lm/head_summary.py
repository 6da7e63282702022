"""A committed head's entry of benchmarks/real_lm/summary.json (msd-stage2's by default; the dflash
head's with the second command below), from committed results only: the decoder on each CPU kind
(``results/any_cpu/summary.json``, ``lab/bench/any_cpu.sh``), the epochs it has trained and
held-out simulated tau against them (the metrics of the run that made it, ``results/rebuild/stage{1,2}/``), and the on-policy comparison (``results/on_policy/results.json``,
``lab/studies/on_policy.py``), and the head served by vLLM where ``results/served/`` holds its
reports (``scale_serve.sh``). Run after ``scale_summary`` (which rewrites the file from a WORK folder).

    python -m lab.studies.real_lm.head_summary [--head msd-stage2]
    python -m lab.studies.real_lm.head_summary --head dflash-stage2 --any-cpu blocks/head/text --plot none \
        --on-policy none --lineage blocks/metrics/dflash-s0/stage1:16:12234:0 blocks/metrics/dflash-s0-on/stage2:16:12234:7482

The lineage: FOLDER:CONVERSATIONS_PER_STEP:TEXT:IMAGES, oldest first (FOLDER under results/, holding
a stage's ``metrics.jsonl.gz``); TEXT and IMAGES are the
sizes of the splits that stage read (its launch log's "stage N data: ..." line), so that epochs
are passes over what each stage could draw from.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "benchmarks" / "real_lm" / "results"
LINEAGE = ["rebuild/stage1:16:12234:0", "rebuild/stage2:16:12234:7482"]  # experiment=smollm2_llava, stage 1 then 2
#: the CPU kinds ``lab/bench/any_cpu.sh`` measures: the machine as it is, and limited to AVX2
CPU_KINDS = ("native", "avx2")
OVERRIDES = {"chain1": ["decoding=chain", "decoding.k=1"], "tree_small": ["decoding=tree_small"], "tree": ["decoding=tree"],
             "block": ["decoding=block"]}


def rows(run: str) -> list[dict]:
    with gzip.open(RESULTS / run / "metrics.jsonl.gz", "rt") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _rounded(x: float | None) -> float | None:
    """None for a split the validation did not have (JSON has no NaN)."""
    return None if x is None else round(x, 4)


def tau_vs_epochs(lineage: list[str], table_from: str, head_step: int | None = None) -> tuple[list[dict], dict]:
    """Held-out simulated tau at each validation of the lineage's runs from ``table_from`` on (the
    runs validated on today's held-out splits), beside the epochs of text and images seen by then
    (the runs before them counted in full); and the epochs the head has seen: through step
    ``head_step`` of the last run (None: all of it), the run going on past the head."""
    seen = {"text": 0.0, "images": 0.0}
    head_epochs = None
    table = []
    runs = [spec.split(":")[0] for spec in lineage]
    if table_from not in runs:
        raise SystemExit(f"--table-from {table_from} is not in the lineage {runs}")
    for k, spec in enumerate(lineage):
        run, per_step, n_text, n_mm = spec.split(":")
        per_step, n_text, n_mm = int(per_step), int(n_text), int(n_mm)
        for r in rows(run):
            if k == len(lineage) - 1 and head_step is not None and r["step"] > head_step and head_epochs is None:
                head_epochs = dict(seen)
            if "mm_share" in r:  # a training step: its share of image conversations, as drawn
                mm = r["mm_share"] * per_step
                seen["text"] += (per_step - mm) / n_text
                seen["images"] += mm / n_mm if n_mm else 0.0
            elif k >= runs.index(table_from) and "val/text/sim_tau" in r:
                if table and table[-1]["run"] != run and r["step"] == 0:
                    continue  # a run's step-0 validation is the previous run's last head again
                table.append({"run": run, "step": r["step"], "epochs_text": round(seen["text"], 3),
                              "epochs_images": round(seen["images"], 3),
                              "sim_tau_text": round(r["val/text/sim_tau"], 4),
                              "sim_tau_images": _rounded(r.get("val/mm/sim_tau")),
                              "top1_text": round(r["val/text/top1"], 4), "top1_images": _rounded(r.get("val/mm/top1"))})
    return table, {key: round(v, 3) for key, v in (head_epochs or seen).items()}


def cpu_name(kind: str, forward: dict) -> str:
    """The CPU a kind's timings came from, as its ``forward.json`` recorded it: the model, the widest
    vector extension it has (``named_extensions``: AVX-512 BF16 where it has native bf16) and the
    threads; the AVX2 kind names the settings that limited it."""
    if kind == "avx2":
        env = " ".join(f"{k}={v}" for k, v in forward["env"].items() if v)
        return f"the same CPU limited to AVX2 ({env}): no native bf16"
    from msd_train.evaluation.cpu_setting import named_extensions

    widest = named_extensions(set(forward.get("cpu_flags", [])))[:1]
    model = forward["cpu"].split(" (")[0]  # newer records add family and extensions in brackets
    return ", ".join([model, *widest]) + f" ({forward['threads']} cores)"


def by_cpu(folder: str = "any_cpu") -> tuple[dict, dict, dict]:
    """Each CPU kind's settings in ``results/FOLDER`` (``any_cpu_table --copy``) and the fastest, under
    the name of the CPU they were timed on (``cpu_name``); and each kind's name."""
    summary = json.loads((RESULTS / folder / "summary.json").read_text())
    out, best, names = {}, {}, {}
    for kind, data in summary.items():
        if kind not in CPU_KINDS:
            continue
        settings = {}
        for name, s in data["settings"].items():
            reports = sorted((RESULTS / folder / kind).glob(f"{name}-r*/report.json"))
            accept = [json.loads(p.read_text())["overall"]["accept_at_pos"] for p in reports]
            settings[name] = {"overrides": OVERRIDES.get(name, [name]), "runs": s["runs"], "tau": s["tau"],
                              "speedup_over_plain": s["speedup"], "speedup_over_plain_range": s["speedup_range"],
                              "outputs_equal": s["outputs_equal"], "target_setting": s["target_setting"],
                              "accept_at_pos": [round(statistics.mean(a[i] for a in accept), 4) for i in range(len(accept[0]))]}
        name = names[kind] = cpu_name(kind, data["forward"])
        out[name] = settings
        best[name] = max(settings, key=lambda n: settings[n]["speedup_over_plain"])
    return out, best, names


def plot_tau_vs_epochs(table: list[dict], out: Path) -> None:
    """Held-out simulated tau against epochs of text seen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["epochs_text"] for r in table]
    ax.plot(xs, [r["sim_tau_text"] for r in table], "o-", ms=3, label="text (64 held-out conversations)")
    pts = [(r["epochs_text"], r["sim_tau_images"]) for r in table if r["sim_tau_images"] is not None]
    if pts:
        ax.plot(*zip(*pts), "s-", ms=3, label="images (64 held-out conversations)")
    ax.set_xlabel("epochs of the text split seen (all stages of the head's lineage)")
    ax.set_ylabel("held-out simulated tau (5-step rollout)")
    ax.set_title("msd head on SmolLM2-135M-LLaVA: tau vs epochs")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def served(head: str) -> dict:
    """The committed head served by vLLM (``results/served/NAME-rN/report.json``, ``scale_serve.sh``
    reports copied there; NAME is the head's name, with ``-float32`` for vLLM in fp32)."""
    from lab.studies.real_lm.scale_summary import served_summary

    reports: dict[str, list[dict]] = {}
    for rep in sorted((RESULTS / "served").glob(f"{head}*-r*/report.json")):
        name = re.sub(r"-r\d+$", "", rep.parent.name)
        if name in (head, f"{head}-float32"):
            reports.setdefault(name, []).append(json.loads(rep.read_text()))
    return served_summary(reports, [])


def on_policy(rel: str) -> dict | None:
    path = RESULTS / rel
    return json.loads(path.read_text()) if rel != "none" and path.is_file() else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", default="msd-stage2")
    ap.add_argument("--lineage", nargs="+", default=LINEAGE)
    ap.add_argument("--table-from", help="the first run validated on today's held-out splits (default: the lineage's first)")
    ap.add_argument("--any-cpu", default="any_cpu", help="the head's any_cpu_table copy under results/")
    ap.add_argument("--plot", default="rebuild/tau_vs_epochs.png", help="where under results/ tau against epochs is drawn (none: not)")
    ap.add_argument("--on-policy", default="on_policy/results.json", help="the head's on-policy study under results/ (none)")
    ap.add_argument("--head-step", type=int, help="the committed head's step in the lineage's last run (default: its end)")
    a = ap.parse_args()
    path = ROOT / "benchmarks" / "real_lm" / "summary.json"
    summary = json.loads(path.read_text())
    cpus, best, names = by_cpu(a.any_cpu)
    native = names["native"]
    table, epochs = tau_vs_epochs(a.lineage, a.table_from or a.lineage[0].split(":")[0], a.head_step)
    if a.plot != "none":
        plot_tau_vs_epochs(table, RESULTS / a.plot)
    summary["heads"][a.head] = {
        "setting": OVERRIDES[best[native]],
        "setting_by_cpu": {cpu: OVERRIDES[name] for cpu, name in best.items()},
        "measured": f"results/{a.any_cpu} (lab/bench/any_cpu.sh): 8 held-out ShareGPT prompts x 64 tokens, medians of 3",
        "by_cpu": cpus,
        "accept_at_pos": cpus[native].get("chain1", cpus[native][best[native]])["accept_at_pos"],
        "epochs": epochs,
        "lineage_step": {"run": a.lineage[-1].split(":")[0], "step": a.head_step},
        "tau_vs_epochs": table,
        "on_policy": on_policy(a.on_policy),
        "served": served(a.head),
    }
    own = summary["heads"][a.head]["served"].get(a.head)
    if own:  # the head served (bf16, as a user would): the headline, and what 'served' holds beside it
        summary["vllm_served_speedup"] = own["speedup"]
        summary["served_note"] = ("'served' holds the earlier heads scale_summary measured (benchmarks/real_lm/README.md, "
                                  f"msd3 section); heads.{a.head}.served is the committed head served, and "
                                  "'vllm_served_speedup' its bf16 median")
    path.write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary["heads"][a.head].items() if k not in ("by_cpu", "on_policy")}, indent=1))


if __name__ == "__main__":
    main()
