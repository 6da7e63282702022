#!/usr/bin/env bash
# One decoder evaluation on the SmolLM2 target: lab/studies/real_lm/eval.sh HEAD OUT DECODING [overrides...]
# e.g. BENCH=WORK/splits/bench_text.jsonl lab/studies/real_lm/eval.sh HEAD OUT tree_small
# Environment: THREADS (torch threads, default 1), SAMPLES (held-out prompts, default 6),
# BENCH (the prompts file: WORK/splits/bench_text.jsonl, lab/studies/real_lm/scale_splits.py), NICE (default 19).
set -euo pipefail
head=$1 out=$2 decoding=$3
shift 3
threads=${THREADS:-1}
OMP_NUM_THREADS=$threads nice -n "${NICE:-19}" python eval.py target=smollm2_llava draft="$head" out="$out" \
    bench=jsonl bench.path="${BENCH:?set BENCH to a JSONL benchmark, e.g. WORK/splits/bench_text.jsonl}" bench.max_samples="${SAMPLES:-6}" \
    decoding="$decoding" decoding.max_new_tokens=64 threads="$threads" warmup=1 progress=false "$@"
