"""Summarise lab/studies/sampling_rank.sh's eval reports: tau of tree sampling ranked by warped vs raw
log-probabilities, per decoding seed, with mean and spread.

    python -m lab.studies.sampling_rank /tmp/rank_by benchmarks/sampling_rank/tiny-temp07
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

parser = argparse.ArgumentParser(description="Summarise lab/studies/sampling_rank.sh's eval reports.")
parser.add_argument("root", type=Path, help="the folder sampling_rank.sh wrote (OUT=, e.g. /tmp/rank_by)")
parser.add_argument("stem", type=Path, help="where the table goes, without suffix (STEM.json; the Markdown is printed)")
args = parser.parse_args()
root, stem = args.root, args.stem
runs: dict[str, dict[int, dict]] = {}
for report in sorted(root.glob("*-s*/report.json")):
    rank, seed = report.parent.name.rsplit("-s", 1)
    r = json.loads(report.read_text())
    runs.setdefault(rank, {})[int(seed)] = {
        "tau": r["overall"]["tau"],
        "tau_per_category": {c: v["tau"] for c, v in r["per_category"].items()},
        "cycles": r["overall"]["cycles"], "new_tokens": r["overall"]["new_tokens"],
        "draft_ms_per_cycle": r["overall"]["draft_ms_per_cycle"],
    }
    settings, device, command = r["decoding"], r["device"], r["command"]
    size = f"{r['overall']['n_samples']} items / {r['overall']['n_turns']} turns"
summary = {}
for rank, by_seed in runs.items():
    taus = [v["tau"] for v in by_seed.values()]
    summary[rank] = {"seeds": sorted(by_seed), "tau_mean": statistics.mean(taus),
                     "tau_sd": statistics.stdev(taus) if len(taus) > 1 else None,
                     "tau_min": min(taus), "tau_max": max(taus)}
out = {"what": "tree sampling (temperature 0.7): nodes ranked by warped vs raw log-probabilities",
       "decoding": settings, "device": device, "example_command": command, "summary": summary, "runs": runs}
stem.with_suffix(".json").write_text(json.dumps(out, indent=1) + "\n")

cats = sorted(next(iter(next(iter(runs.values())).values()))["tau_per_category"])
lines = [f"| rank_by | seed | tau | {' | '.join(cats)} | draft ms/cycle |", "|---" * (len(cats) + 4) + "|"]
for rank, by_seed in runs.items():
    for seed, v in sorted(by_seed.items()):
        lines.append(f"| {rank} | {seed} | {v['tau']:.3f} | "
                     + " | ".join(f"{v['tau_per_category'][c]:.3f}" for c in cats)
                     + f" | {v['draft_ms_per_cycle']:.1f} |")
lines += ["", "| rank_by | seeds | mean tau | sd | min | max |", "|---|---|---|---|---|---|"]
for rank, s in summary.items():
    lines.append(f"| {rank} | {len(s['seeds'])} | {s['tau_mean']:.3f} | {'-' if s['tau_sd'] is None else format(s['tau_sd'], '.3f')} | {s['tau_min']:.3f} | "
                 f"{s['tau_max']:.3f} |")
head = [
    "# Sampling trees ranked by warped vs raw log-probabilities (tiny benchmark, temperature 0.7)",
    "",
    "`sh lab/studies/sampling_rank.sh` (OUT=/tmp/rank_by) then "
    "`python -m lab.studies.sampling_rank /tmp/rank_by benchmarks/sampling_rank/tiny-temp07`.",
    f"Each run: `{command}` with the rank and seed of its row.",
    f"Device: {device}; OMP_NUM_THREADS=1, 2 cores shared with other engineers' jobs (times are noisy; "
    "tau does not depend on them). Head: the stage-2 export of `python train.py stage=1 && python train.py "
    "stage=2`. Settings: " + ", ".join(f"{k}={v}" for k, v in settings.items() if k != "rank_by") + ".",
    f"The whole tiny benchmark ({size}). The seed seeds the per-item sampling generators, so each row is a different draw of every answer.",
    "",
]
print("\n".join(lines))
stem.with_suffix(".md").write_text("\n".join(head + lines) + "\n")
