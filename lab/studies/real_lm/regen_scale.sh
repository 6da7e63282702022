#!/usr/bin/env bash
# The scale data of benchmarks/real_lm/README.md (the committed heads' data): the target's own answers
# to easy-VQA image prompts and to the first user turn of ShareGPT conversations, through vLLM
# (scripts/regenerate_data.py engine=vllm, fp32 as the CPU target, greedy), in the background:
# easy-VQA's own questions and short requests, descriptions with explanations, then ShareGPT.
# Hours on a 2-core machine; relaunching resumes (a kill loses at most one chunk in flight).
#
#   lab/studies/real_lm/regen_scale.sh [WORK]      # WORK default /work/scale
#
# Needs: python -m lab.targets.make_smollm2_llava, python -m lab.data.sharegpt_prefix,
# bash scripts/vllm_env.sh (-> .venv-vllm). Environment: TEXT_LIMIT (default 17671: the whole prefix),
# THREADS (default 2), NICE (default 10).
set -euo pipefail
cd "$(dirname "$0")/../../.."
W=${1:-/work/scale}
PY=${VLLM_PYTHON:-.venv-vllm/bin/python}
mkdir -p "$W"
run() { OMP_NUM_THREADS="${THREADS:-2}" VLLM_CPU_KVCACHE_SPACE="${KV_GB:-6}" nice -n "${NICE:-10}" "$PY" "$@"; }
[ -f "$W/img/train_prompts.jsonl" ] || python -m lab.studies.real_lm.make_image_data "$W/img" --n-train 4000 --questions --n-shapes 8
# prompts over 384 tokens are dropped: training reads 512 tokens, 384 + 128 new
common=(engine=vllm target=smollm2_llava max_turns=1 max_new_tokens=128 max_prompt_tokens=384 batch_size=256)
run scripts/regenerate_data.py "${common[@]}" out="$W/regen_img" "inputs=[{path: $W/img/train_prompts.jsonl}]"
# the same images with a request for a description and a text follow-up, two turns (answers worth drafting)
[ -f "$W/img_describe/train_prompts.jsonl" ] || python -m lab.studies.real_lm.make_image_data "$W/img_describe" \
    --n-train 4000 --describe --n-shapes 8
run scripts/regenerate_data.py "${common[@]/max_turns=1/max_turns=2}" batch_size=64 out="$W/regen_img_describe" \
    "inputs=[{path: $W/img_describe/train_prompts.jsonl}]"
run scripts/regenerate_data.py "${common[@]}" out="$W/regen_text" \
    "inputs=[{path: data/sharegpt-v3-prefix.jsonl}]" limit="${TEXT_LIMIT:-17671}"
