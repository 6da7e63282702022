"""The table of ``lab/bench/any_cpu.sh``'s folder: per CPU kind and setting, the median speedup over
plain decoding (and its range), tau, tokens/s, exactness, what ``target.dtype=auto`` became.

    python -m lab.bench.any_cpu_table OUT [--copy DEST]

``--copy DEST`` also copies each run's report.json and each kind's forward.json into DEST
(what the repository keeps) and writes DEST/summary.json, with OUT written ``OUT``, the folder
``--work`` names (the benchmark's) written ``WORK`` and the checkout's files relative to it: no
path of this machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from lab.portable import portable


def collect(out: Path) -> dict:
    kinds = {}
    for kind_dir in sorted(p for p in out.iterdir() if p.is_dir()):
        runs: dict[str, list[dict]] = {}
        for report in sorted(kind_dir.glob("*-r*/report.json")):
            name = report.parent.name.rsplit("-r", 1)[0]
            runs.setdefault(name, []).append(json.loads(report.read_text()))
        forward = kind_dir / "forward.json"
        settings = {}
        for name, reports in runs.items():
            o = [r["overall"] for r in reports]
            speedups = [x["speedup"] for x in o]
            settings[name] = {
                "runs": len(reports), "speedup": round(statistics.median(speedups), 3),
                "speedup_range": [round(min(speedups), 3), round(max(speedups), 3)],
                "tau": round(o[0]["tau"], 3), "tokens_per_s": round(statistics.median(x["tokens_per_s"] for x in o), 1),
                "plain_tokens_per_s": round(statistics.median(x["ar_tokens_per_s"] for x in o), 1),
                "outputs_equal": all(x["outputs_match_ar"] for x in o),
                "target_setting": reports[0].get("target_setting"), "command": reports[0].get("command"),
            }
        kinds[kind_dir.name] = {"settings": settings,
                                "forward": json.loads(forward.read_text()) if forward.exists() else None}
    return kinds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--copy", type=Path)
    ap.add_argument("--work", type=Path, help="the work folder the benchmark file is in (written WORK in the copies)")
    a = ap.parse_args()
    if not a.out.is_dir():
        ap.error(f"{a.out}: no such folder (lab/bench/any_cpu.sh writes it)")
    kinds = collect(a.out)
    print("| CPU kind | setting | target (auto) | tau | speedup, median (range) | tokens/s (plain) | outputs = plain |")
    print("|---|---|---|---|---|---|---|")
    for kind, k in kinds.items():
        for name, s in k["settings"].items():
            t = s["target_setting"] or {}
            print(f"| {kind} | {name} | {t.get('dtype')}, {t.get('linear')} | {s['tau']:.3f} | {s['speedup']:.2f}x "
                  f"({s['speedup_range'][0]:.2f}-{s['speedup_range'][1]:.2f}, {s['runs']} runs) | "
                  f"{s['tokens_per_s']:.1f} ({s['plain_tokens_per_s']:.1f}) | {'yes' if s['outputs_equal'] else 'no'} |")
    if a.copy:
        folders = {a.out: "OUT", **({a.work: "WORK"} if a.work else {})}
        for report in a.out.glob("*/*-r*/report.json"):
            dest = a.copy / report.parent.parent.name / report.parent.name / "report.json"
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(portable(report.read_text(), folders))
        for forward in a.out.glob("*/forward.json"):
            (a.copy / forward.parent.name).mkdir(parents=True, exist_ok=True)
            (a.copy / forward.parent.name / "forward.json").write_text(portable(forward.read_text(), folders))
        (a.copy / "summary.json").write_text(portable(json.dumps(kinds, indent=1), folders) + "\n")


if __name__ == "__main__":
    main()
