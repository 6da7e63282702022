#!/usr/bin/env bash
# One decoder evaluation on the SmolLM2 target: benchmarks/real_lm/eval.sh HEAD OUT DECODING [overrides...]
# e.g. benchmarks/real_lm/eval.sh /tmp/reallm/runs/regen/stage1/best /tmp/reallm/eval/regen-tree_small tree_small
set -euo pipefail
head=$1 out=$2 decoding=$3
shift 3
OMP_NUM_THREADS=1 nice -n 19 python eval.py target=smollm2_llava draft="$head" out="$out" \
    bench=jsonl bench.path="$(dirname "$0")/bench.jsonl" bench.max_samples=6 \
    decoding="$decoding" decoding.max_new_tokens=64 threads=1 warmup=1 progress=false "$@"
