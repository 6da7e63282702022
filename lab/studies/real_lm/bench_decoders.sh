#!/usr/bin/env bash
# The decoder settings of benchmarks/real_lm/README.md, each REPEATS times (the machine is
# shared and noisy: the spread is part of the result), into OUT/NAME-rN:
#   lab/studies/real_lm/bench_decoders.sh HEAD OUT [REPEATS]
# Environment as eval.sh (THREADS, SAMPLES, BENCH, NICE). Table: python -m lab.studies.real_lm.table OUT/*
set -euo pipefail
head=$1 out=$2 repeats=${3:-3}
here=$(dirname "$0")
for r in $(seq 1 "$repeats"); do
    "$here/eval.sh" "$head" "$out/chain1-dv8k-r$r" chain decoding.k=1 decoding.draft_vocab=8192
    "$here/eval.sh" "$head" "$out/chain2-dv8k-r$r" chain decoding.k=2 decoding.draft_vocab=8192
    "$here/eval.sh" "$head" "$out/chain2-r$r" chain decoding.k=2
    "$here/eval.sh" "$head" "$out/chain3-dv8k-r$r" chain decoding.k=3 decoding.draft_vocab=8192
    "$here/eval.sh" "$head" "$out/tree3-dv8k-r$r" tree decoding.depth=1 decoding.top_k=2 decoding.total_tokens=3 \
        decoding.draft_vocab=8192
    "$here/eval.sh" "$head" "$out/tree_small-dv8k-r$r" tree_small decoding.draft_vocab=8192
done
