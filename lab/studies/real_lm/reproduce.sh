#!/usr/bin/env bash
# The whole real-LM benchmark of benchmarks/real_lm/README.md, from a built target
# (python -m lab.targets.make_smollm2_llava) to the tables, with the settings it was run with.
# Hours of CPU on a 2-core machine (the README gives each part's time); every step resumes
# or is skipped when its output exists, so a relaunch goes on where it stopped.
#
#   lab/studies/real_lm/reproduce.sh [WORK]          # WORK: scratch folder, default /tmp/reallm
#
# Environment: REGEN_LIMIT (ShareGPT conversations to answer, default 566), STEPS (stage 1,
# default 300), REPEATS (decoder settings, default 3).
set -euo pipefail
cd "$(dirname "$0")/../../.."
W=${1:-/tmp/reallm}
here=lab/studies/real_lm
mkdir -p "$W"
one() { OMP_NUM_THREADS=1 nice -n 10 "$@"; }   # the training jobs ran one thread each, two at a time

# 1. data: ShareGPT answered by the target (greedy, first exchange), split; image prompts answered too
[ -f data/sharegpt-v3-prefix.jsonl ] || python -m lab.data.sharegpt_prefix
one python scripts/regenerate_data.py target=smollm2_llava out="$W/regen" \
    "inputs=[{path: data/sharegpt-v3-prefix.jsonl}]" limit="${REGEN_LIMIT:-566}" max_turns=1 max_new_tokens=256
python -m lab.studies.real_lm.make_data "$W/regen/regenerated.jsonl" data/sharegpt-v3-prefix.jsonl "$W/data" --heldout 24 --bench-n 16
python -m lab.studies.real_lm.make_image_data "$W/img"
one python scripts/regenerate_data.py target=smollm2_llava out="$W/regen_img" \
    "inputs=[{path: $W/img/train_prompts.jsonl}]" max_turns=1 max_new_tokens=128
head -n 108 "$W/regen_img/regenerated.jsonl" > "$W/data/mm_train.jsonl"
tail -n +109 "$W/regen_img/regenerated.jsonl" > "$W/data/mm_heldout.jsonl"
{ head -n 6 "$W/data/bench.jsonl"; cat "$W/img/bench_images.jsonl"; } > "$W/data/bench_mm.jsonl"

# 2. stage 1, msd: regenerated vs original answers, same conversations, seed and steps
common=(target=smollm2_llava "data.heldout_text=[{path: $W/data/heldout_regen.jsonl}]" data.max_length=512
        eval.every=50 checkpoint.every=50 train.loader_workers=0 seed=0 logging.wandb.mode=disabled)
for v in regen orig; do
    one python train.py stage=1 "${common[@]}" "data.text=[{path: $W/data/${v}_train.jsonl}]" \
        train.max_steps="${STEPS:-300}" train.lr=6e-4 run_dir="$W/runs/$v" &
done
wait

# 3. stage 2 from the regenerated-data head: the image conversations ramped in
one python train.py stage=2 "${common[@]}" "data.text=[{path: $W/data/regen_train.jsonl}]" \
    "data.multimodal=[{path: $W/data/mm_train.jsonl}]" "data.heldout_multimodal=[{path: $W/data/mm_heldout.jsonl}]" \
    train.max_steps=250 train.lr=3e-4 stage.curriculum.end=0.5 stage.curriculum.ramp_steps=125 run_dir="$W/runs/regen"

# 4. stage 1, msd3 (EAGLE-3's head): three training-time-test steps, an 8,192-token draft vocabulary
one python train.py stage=1 head=msd3 "${common[@]}" "data.text=[{path: $W/data/regen_train.jsonl}]" \
    draft.ttt_steps=3 draft.draft_vocab_size=8192 train.max_steps=150 train.lr=6e-4 run_dir="$W/runs/msd3"

# 5. decoders on held-out prompts (plain decoding in the same process), both cores, nothing else running
export NICE=0
B=(SAMPLES=8 BENCH="$W/data/bench.jsonl")
H="$W/runs/regen/stage2/final"
env THREADS=2 "${B[@]}" $here/bench_decoders.sh "$H" "$W/eval/t2" "${REPEATS:-3}"
for r in 1 2 3; do
    env THREADS=2 "${B[@]}" $here/eval.sh "$H" "$W/eval/mp/chain3-dv8k-mp0.3-r$r" chain decoding.k=3 \
        decoding.draft_vocab=8192 decoding.draft_min_prob=0.3
done
for p in 0.5 0.7; do
    env THREADS=2 "${B[@]}" $here/eval.sh "$H" "$W/eval/mp/chain3-dv8k-mp$p-r1" chain decoding.k=3 \
        decoding.draft_vocab=8192 decoding.draft_min_prob=$p
done
env THREADS=2 "${B[@]}" $here/eval.sh "$H" "$W/eval/mp/chain5-dv8k-mp0.3-r1" chain decoding.k=5 decoding.draft_vocab=8192 \
    decoding.draft_min_prob=0.3
env THREADS=2 "${B[@]}" $here/eval.sh "$H" "$W/eval/mp/chain1-dv4k-r1" chain decoding.k=1 decoding.draft_vocab=4096
for r in 1 2; do
    for k in 1 2; do
        env THREADS=1 "${B[@]}" $here/eval.sh "$H" "$W/eval/t1/chain$k-dv8k-r$r" chain decoding.k=$k decoding.draft_vocab=8192
    done
done
for s in 1 2; do  # stage 1 vs stage 2 on text, photographs and shapes
    env THREADS=2 SAMPLES=16 BENCH="$W/data/bench_mm.jsonl" $here/eval.sh "$W/runs/regen/stage$s/final" \
        "$W/eval/mm/stage$s-chain2-dv8k" chain decoding.k=2 decoding.draft_vocab=8192
done
# the three stage-1 heads (tau; the timings of this run were taken with training jobs beside it)
for v in regen orig; do
    env THREADS=1 "${B[@]}" $here/eval.sh "$W/runs/$v/stage1/final" "$W/eval/cmp/$v-s1-chain3-dv8k" chain decoding.k=3 \
        decoding.draft_vocab=8192
done
env THREADS=1 "${B[@]}" $here/eval.sh "$W/runs/msd3/stage1/final" "$W/eval/cmp/msd3-s1-chain3" chain decoding.k=3
python -m lab.studies.real_lm.plain_vs_generate --draft "$H" --bench "$W/data/bench.jsonl" \
    --out "$W/eval/plain_vs_generate-2threads.json" --repeats 3 --new-tokens 32 --threads 2
python -m lab.studies.real_lm.matmul_rows --out "$W/eval/matmul_rows.json"
for g in t2 mp t1 mm cmp; do python -m lab.studies.real_lm.table "$W"/eval/$g/*; done
