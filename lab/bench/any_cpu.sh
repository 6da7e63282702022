#!/usr/bin/env bash
# A committed SmolLM2 head decoded as a user on this CPU would (target.dtype=auto), and on the
# same CPU limited to AVX2 (no AVX-512, so no native bf16: how a CPU without it behaves), each
# setting REPEATS times beside plain decoding in the same process; the forward costs per row
# count (lab/bench/cpu_linear.py) for both. The README's "Any CPU" table reads OUT.
#
#   bash lab/bench/any_cpu.sh HEAD BENCH OUT [REPEATS]
#     HEAD   a head folder (data/smollm2-llava-heads/msd-stage2)
#     BENCH  a JSONL benchmark (WORK/splits/bench_text.jsonl, lab/studies/real_lm/scale_splits.py)
# Environment: SETTINGS (default "chain1:decoding=chain,decoding.k=1 chain2:decoding=chain,decoding.k=2"),
# SAMPLES (8), TOKENS (64), THREADS (2), KINDS ("native avx2": the CPU as it is, then limited to AVX2).
set -euo pipefail
cd "$(dirname "$0")/../.."
[ $# -ge 3 ] || { echo "usage: lab/bench/any_cpu.sh HEAD BENCH OUT [REPEATS]" >&2; exit 2; }
head=$1 bench=$2 out=$3 repeats=${4:-3}
[ -d "$head" ] || { echo "lab/bench/any_cpu.sh: $head is not a head folder" >&2; exit 2; }
[ -f "$bench" ] || { echo "lab/bench/any_cpu.sh: $bench not found (lab/studies/real_lm/scale_splits.py writes it)" >&2; exit 2; }
[ -d data/smollm2-llava ] || { echo "lab/bench/any_cpu.sh: data/smollm2-llava missing: python -m lab.targets.make_smollm2_llava" >&2; exit 2; }
[[ $repeats =~ ^[1-9][0-9]*$ ]] || { echo "lab/bench/any_cpu.sh: REPEATS must be a positive whole number" >&2; exit 2; }
read -r -a settings <<< "${SETTINGS:-chain1:decoding=chain,decoding.k=1 chain2:decoding=chain,decoding.k=2}"
threads=${THREADS:-2}
mkdir -p "$out"
declare -A kinds=([native]="" [avx2]="ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2")
read -r -a kind_list <<< "${KINDS:-native avx2}"
for kind in "${kind_list[@]}"; do
    [ -n "${kinds[$kind]+set}" ] || { echo "lab/bench/any_cpu.sh: unknown kind $kind in KINDS (native, avx2)" >&2; exit 2; }
done
for kind in "${kind_list[@]}"; do
    read -r -a env_kind <<< "${kinds[$kind]}"
    mkdir -p "$out/$kind"
    [ -f "$out/$kind/forward.json" ] || env "${env_kind[@]}" python -m lab.bench.cpu_linear \
        "$out/$kind/forward.json" --threads "$threads" --repeats 20
    for r in $(seq 1 "$repeats"); do
        for s in "${settings[@]}"; do
            name=${s%%:*}
            IFS=, read -r -a ov <<< "${s#*:}"
            dir=$out/$kind/$name-r$r
            [ -f "$dir/report.json" ] || env "${env_kind[@]}" python eval.py target=smollm2_llava draft="$head" "${ov[@]}" \
                bench=jsonl bench.path="$bench" bench.max_samples="${SAMPLES:-8}" decoding.max_new_tokens="${TOKENS:-64}" \
                threads="$threads" progress=false out="$dir" > "$dir.log" 2>&1 || { cat "$dir.log" >&2; exit 1; }
            grep -E "^tau|^target:" "$dir.log" | sed "s/^/$kind $name r$r: /"
        done
    done
done
