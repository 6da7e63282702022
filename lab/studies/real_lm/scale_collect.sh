#!/usr/bin/env bash
# Copy the small result files of the scale work folder into benchmarks/real_lm/results/scale/ (what is committed):
# eval reports (report.json, report.md), generate() timings, vLLM serve reports, run metrics (compacted, gzipped).
#   lab/studies/real_lm/scale_collect.sh WORK            everything
#   lab/studies/real_lm/scale_collect.sh WORK RUN...     only these runs' metrics: a run in progress
# OUT: where they go instead of benchmarks/real_lm/results/scale.
set -euo pipefail
cd "$(dirname "$0")/../../.."
W=${1:?usage: lab/studies/real_lm/scale_collect.sh WORK [RUN...]}
out=${OUT:-benchmarks/real_lm/results/scale}
# a run's metrics, each stage's compacted (lab/studies/real_lm/compact_metrics.py: what head_summary reads)
collect_run() {
    local found=0 st d
    for st in "$W/runs/$1"/stage*/; do
        [ -f "$st/metrics.jsonl" ] || continue
        d=$out/runs/$1/$(basename "$st"); mkdir -p "$d"; found=1
        python -m lab.studies.real_lm.compact_metrics "$st/metrics.jsonl" "$d/metrics.jsonl.gz"
    done
    [ $found = 1 ] || { echo "scale_collect.sh: no $W/runs/$1/stage*/metrics.jsonl" >&2; exit 1; }
}
if [ $# -gt 1 ]; then
    for run in "${@:2}"; do collect_run "$run"; done
    exit 0
fi
for part in eval eval-fp32 eval-again serve; do
    [ -d "$W/$part" ] || continue
    rm -rf "${out:?}/$part"
    (cd "$W" && find "$part" -type f \( -name report.json -o -name report.md -o -name 'generate*.json' \) -print0) |
        while IFS= read -r -d '' f; do mkdir -p "$out/$(dirname "$f")"; cp "$W/$f" "$out/$f"; done
done
for run_dir in "$W"/runs/*/; do
    if compgen -G "$run_dir/stage*/metrics.jsonl" > /dev/null; then collect_run "$(basename "$run_dir")"; fi
done
cp "$W/splits/splits.json" "$out/splits.json"
