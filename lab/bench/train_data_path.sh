#!/usr/bin/env bash
# The data path's throughput on target=smollm2_llava (benchmarks/train/README.md, "The data
# path"): regeneration by engine, feature generation, and a training step online / offline,
# full vocabulary / draft.train_vocab=8192, for msd and msd3. One run per comparison, both
# cores; run it with nothing else on the machine.
#
#   lab/bench/train_data_path.sh [WORK] [OUT]     # WORK default /tmp/data-path, OUT benchmarks/train/data_path
#
# Needs: python -m lab.targets.make_smollm2_llava, python -m lab.data.sharegpt_prefix,
# bash scripts/vllm_env.sh (-> .venv-vllm). About 45 minutes; every part is skipped when its
# output exists, so a relaunch goes on where it stopped.
set -Eeuo pipefail  # -E: the ERR trap below also fires inside the functions
cd "$(dirname "$0")/../.."
W=${1:-/tmp/data-path}
OUT=${2:-benchmarks/train/data_path}
VPY=${VLLM_PYTHON:-.venv-vllm/bin/python}
# what it needs, checked before any work; a failed step says which, with the end of its log
fail() { echo "error: $*" >&2; exit 1; }
[ -f data/smollm2-llava/config.json ] ||
  fail "no target in data/smollm2-llava: build it first with python -m lab.targets.make_smollm2_llava (data/README.md)"
[ -f data/sharegpt-v3-prefix.jsonl ] ||
  fail "no data/sharegpt-v3-prefix.jsonl: write it first with python -m lab.data.sharegpt_prefix"
[ -x "$VPY" ] || fail "no vLLM environment at $VPY: build it first with bash scripts/vllm_env.sh (or set VLLM_PYTHON)"
mkdir -p "$W" "$OUT"
trap 'rc=$?; log=$(ls -t "$W"/*.log 2>/dev/null | head -1); echo "error: a step failed (exit $rc): $BASH_COMMAND" >&2
      [ -z "$log" ] || { echo "the end of $log:" >&2; tail -n 15 "$log" >&2; }' ERR
export OMP_NUM_THREADS=2 VLLM_CPU_KVCACHE_SPACE=${KV_GB:-4}
SRC="[{path: data/sharegpt-v3-prefix.jsonl}]"
REGEN=(target=smollm2_llava max_turns=1 max_new_tokens=128 max_prompt_tokens=384 progress=false "inputs=$SRC")

# 1. regeneration: the same first prompts of the ShareGPT prefix (first user turn, greedy, 128 new tokens)
regen() {  # NAME PYTHON LIMIT [overrides]
  local name=$1 py=$2 limit=$3; shift 3
  [ -f "$OUT/regen-$name.json" ] && return
  rm -rf "$W/regen-$name"   # (a partial run of this benchmark's own scratch folder)
  "$py" scripts/regenerate_data.py "${REGEN[@]}" limit="$limit" out="$W/regen-$name" "$@" > "$W/regen-$name.log" 2>&1
  cp "$W/regen-$name/manifest.json" "$OUT/regen-$name.json"
}
regen hf-decoder-16 python 16 engine=hf
regen hf-batch16-32 python 32 engine=hf batch_size=16
regen vllm-16 "$VPY" 16 engine=vllm
regen vllm-32 "$VPY" 32 engine=vllm
regen vllm-200 "$VPY" 200 engine=vllm
DATA="$W/regen-vllm-200/regenerated.jsonl"

# 2. feature generation over those 200 conversations (fp16 on a CPU; msd3's layers too, so one store serves both heads)
ONLY_TEXT=(target=smollm2_llava "data.text=[{path: $DATA}]" "data.multimodal=[]" "data.heldout_text=[]"
           "data.heldout_multimodal=[]" data.max_length=512 "data.cache_dir=$W/cache")
if [ ! -f "$OUT/features.json" ]; then
  python scripts/generate_features.py "${ONLY_TEXT[@]}" features.path="$W/store-msd" dry_run=true \
      > "$W/features-msd-dry.log" 2>&1
  rm -rf "$W/store"   # (this benchmark's own scratch store, from a run cut short)
  t0=$(date +%s.%N)
  python scripts/generate_features.py "${ONLY_TEXT[@]}" features.path="$W/store" \
      "features.layers=[2,15,27]" "splits=[text]" progress=false > "$W/features.log" 2>&1
  t1=$(date +%s.%N)
  python -m lab.bench.train_summary features "$W" "$OUT/features.json" "$(python -c "print($t1 - $t0)")"
fi

# 3. a training step, stage 1, micro-batch 4 (the real-LM recipe's), 2 threads
bench() {  # NAME [overrides]   (STEPS: timed optimizer steps, default 4)
  local name=$1; shift
  [ -f "$OUT/train-$name.json" ] && return
  python -m lab.bench.train "${ONLY_TEXT[@]}" train.micro_batch_size=4 train.loader_workers=0 "$@" \
      --steps "${STEPS:-4}" --warmup 1 --split-steps 3 --micro-batches 4 --note "$name" --out "$OUT/train-$name.json" \
      > "$W/train-$name.log" 2>&1
}
OFF=(features=offline features.path="$W/store")
bench msd-online-full
bench msd-offline-full "${OFF[@]}"
bench msd-online-8192 draft.train_vocab=8192
bench msd-offline-8192 "${OFF[@]}" draft.train_vocab=8192
# length buckets need more steps to show: 40 (160 conversations, about one epoch of the 163) each
STEPS=40 bench msd-offline-8192-40steps "${OFF[@]}" draft.train_vocab=8192
STEPS=40 bench msd-offline-8192-bucket64-40steps "${OFF[@]}" draft.train_vocab=8192 train.bucket_window=64
M3=(head=msd3 "draft.feature_layers=[2,15,27]")
bench msd3-online-full "${M3[@]}" draft.draft_vocab_size=49153
bench msd3-offline-full "${M3[@]}" draft.draft_vocab_size=49153 "${OFF[@]}"
bench msd3-online-8192 "${M3[@]}" draft.draft_vocab_size=8192
bench msd3-offline-8192 "${M3[@]}" draft.draft_vocab_size=8192 "${OFF[@]}"

[ -f "$OUT/padding.json" ] || python -m lab.bench.train_summary padding "$W" "$OUT/padding.json" "${ONLY_TEXT[@]}"
python -m lab.bench.train_summary all "$W" "$OUT"   # -> $OUT/../data_path.json and data_path.md
