#!/usr/bin/env bash
# Issue 12's GPU measurements as one command on a GPU box that has torch and transformers
# but none of deepspeed, hydra-core, omegaconf, antlr4, wandb, datasets (and no network).
#
#   here:  bash scripts/gpu_session.sh pack              # wheels into .whl/ (git-ignored)
#   there: bash scripts/gpu_session.sh run [PART] [--dry-run]
#            PART: all (default: readme and throughput) | readme | throughput | decode
#
# `run` installs .whl/ into /tmp/site and writes everything under $OUT (default /tmp/gpu-out):
#   readme/      the README's commands on CUDA with the tiny target, bf16: `deepspeed train.py
#                stage=1`, `stage=2`, `python eval.py ...`, then a SIGKILL mid-run and a
#                relaunch that resumes (resume.json: weights vs the uninterrupted run)
#   train-<shape>-<gpu>.json/.md   7B-shape throughput (scripts/bench_train.py): online features,
#                ZeRO-2, sequence 2048 with one image, micro-batch 1, 2, 4; a profile table per
#                size; sizes that run out of memory are measured again with gradient checkpointing
#   decode-<shape>-<gpu>.json/.md  issue 13's decoder table (scripts/bench_gpu.py) for each shape in
#                DECODE_SHAPES (default: llava15_7b llava15_13b qwen2vl_7b; about 5 minutes each)
#   env.txt      nvidia-smi, versions
# With a 10-minute limit per call, run `run readme`, `run throughput` and, one shape per call,
# `DECODE_SHAPES=llava15_7b run decode` (and 13B, Qwen2-VL-7B) as separate calls. --dry-run prints the plan and checks the wheels (CPU).
# --local runs with this machine's packages (no install), for a CPU check of the flow with
#   EXTRA="train.max_steps=4 checkpoint.every=2" KILL_AT=2 EVAL_EXTRA="bench.max_items=2"
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

# Everything the training stack needs that the GPU image lacks, pinned to this project's
# environment (deepspeed is built below from its sdist; its CUDA ops compile at first use).
WHEELS=(
  hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3
  hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
  wandb==0.31.0 platformdirs==4.14.7 sniffio==1.3.1 distro==1.9.0 cwevals==0.0.1b1
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2
  opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-otlp-proto-http==1.45.2
  opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-http-transport==0.66b2
  opentelemetry-exporter-otlp-common==0.66b2 googleapis-common-protos==1.76.0
)
DEEPSPEED=deepspeed==0.19.8
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64)

pack() {
  mkdir -p .whl
  [ -n "$(ls .whl/deepspeed-*.whl 2>/dev/null)" ] || pip wheel -q --no-deps --no-build-isolation "$DEEPSPEED" -w .whl
  local plat=() spec name
  for p in "${PLATFORMS[@]}"; do plat+=(--platform "$p"); done
  for spec in "${WHEELS[@]}"; do
    name=${spec%%==*}
    if ls .whl/ | grep -qi "^${name//-/[-_]}-${spec##*==}-"; then continue; fi
    # A binary for CPython 3.12 on x86-64 Linux; a pure-Python sdist (antlr4) is built into one.
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${plat[@]}" -d .whl "$spec" 2>/dev/null || pip wheel -q --no-deps "$spec" -w .whl
  done
  ls .whl && du -sh .whl
}

check_wheels() {
  local missing=0 spec name
  for spec in "${WHEELS[@]}" "$DEEPSPEED"; do
    name=${spec%%==*}
    if ! ls .whl/ 2>/dev/null | grep -qi "^${name//-/[-_]}-${spec##*==}-"; then echo "missing wheel: $spec"; missing=1; fi
  done
  [ $missing = 0 ] || { echo "run 'bash scripts/gpu_session.sh pack' first (here, with network)"; return 1; }
}

DRY=0 LOCAL=0
read -r -a EXTRA <<<"${EXTRA:-}"            # appended to each train.py command (CPU checks only)
read -r -a EVAL_EXTRA <<<"${EVAL_EXTRA:-}"  # appended to the eval.py command (CPU checks only)
KILL_AT=${KILL_AT:-100}                    # the checkpoint step after which the run is killed
step() {  # run (or, dry, print) one command, its output into the log named first
  local log=$1; shift
  echo "+ $*" | tee -a "$log"
  [ $DRY = 1 ] && return 0
  # A failure is recorded and the session goes on: one call should bring back all it can.
  "$@" 2>&1 | tee -a "$log" || { echo "FAILED: $*" | tee -a "$log" "$OUT/failures.txt"; return 0; }
}

install() {
  if [ $LOCAL = 1 ]; then export PYTHONPATH=$ROOT WANDB_SILENT=true PYTHONUNBUFFERED=1; return; fi
  check_wheels
  if [ $DRY = 1 ]; then echo "+ pip install --target /tmp/site .whl/*.whl"; return; fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  # The README says `python`; the image may have only python3.
  mkdir -p /tmp/msd-bin && ln -sf "$(command -v python3)" /tmp/msd-bin/python
  export PYTHONPATH=/tmp/site:$ROOT PATH=/tmp/msd-bin:/tmp/site/bin:$PATH
  export WANDB_SILENT=true PYTHONUNBUFFERED=1
  {
    nvidia-smi || true
    python3 -c "import torch, transformers, deepspeed, hydra, datasets; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__, 'hydra', hydra.__version__, 'datasets', datasets.__version__); print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO GPU')"
  } 2>&1 | tee "$OUT/env.txt"
}

gpu_slug() {
  if [ $DRY = 1 ] || ! command -v nvidia-smi >/dev/null; then echo cpu; return; fi
  nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE 'h100|h200|a100|l40s' | head -1 \
    | tr 'A-Z' 'a-z' || echo gpu
}

