#!/usr/bin/env bash
# Copy the small result files of the scale work folder into benchmarks/real_lm/results/scale/ (what is committed):
# eval reports (report.json, report.md), generate() timings, vLLM serve reports, run metrics (gzipped).
#   lab/studies/real_lm/scale_collect.sh WORK
set -euo pipefail
cd "$(dirname "$0")/../../.."
W=${1:-/work/scale}
out=benchmarks/real_lm/results/scale
for part in eval eval-fp32 eval-again serve; do
    [ -d "$W/$part" ] || continue
    rm -rf "${out:?}/$part"
    (cd "$W" && find "$part" -type f \( -name report.json -o -name report.md -o -name 'generate*.json' \) -print0) |
        while IFS= read -r -d '' f; do mkdir -p "$out/$(dirname "$f")"; cp "$W/$f" "$out/$f"; done
done
# run metrics gzipped (a fifth of the size; benchmarks/real_lm/results/scale/runs/ is committed with git add -f: runs/ is ignored)
(cd "$W" && find runs -name metrics.jsonl -path '*/stage*/metrics.jsonl' -print0) |
    while IFS= read -r -d '' f; do mkdir -p "$out/$(dirname "$f")"; rm -f "$out/$f"; gzip -9nc "$W/$f" > "$out/$f.gz"; done
cp "$W/splits/splits.json" "$out/splits.json"
