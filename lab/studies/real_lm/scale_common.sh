# Sourced by the scale scripts (benchmarks/real_lm/README.md, "Heads at scale"): the data
# overrides of every run, over WORK/splits (scale_splits.py), and the store's folder.
W=${W:-/work/scale}
D=$W/splits
STORE=${STORE:-$W/store}   # scale_store.sh's folder (STORE=... for another, e.g. an msd-only store)
DATA=(target=smollm2_llava "data.text=[{path: $D/text_train.jsonl}]" "data.multimodal=[{path: $D/mm_train.jsonl}]"
      "data.heldout_text=[{path: $D/text_heldout.jsonl}]" "data.heldout_multimodal=[{path: $D/mm_heldout.jsonl}]"
      data.max_length=512 data.max_heldout=64 "data.cache_dir=$W/cache")
