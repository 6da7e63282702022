#!/usr/bin/env bash
# The stage-1 run of benchmarks/real_lm/results/preview-1850/ (its README): a feature store of the
# regenerated ShareGPT data, then 500 steps of msd from it, in /work/preview.
set -euo pipefail
cd "$(dirname "$0")/../../.."
D=/work/preview/data
DATA=(target=smollm2_llava "data.text=[{path: $D/regen_train.jsonl}]" "data.multimodal=[]" "data.heldout_text=[{path: $D/heldout_regen.jsonl}]" "data.heldout_multimodal=[]" data.max_length=512 data.max_heldout=64 data.cache_dir=/work/preview/cache)
[ -f /work/preview/store/manifest.json ] || python scripts/generate_features.py "${DATA[@]}" features.path=/work/preview/store "splits=[text,heldout_text]" progress=false
python train.py stage=1 "${DATA[@]}" features=offline features.path=/work/preview/store draft.train_vocab=8192 train.bucket_window=64 \
  train.max_steps=500 train.lr=6e-4 eval.every=100 checkpoint.every=100 train.loader_workers=0 seed=0 logging.wandb.mode=disabled logging.progress=false run_dir=/work/preview/run
