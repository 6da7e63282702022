#!/usr/bin/env bash
# Decoder timings of the scale heads (benchmarks/real_lm/README.md, "Heads at scale"): each
# setting REPEATS times on both cores, SAMPLES held-out ShareGPT prompts x 64 new tokens,
# plain decoding in the same process; generate() on the same prompts (generate_speed.py).
#   W=/work/scale benchmarks/real_lm/scale_eval.sh HEAD OUT [REPEATS] [SETTING ...]
# A SETTING is NAME:override,override (default: chain1, chain2, tree3 with the head's own vocabulary).
set -euo pipefail
cd "$(dirname "$0")/../.."
W=${W:-/work/scale}
head=$1 out=$2 repeats=${3:-3}
shift 3 || shift $#
settings=("$@")
[ ${#settings[@]} -gt 0 ] || settings=("chain1:decoding=chain,decoding.k=1" "chain2:decoding=chain,decoding.k=2"
                                       "tree3:decoding=tree,decoding.depth=1,decoding.top_k=2,decoding.total_tokens=3")
export THREADS=${THREADS:-2} NICE=${NICE:-0} SAMPLES=${SAMPLES:-8} BENCH=${BENCH:-$W/splits/bench_text.jsonl}
mkdir -p "$out"
[ -f "$out/generate.json" ] || OMP_NUM_THREADS=$THREADS python benchmarks/real_lm/generate_speed.py --bench "$BENCH" \
    --samples "$SAMPLES" --threads "$THREADS" --repeats 3 --out "$out/generate.json"
for r in $(seq 1 "$repeats"); do
    for s in "${settings[@]}"; do
        name=${s%%:*}
        IFS=, read -r -a ov <<< "${s#*:}"
        dec=${ov[0]#decoding=}
        [ -f "$out/$name-r$r/report.json" ] || benchmarks/real_lm/eval.sh "$head" "$out/$name-r$r" "$dec" "${ov[@]:1}"
    done
done