readme() {
  local d="$OUT/readme" log="$OUT/readme/log.txt"
  mkdir -p "$d"
  [ $DRY = 1 ] || rm -rf runs/tiny runs/tiny-resume  # fresh runs: nothing to resume from
  # The README's commands exactly (CUDA is picked automatically; bf16 on CUDA by default).
  step "$log" deepspeed train.py stage=1 "${EXTRA[@]}"
  step "$log" deepspeed train.py stage=2 "${EXTRA[@]}"
  step "$log" python eval.py draft=runs/tiny/stage2/final out=runs/tiny/eval "${EVAL_EXTRA[@]}"
  # Kill and relaunch: SIGKILL the whole launcher group once the step-100 checkpoint exists.
  local cmd=(deepspeed train.py stage=1 run_dir=runs/tiny-resume "${EXTRA[@]}") first
  first=runs/tiny-resume/stage1/checkpoints/step-$(printf %06d "$KILL_AT")/recipe_state.json
  echo "+ setsid ${cmd[*]} & (SIGKILL after $first)" | tee -a "$log"
  if [ $DRY = 0 ]; then
    setsid "${cmd[@]}" >>"$d/killed-run.log" 2>&1 &
    local pid=$! waited=0
    while [ ! -f "$first" ] && kill -0 $pid 2>/dev/null && [ $waited -lt 1500 ]; do sleep 0.2; waited=$((waited + 1)); done
    kill -9 -- -$pid 2>/dev/null || true
    wait $pid 2>/dev/null || true
  fi
  step "$log" "${cmd[@]}"
  if [ $DRY = 0 ]; then
    python3 - "$d" <<'EOF' 2>&1 | tee -a "$log" || echo "FAILED: resume check" | tee -a "$OUT/failures.txt"
import json, sys
from pathlib import Path
from safetensors.torch import load_file
d = Path(sys.argv[1])
a = load_file("runs/tiny/stage1/final/model.safetensors")
b = load_file("runs/tiny-resume/stage1/final/model.safetensors")
diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
log = (d / "log.txt").read_text()
loss = lambda p: [json.loads(x)["loss"] for x in Path(p).read_text().splitlines() if '"loss"' in x and "val/" not in x]
la, lb = loss("runs/tiny/stage1/metrics.jsonl"), loss("runs/tiny-resume/stage1/metrics.jsonl")
r = {"resumed": "resuming from" in log, "max_abs_weight_diff_vs_uninterrupted": diff,
     "bit_identical_weights": diff == 0.0, "losses_identical": la == lb,
     "max_abs_loss_diff": max((abs(x - y) for x, y in zip(la, lb)), default=None), "n_losses": [len(la), len(lb)]}
(d / "resume.json").write_text(json.dumps(r, indent=1) + "\n")
print(json.dumps(r))
EOF
    for s in 1 2; do cp runs/tiny/stage$s/metrics.jsonl "$d/stage$s-metrics.jsonl" || true; done
    cp runs/tiny/eval/report.json runs/tiny/eval/report.md "$d/" 2>/dev/null || true
  fi
}

throughput() {
  local shape=${SHAPE:-llava15_7b} gpu dir log="$OUT/throughput-log.txt"
  dir=/tmp/msd-$shape
  gpu=$(gpu_slug)
  local out="$OUT/train-$shape-$gpu.json"
  [ -f "$dir/config.json" ] || step "$log" python scripts/make_large_target.py "$dir" --shape "$shape"
  step "$log" python scripts/bench_train.py --target "$dir" --seq-len 2048 --micro-batches 1,2,4 \
    --steps 10 --warmup 3 --split-steps 3 --profile --out "$out" \
    --note "7B shape, random bf16 weights; online features, ZeRO-2, one GPU; scripts/gpu_session.sh"
  if [ $DRY = 0 ] && grep -q '"oom": true' "$out"; then
    local sizes
    sizes=$(python3 -c "import json,sys; print(','.join(str(r['micro_batch_size']) for r in json.load(open(sys.argv[1]))['rows'] if r.get('oom')))" "$out")
    step "$log" python scripts/bench_train.py --target "$dir" --seq-len 2048 --micro-batches "$sizes" \
      --gradient-checkpointing --steps 10 --warmup 3 --split-steps 3 --out "${out%.json}-gc.json"
  fi
}

decode() {
  local gpu c log="$OUT/decode-log.txt"
  gpu=$(gpu_slug)
  for c in ${DECODE_SHAPES:-llava15_7b llava15_13b qwen2vl_7b}; do
    step "$log" python scripts/bench_gpu.py --config "$c" --device "${DEVICE:-cuda}" \
      --out "$OUT/decode-$c-$gpu.json" --note "random bf16 weights; scripts/gpu_session.sh"
  done
}

main() {
  local cmd=${1:-} part=all
  shift || true
  for a in "$@"; do
    case $a in
      --dry-run) DRY=1 ;;
      --local) LOCAL=1 ;;
      all|readme|throughput|decode) part=$a ;;
      *) echo "unknown argument $a"; exit 2 ;;
    esac
  done
  case $cmd in
    pack) pack ;;
    run)
      OUT=${OUT:-/tmp/gpu-out}
      mkdir -p "$OUT"
      install
      if [ $part = all ] || [ $part = readme ]; then readme; fi
      if [ $part = all ] || [ $part = throughput ]; then throughput; fi
      if [ $part = decode ]; then decode; fi
      echo "results under $OUT"
      if [ -f "$OUT/failures.txt" ]; then cat "$OUT/failures.txt"; exit 1; fi ;;
    *) sed -n '2,20p' "$0"; exit 2 ;;
  esac
}

main "$@"
