#!/usr/bin/env bash
# Decoder timings of the scale heads (benchmarks/real_lm/README.md, "Heads at scale"): each
# setting REPEATS times on both cores, SAMPLES held-out ShareGPT prompts x 64 new tokens,
# plain decoding in the same process; generate() on the same prompts (generate_speed.py).
#   W=/work/scale lab/studies/real_lm/scale_eval.sh HEAD OUT [REPEATS] [SETTING ...]
# A SETTING is NAME:override,override (default: chain1, chain2, tree_small with the head's own
# vocabulary). TARGET: overrides every setting gets (default: bf16 with eager attention, the
# fastest exact setup on this CPU: docs/decoding.md, "Exact in bf16"); generate() is timed
# in that dtype with both attention implementations.
set -euo pipefail
cd "$(dirname "$0")/../../.."
W=${W:-/work/scale}
head=$1 out=$2 repeats=${3:-3}
shift 3 || shift $#
settings=("$@")
[ ${#settings[@]} -gt 0 ] || settings=("chain1:decoding=chain,decoding.k=1" "chain2:decoding=chain,decoding.k=2"
                                       "tree_small:decoding=tree_small")
IFS=, read -r -a target <<< "${TARGET:-target.dtype=bfloat16,target.attn_implementation=eager}"
dtype=float32
for o in "${target[@]}"; do [[ $o == target.dtype=* ]] && dtype=${o#target.dtype=}; done
export THREADS=${THREADS:-2} NICE=${NICE:-0} SAMPLES=${SAMPLES:-8} BENCH=${BENCH:-$W/splits/bench_text.jsonl}
mkdir -p "$out"
for attn in sdpa eager; do
    [ -f "$out/generate-$attn.json" ] || OMP_NUM_THREADS=$THREADS python -m lab.studies.real_lm.generate_speed \
        --bench "$BENCH" --samples "$SAMPLES" --threads "$THREADS" --repeats 3 --dtype "$dtype" --attn "$attn" \
        --out "$out/generate-$attn.json"
done
for r in $(seq 1 "$repeats"); do
    for s in "${settings[@]}"; do
        name=${s%%:*}
        IFS=, read -r -a ov <<< "${s#*:}"
        dec=${ov[0]#decoding=}
        [ -f "$out/$name-r$r/report.json" ] || lab/studies/real_lm/eval.sh "$head" "$out/$name-r$r" "$dec" "${ov[@]:1}" "${target[@]}"
    done
done
