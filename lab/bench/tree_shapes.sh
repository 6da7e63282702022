#!/usr/bin/env bash
# Draft-tree shapes on this CPU: eval.py with decoding=tree at each DEPTH,TOP_K,TOTAL_TOKENS of
# SHAPES beside plain decoding in the same process (target.dtype=auto), one run each; the rows of
# benchmarks/real_lm/README.md's tree-shape table come from OUT/*/report.json.
#   bash lab/bench/tree_shapes.sh HEAD BENCH OUT
# Environment: SHAPES (default "2,4,8 3,4,12 3,4,16 4,4,16 3,6,16 4,6,24 2,3,6"), SAMPLES (8), TOKENS (64), THREADS (2).
set -euo pipefail
cd "$(dirname "$0")/../.."
[ $# -ge 3 ] || { echo "usage: lab/bench/tree_shapes.sh HEAD BENCH OUT" >&2; exit 2; }
head=$1 bench=$2 out=$3
mkdir -p "$out"
for s in ${SHAPES:-2,4,8 3,4,12 3,4,16 4,4,16 3,6,16 4,6,24 2,3,6}; do
    IFS=, read -r d k n <<< "$s"
    name=d${d}k${k}n${n}
    [ -f "$out/$name/report.json" ] || python eval.py target=smollm2_llava draft="$head" decoding=tree decoding.depth="$d" \
        decoding.top_k="$k" decoding.total_tokens="$n" bench=jsonl bench.path="$bench" bench.max_samples="${SAMPLES:-8}" \
        decoding.max_new_tokens="${TOKENS:-64}" threads="${THREADS:-2}" progress=false out="$out/$name" > "$out/$name.log" 2>&1 \
        || { cat "$out/$name.log" >&2; exit 1; }
    echo "$name $(grep -E '^tau|speedup' "$out/$name.log" | tr '\n' ' ')"
done
