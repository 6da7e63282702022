#!/usr/bin/env bash
# The heads of benchmarks/real_lm/README.md ("Heads at scale"), each from the one store of
# scale_store.sh, resumable (relaunch the same line after a kill: it continues from the newest
# checkpoint). RUN names the run; its folder is WORK/runs/RUN.
#   W=/work/scale lab/studies/real_lm/scale_train.sh RUN
# RUN: msd | msd3 (stage 1 then stage 2), msd-epochs (the committed msd-stage2 trained on from the
# store over all splits for STEPS steps, default 12,320 = 10 epochs of 19,716 conversations at 16 a step,
# the field's settings: lr 1e-4, 30 warm-up steps, cosine; image share 0.38, the data's own; bf16
# training, 1.48x fp32's tokens/s on this CPU with AVX-512 BF16, the same losses; validated every half
# epoch and checkpointed every quarter unless EVERY / CKPT say otherwise: a validation costs ~1.5 min
# here, the full-vocabulary argmax at every held-out position),
# settings-field-N / settings-today-N (msd stage 1 from scratch on N text conversations from the store:
# lr 1e-4, 30 warm-up steps, global batch 16 by 4 accumulation steps / the defaults: lr 3e-4, 20 warm-up
# steps, batch 4; both cosine to a tenth, bf16, validated every 1,024 conversations), msd-nodecouple (stage 2 from msd's stage 1 with
# draft.decouple_visual=false), sweep-N (msd stage 1 on the first N text conversations);
# a name ending in -seedN trains with seed=N (msd-stage2-seed1: msd's stage 2 again from the same
# stage-1 head with another seed; msd-nodecouple-seed1: the same with decoupling off).
# Environment: S1, S2 (optimizer steps of stage 1 and 2), STEPS (msd-epochs), STORE (the store folder), EVERY
# and CKPT (steps between validations and between checkpoints), THREADS, NICE, SEED, TTT and NOISE (msd3's TTT steps,
# default 3, and train.noise, default none), STAGE1_ONLY=1 / STAGE2_ONLY=1
# (msd, msd3: one stage of the two; stage 2 starts from the run's stage-1 head).
set -euo pipefail
cd "$(dirname "$0")/../../.."
source lab/studies/real_lm/scale_common.sh
run=$1
S1=${S1:-1500} S2=${S2:-500}
seed=${SEED:-0}
[[ $run =~ -seed([0-9]+)$ ]] && seed=${BASH_REMATCH[1]}
shared=("${DATA[@]}" train.bucket_window=64 seed="$seed" logging.wandb.mode=disabled logging.progress=false)
offline=(features=offline "features.path=$STORE" train.loader_workers=0)
launch() { OMP_NUM_THREADS="${THREADS:-2}" nice -n "${NICE:-0}" python train.py "${shared[@]}" "$@"; }
train() { launch "${offline[@]}" eval.every="${EVERY:-250}" checkpoint.every="${CKPT:-${EVERY:-250}}" "$@"; }   # from the store
stage1=(stage=1 train.max_steps="$S1" train.lr=6e-4 train.warmup_steps=50)
stage2=(stage=2 train.max_steps="$S2" train.lr=3e-4 train.warmup_steps=20 stage.curriculum.ramp_steps=$((S2 / 2)))
msd=(draft.train_vocab=8192)
# msd3: EAGLE-3's head with 3 TTT steps over an 8,192-token draft vocabulary (7 steps cost 2.3x more
# a step here); no input noise, as EAGLE-3 trains (train.noise=none; the TTT is its robustness)
msd3=(head=msd3 draft.ttt_steps="${TTT:-3}" draft.draft_vocab_size=8192 train.noise="${NOISE:-none}")
case $run in
  msd) [ "${STAGE2_ONLY:-0}" = 1 ] || train "${stage1[@]}" "${msd[@]}" run_dir="$W/runs/msd"
       [ "${STAGE1_ONLY:-0}" = 1 ] || train "${stage2[@]}" "${msd[@]}" run_dir="$W/runs/msd" ;;
  msd3*) [ "${STAGE2_ONLY:-0}" = 1 ] || train "${stage1[@]}" "${msd3[@]}" run_dir="$W/runs/$run"
         [ "${STAGE1_ONLY:-0}" = 1 ] || train "${stage2[@]}" "${msd3[@]}" run_dir="$W/runs/$run" ;;
  msd-stage2-seed*) train "${stage2[@]}" "${msd[@]}" run_dir="$W/runs/$run" stage.init_from="$W/runs/msd/stage1/final" ;;
  msd-nodecouple*) train "${stage2[@]}" "${msd[@]}" draft.decouple_visual=false run_dir="$W/runs/$run" \
                        stage.init_from="$W/runs/msd/stage1/final" ;;
  msd-cont*) launch target.dtype=bf16 train.loader_workers=1 eval.every=100 checkpoint.every=50 stage=2 \
        train.max_steps="$S2" train.lr=1e-4 train.warmup_steps=30 train.grad_accum=4 stage.curriculum.start=0.5 \
        stage.curriculum.end=0.5 stage.init_from=data/smollm2-llava-heads/msd-stage2 "${msd[@]}" run_dir="$W/runs/$run" ;;
  msd-epochs*) EVERY=${EVERY:-616} CKPT=${CKPT:-308} train stage=2 train.max_steps="${STEPS:-12320}" train.lr=1e-4 train.warmup_steps=30 train.grad_accum=4 \
        train.precision=bf16 \
        stage.curriculum.start=0.38 stage.curriculum.end=0.38 stage.init_from=data/smollm2-llava-heads/msd-stage2 \
        "${msd[@]}" run_dir="$W/runs/$run" ;;
  settings-field-*) n=${run#settings-field-}
        EVERY=64 train stage=1 train.max_steps=$((n / 16)) train.lr=1e-4 train.warmup_steps=30 train.grad_accum=4 \
        train.precision=bf16 "${msd[@]}" run_dir="$W/runs/$run" ;;
  settings-today-*) n=${run#settings-today-}
        EVERY=256 train stage=1 train.max_steps=$((n / 4)) train.precision=bf16 "${msd[@]}" run_dir="$W/runs/$run" ;;
  sweep-*) train "${stage1[@]}" "${msd[@]}" data.max_train="${run#sweep-}" run_dir="$W/runs/$run" ;;
  *) echo "unknown run $run (msd, msd3, msd-nodecouple, msd-stage2-seedN, msd-cont, msd-epochs, settings-field-N, settings-today-N, sweep-N)" >&2; exit 2 ;;
esac
