#!/bin/sh
# rank_by warped vs raw, temperature 0.7, tree 5/10/60, whole tiny benchmark, seeds 0-4
export OMP_NUM_THREADS=1
for seed in 0 1 2 3 4; do
  for rank in warped raw; do
    python eval.py decoding.sampling.temperature=0.7 decoding.sampling.rank_by=$rank seed=$seed threads=1 \
      progress=false bench.max_per_category=null out=${OUT:-/tmp/rank_by}/$rank-s$seed 2>&1 | tail -1
  done
done
