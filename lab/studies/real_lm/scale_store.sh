#!/usr/bin/env bash
# One feature store over every split of the scale data, with the inputs of target layers 2, 15
# and 27 (what an msd3 head of SmolLM2's 30 layers reads) before each row's last output: msd
# heads read the last output of the same rows. The target runs in bf16 here (1.8x the fp32
# forward on this CPU; the store is bf16 as on a GPU); training and decoding run it in fp32.
#   W=/work/scale lab/studies/real_lm/scale_store.sh      (resumes when relaunched)
# LAYERS=null: an msd-only store (the last output only, a quarter of the size); STORE_DIR names
# another folder for it (default WORK/store). DRY=1 counts and sizes it only.
set -euo pipefail
cd "$(dirname "$0")/../../.."
source lab/studies/real_lm/scale_common.sh
python -m lab.studies.real_lm.scale_splits "$D" --images "$W/img" > /dev/null
nice -n "${NICE:-0}" python scripts/generate_features.py "${DATA[@]}" target.dtype=bf16 \
    features.path="${STORE_DIR:-$STORE}" "features.layers=${LAYERS:-[2,15,27]}" batch_size=16 progress=false \
    dry_run="$([ "${DRY:-0}" = 1 ] && echo true || echo false)"
