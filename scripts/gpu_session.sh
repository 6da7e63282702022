#!/usr/bin/env bash
# The GPU session in one call (issue 32). A GPU is lent for 15 minutes of device time per
# issue, one chip, every call together with the machine's start (1-2 min) and idle time; at
# most 10 minutes per call; 64 MiB of working tree and carried files travel with a call.
#
#   here:  bash scripts/gpu_session.sh pack [--no-wandb]   # wheels into .whl/ (git-ignored), size-checked
#          bash scripts/gpu_session.sh run --dry-run        # the plan, each part's estimate, the budget
#   there: bash scripts/gpu_session.sh run                  # the one call: setup readme decode train
#          bash scripts/gpu_session.sh run extra            # the optional second call (what did not fit)
#          bash scripts/gpu_session.sh run PART...          # only these parts (a rerun after a fix)
#   here:  bash scripts/gpu_session.sh unpack DIR           # what came back -> benchmarks/gpu/
#
# Parts (in this order; each one's results land in $OUT/<part>.tar.gz as soon as it ends):
#   setup           install .whl/ into /tmp/site; env.txt (GPU, driver, versions)
#   readme          the README's commands on CUDA with the tiny target in bf16 (short step
#                   counts): deepspeed train.py stage=1, stage=2, python eval.py (the decoder's
#                   exactness against plain decoding), then a SIGKILL mid-run and a resume
#   decode          lab/scripts/bench_gpu.py at the LLaVA-1.5-7B shape, repeats cut to fit
#   train           lab/scripts/bench_train.py at the 7B shape, one micro-batch size (MICRO_BATCH,
#                   default 2); gradient checkpointing if it runs out of memory
# extra call: decode_13b, decode_qwen2vl (the other decode shapes), train_mb (micro-batches 1,4)
#
# The budget (BUDGET_MIN, default 8) is printed at the start and checked before each part: a
# part whose estimate does not fit in what is left is skipped with a line saying so, and a
# running part is stopped at its share (its estimate + half, at least 30 s, never past the
# budget). A part's failure never stops the next. EST_<part>=seconds overrides an estimate;
# DRY_TOOK="readme=300 ..." makes the dry run's clock take that long for a part (to see a skip).
# --local runs the same flow with this machine's packages and CPU-sized settings (no install).
# Output under $OUT (default /tmp/gpu-out), at most 8 files (what a device call brings back):
# session.log, env.txt, summary.json and one <part>.tar.gz per part that ran.
set -uo pipefail  # not -e: a failed step is recorded and the session goes on
SELF=$(realpath "$0")
cd "$(dirname "$SELF")/.."
ROOT=$PWD

# ----------------------------------------------------------------------------- wheels
# What the training stack needs that the GPU image (torch 2.11, transformers 5.17, python 3.12)
# lacks, pinned to this project's environment; deepspeed is built from its sdist (pure Python;
# its CUDA ops compile at first use, and the recipe uses none: torch's AdamW).
WHEELS=(
  hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3
  hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
)
# wandb (imported only when logging.wandb.mode is not disabled) and what only it needs: 20.5 of
# the 26.3 MiB. `pack --no-wandb` leaves them out; `run` then adds logging.wandb.mode=disabled.
WANDB_WHEELS=(
  wandb==0.31.0 platformdirs==4.14.7 sniffio==1.3.1 distro==1.9.0 cwevals==0.0.1b1
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2
  opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-otlp-proto-http==1.45.2
  opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-http-transport==0.66b2
  opentelemetry-exporter-otlp-common==0.66b2 googleapis-common-protos==1.76.0
)
DEEPSPEED=deepspeed==0.19.8
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64)
# What the wheels require that the GPU image already has (its package list as read 2026-11-17):
# the pack step warns about any requirement found in neither.
IMAGE_HAS=(anyio httpx typing-extensions filelock numpy pyarrow pandas tqdm xxhash fsspec huggingface-hub
           packaging pyyaml einops msgpack ninja psutil py-cpuinfo torch protobuf requests click)
WHL=${WHL:-.whl}
CARRY_LIMIT_MIB=${CARRY_LIMIT_MIB:-64}

wheel_present() {  # wheel_present NAME==VERSION
  local spec=$1 name=${1%%==*}
  ls "$WHL"/ 2>/dev/null | grep -qi "^${name//-/[-_]}-${spec##*==}-"
}

pack() {
  local nowandb=0 a
  for a in "$@"; do case $a in --no-wandb) nowandb=1 ;; *) echo "unknown argument $a"; exit 2 ;; esac; done
  local specs=("${WHEELS[@]}")
  [ $nowandb = 1 ] || specs+=("${WANDB_WHEELS[@]}")
  mkdir -p "$WHL"
  wheel_present "$DEEPSPEED" || pip wheel -q --no-deps --no-build-isolation "$DEEPSPEED" -w "$WHL" || exit 1
  local plat=() spec p
  for p in "${PLATFORMS[@]}"; do plat+=(--platform "$p"); done
  for spec in "${specs[@]}"; do
    wheel_present "$spec" && continue
    # A binary for CPython 3.12 on x86-64 Linux; a pure-Python sdist (antlr4) is built into one.
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${plat[@]}" -d "$WHL" "$spec" 2>/dev/null || pip wheel -q --no-deps "$spec" -w "$WHL" || exit 1
  done
  # Anything else in .whl/ (an older pin, wandb after --no-wandb) would travel and install too:
  # two versions of one package stop the whole install there.
  local f keep
  for f in "$WHL"/*.whl; do
    keep=0
    for spec in "${specs[@]}" "$DEEPSPEED"; do
      [[ $(basename "$f" | tr 'A-Z_' 'a-z-') == "$(tr 'A-Z_' 'a-z-' <<<"${spec%%==*}")-${spec##*==}-"* ]] && keep=1
    done
    [ $keep = 1 ] || { echo "removing $(basename "$f") (not in this pack's list)"; rm -f "$f"; }
  done
  check_wheels
}

tree_bytes() {  # what travels besides the carried paths: tracked and untracked-not-ignored files
  git ls-files -z --cached --others --exclude-standard 2>/dev/null | xargs -0 -r stat -c %s 2>/dev/null \
    | awk '{s += $1} END {print s + 0}'
}

check_wheels() {  # sizes against what a device call carries, requirements against the image
  WHL=$WHL LIMIT=$CARRY_LIMIT_MIB TREE=$(tree_bytes) IMAGE_HAS="${IMAGE_HAS[*]}" python3 - <<'EOF'
import os, re, sys, zipfile
from pathlib import Path

from packaging.requirements import Requirement

# the GPU box's interpreter: requirements whose markers are false there are not needed
GPU_BOX = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
whl, limit, tree = Path(os.environ["WHL"]), float(os.environ["LIMIT"]), int(os.environ["TREE"])
wheels = sorted(whl.glob("*.whl"), key=lambda p: -p.stat().st_size)
mib = lambda b: b / 2**20
total = sum(p.stat().st_size for p in wheels)
print(f"wheels: {len(wheels)} files, {mib(total):.1f} MiB in {whl}/; working tree {mib(tree):.1f} MiB; "
      f"together {mib(total + tree):.1f} MiB of the {limit:g} MiB a device call carries")
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
have = {norm(p.name.split("-")[0]) for p in wheels} | {norm(x) for x in os.environ["IMAGE_HAS"].split()}
missing = set()
for p in wheels:
    try:
        meta = next(n for n in zipfile.ZipFile(p).namelist() if n.endswith(".dist-info/METADATA"))
        lines = zipfile.ZipFile(p).read(meta).decode().splitlines()
    except (StopIteration, zipfile.BadZipFile):
        continue  # not a real wheel (a test's stand-in)
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is None or req.marker.evaluate(GPU_BOX):
            if norm(req.name) not in have:
                missing.add(f"{norm(req.name)} (for {p.name.split('-')[0]})")
for m in sorted(missing):
    print(f"warning: required, but neither a wheel here nor in the GPU image's package list: {m}")
if total + tree > limit * 2**20:
    print(f"TOO BIG: {mib(total + tree):.1f} MiB would travel, over the {limit:g} MiB limit of a device call. "
          "Biggest wheels:")
    for p in wheels[:5]:
        print(f"  {mib(p.stat().st_size):6.1f} MiB  {p.name}")
    print("Drop what the run can do without (`pack --no-wandb` leaves wandb out: 20.5 MiB; the run then "
          "disables wandb logging), or make the working tree smaller.")
    sys.exit(1)
EOF
  local rc=$? spec missing=0
  for spec in "${WHEELS[@]}" "$DEEPSPEED"; do
    wheel_present "$spec" || { echo "missing wheel: $spec"; missing=1; }
  done
  [ $missing = 0 ] || echo "run 'bash scripts/gpu_session.sh pack' first (here, with network)"
  [ $rc = 0 ] && [ $missing = 0 ]
}

# ----------------------------------------------------------------------------- settings
DRY=${DRY:-0} LOCAL=${LOCAL:-0}
OUT=${OUT:-/tmp/gpu-out}
WORK=${WORK:-/tmp/msd-gpu-work}      # each part's files, packed into $OUT/<part>.tar.gz when it ends
BUDGET_MIN=${BUDGET_MIN:-8}
BUDGET=$((BUDGET_MIN * 60))
MAIN_PARTS=(setup readme decode train)
EXTRA_PARTS=(setup decode_13b decode_qwen2vl train_mb)
ALL_PARTS=(setup readme decode train decode_13b decode_qwen2vl train_mb)
# Estimates in seconds. On an H100 (no GPU run yet: reasoned, to be replaced by the first
# summary.json's measured seconds): setup = pip install + imports; readme = four launches of
# ~30 s each + 300 tiny steps + the eval; decode = building the random 7B model on the GPU,
# 5 repeats of each measurement; train = writing the 13.5 GB 7B folder, loading it, 18 steps.
declare -A EST_GPU=([setup]=40 [readme]=165 [decode]=120 [train]=150
                    [decode_13b]=150 [decode_qwen2vl]=120 [train_mb]=170)
# --local: this project's 2-core CPU, CPU-sized settings. Seen 2026-11-26 with nice under a load
# average of ~10 (other jobs): setup 11 s, readme 8:03, decode 24 s, train 70 s; on a quiet machine
# the readme part should take about a third of that. Under load, give it BUDGET_MIN=20.
declare -A EST_CPU=([setup]=10 [readme]=300 [decode]=60 [train]=90
                    [decode_13b]=60 [decode_qwen2vl]=60 [train_mb]=120)
if [ "$LOCAL" = 1 ]; then
  DEV=cpu RUN=${RUN:-runs/gpu-local}
  S1=${S1:-4} S2=${S2:-4} CKPT=${CKPT:-2} KILL_AT=${KILL_AT:-2} EVAL_ITEMS=${EVAL_ITEMS:-1}
  VAL_EVERY=${VAL_EVERY:-1000} TRAIN_LOCAL=(data.max_heldout=8)  # validation: at the end, on 8 conversations
  DECODE_ARGS=${DECODE_ARGS:---repeats 1 --warmup 0 --new-tokens 4 --hf-caches dynamic}
  SHAPE_ARGS=(--layers 1 --scale small) SEQ=${SEQ:-1024} MICRO_BATCH=${MICRO_BATCH:-1}
  TRAIN_ARGS=${TRAIN_ARGS:---steps 2 --warmup 1 --split-steps 1 --samples 4}
  TRAIN_MB_SIZES=${TRAIN_MB_SIZES:-2}
else
  DEV=cuda RUN=${RUN:-runs/tiny}    # runs/tiny: the README's commands exactly
  S1=${S1:-100} S2=${S2:-50} CKPT=${CKPT:-50} KILL_AT=${KILL_AT:-50} EVAL_ITEMS=${EVAL_ITEMS:-4}
  VAL_EVERY=${VAL_EVERY:-50} TRAIN_LOCAL=()
  DECODE_ARGS=${DECODE_ARGS:---repeats 5 --warmup 1 --hf-caches dynamic}
  SHAPE_ARGS=() SEQ=${SEQ:-2048} MICRO_BATCH=${MICRO_BATCH:-2}
  TRAIN_ARGS=${TRAIN_ARGS:---steps 10 --warmup 3 --split-steps 3 --profile}
  TRAIN_MB_SIZES=${TRAIN_MB_SIZES:-1,4}
fi
read -r -a EXTRA_ARGS <<<"${EXTRA:-}"           # appended to each train.py command
read -r -a EVAL_EXTRA_ARGS <<<"${EVAL_EXTRA:-}" # appended to each eval.py command
declare -A WHAT=(
  [setup]="install .whl/ into /tmp/site; env.txt (GPU, driver, versions)"
  [readme]="README journey on CUDA, tiny target, bf16: deepspeed train.py stage=1, stage=2, python eval.py (exactness), kill + resume"
  [decode]="decoder table at the LLaVA-1.5-7B shape (lab/scripts/bench_gpu.py): plain vs generate() vs bandwidth limit, verify by tree size, drafting, cycle/step"
  [train]="online training throughput at the 7B shape (lab/scripts/bench_train.py), micro-batch $MICRO_BATCH, seq $SEQ: target tokens/s, peak memory"
  [decode_13b]="decoder table at the LLaVA-1.5-13B shape"
  [decode_qwen2vl]="decoder table at the Qwen2-VL-7B shape"
  [train_mb]="7B-shape training throughput at micro-batches $TRAIN_MB_SIZES"
)

estimate() {  # estimate PART: seconds (EST_<part> overrides)
  local v="EST_$1"
  if [ -n "${!v:-}" ]; then echo "${!v}"; elif [ "$LOCAL" = 1 ]; then echo "${EST_CPU[$1]}"; else echo "${EST_GPU[$1]}"; fi
}
mmss() { printf '%d:%02d' $(($1 / 60)) $(($1 % 60)); }
minutes() { local t=$((($1 + 5) / 6)); [ $((t % 10)) = 0 ] && echo $((t / 10)) || echo "$((t / 10)).$((t % 10))"; }  # up to a tenth
# A running part may take its estimate plus half (at least MIN_SLACK=30 s), never past the budget.
share() {
  local est=$1 left=$2 slack=${MIN_SLACK:-30} s
  s=$((est + (est / 2 > slack ? est / 2 : slack)))
  echo $((s < left ? s : left))
}

# ----------------------------------------------------------------------------- steps
FAILED=0
step() {  # step LOG CMD...: run (dry: print) one command, its output into LOG too
  local log=$1; shift
  echo "+ $*" | tee -a "$log"
  [ "$DRY" = 1 ] && return 0
  "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" != 0 ]; then echo "FAILED (exit $rc): $*" | tee -a "$log" "$WORK/failures.txt"; FAILED=1; fi
  return 0
}

gpu_slug() {
  if [ "$LOCAL" = 1 ] || ! command -v nvidia-smi >/dev/null; then echo "$([ "$DRY" = 1 ] && [ "$LOCAL" = 0 ] && echo gpu || echo cpu)"; return; fi
  local s
  s=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oiE 'gh200|h100|h200|a100|l40s' \
      | head -1 | tr 'A-Z' 'a-z')
  echo "${s:-gpu}"
}

wandb_off() {  # wandb absent (pack --no-wandb): the run logs without it
  if [ "$DRY" = 0 ] && ! python3 -c "import wandb" 2>/dev/null; then echo logging.wandb.mode=disabled; fi
}

# ----------------------------------------------------------------------------- parts
part_setup() {
  local log=$WORK/setup/log.txt env=$WORK/setup/env.txt
  if [ "$LOCAL" = 0 ]; then
    check_wheels || FAILED=1
    if [ "$DRY" = 1 ]; then
      echo "+ python3 -m pip install --no-index --no-deps --target /tmp/site $WHL/*.whl"
    elif [ "$(ls "$WHL"/*.whl 2>/dev/null | xargs -r -n1 basename | sort)" = "$(cat /tmp/site/.msd-wheels 2>/dev/null)" ]; then
      echo "wheels already installed in /tmp/site (a warm machine)"
    else
      step "$log" python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$WHL"/*.whl
      [ $FAILED = 1 ] || ls "$WHL"/*.whl | xargs -n1 basename | sort >/tmp/site/.msd-wheels
    fi
    # The README says `python`; the image may have only python3.
    [ "$DRY" = 1 ] || { mkdir -p /tmp/msd-bin && ln -sf "$(command -v python3)" /tmp/msd-bin/python; }
  fi
  echo "+ env.txt: nvidia-smi, versions"
  [ "$DRY" = 1 ] && return 0
  {
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm,clocks.max.mem --format=csv \
      2>/dev/null || echo "no nvidia-smi"
    nvidia-smi 2>/dev/null
    python3 - <<'EOF'
import importlib.metadata as md, os, platform
import torch
print("python", platform.python_version(), platform.platform(), "cpus", os.cpu_count())
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", torch.cuda.get_device_name(), f"{p.total_memory / 2**30:.1f} GiB", f"sm_{p.major}{p.minor}",
          p.multi_processor_count, "SMs")
else:
    print("gpu NONE (torch sees no CUDA device)")
for name in ("transformers", "deepspeed", "hydra-core", "omegaconf", "datasets", "wandb", "pydantic", "peft",
             "safetensors", "huggingface-hub", "pyarrow", "fsspec", "accelerate", "numpy", "pillow", "triton"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "MISSING")
EOF
    python3 -c "import deepspeed, hydra, datasets; print('imports: deepspeed, hydra, datasets ok')"
  } >"$env" 2>&1 || FAILED=1
  cat "$env"
  cp "$env" "$OUT/env.txt"
}

readme_results() {  # copy what exists so far into the part's folder (a part stopped later keeps it)
  local d=$WORK/readme s
  [ "$DRY" = 1 ] && return 0
  for s in 1 2; do cp "$RUN/stage$s/metrics.jsonl" "$d/stage$s-metrics.jsonl" 2>/dev/null; done
  cp "$RUN-resume/stage1/metrics.jsonl" "$d/resume-stage1-metrics.jsonl" 2>/dev/null
  cp "$RUN"/eval/report.json "$RUN"/eval/report.md "$RUN"/eval/samples.jsonl "$d/" 2>/dev/null
  return 0
}

part_readme() {
  local d=$WORK/readme log=$WORK/readme/log.txt run=() nowandb
  nowandb=$(wandb_off)
  [ "$RUN" = runs/tiny ] || run=("run_dir=$RUN")
  local s1=("${run[@]}" "train.max_steps=$S1" "checkpoint.every=$CKPT" "eval.every=$VAL_EVERY" "${TRAIN_LOCAL[@]}"
            $nowandb "${EXTRA_ARGS[@]}")
  local s2=("${run[@]}" "train.max_steps=$S2" "stage.curriculum.ramp_steps=$((S2 / 2))" "checkpoint.every=$CKPT"
            "eval.every=$VAL_EVERY" "${TRAIN_LOCAL[@]}" $nowandb "${EXTRA_ARGS[@]}")
  [ "$DRY" = 1 ] || rm -rf "$RUN" "$RUN-resume"  # fresh runs: nothing to resume from
  # The README's commands (CUDA is picked automatically; bf16 on CUDA by default), short.
  step "$log" deepspeed train.py stage=1 "${s1[@]}"
  readme_results
  step "$log" deepspeed train.py stage=2 "${s2[@]}"
  readme_results
  # eval.py: plain decoding and the tree decoder on the same prompts; report.json says whether
  # the outputs match (exact_match_fraction, near_tie vs real mismatches in bf16).
  step "$log" python eval.py "draft=$RUN/stage2/final" "out=$RUN/eval" "bench.max_per_category=$EVAL_ITEMS" \
    "${EVAL_EXTRA_ARGS[@]}"
  readme_results
  # Kill and relaunch: SIGKILL the launcher's whole group once the KILL_AT checkpoint exists.
  local cmd=(deepspeed train.py stage=1 "run_dir=$RUN-resume" "${s1[@]:${#run[@]}}") first
  first=$RUN-resume/stage1/checkpoints/step-$(printf %06d "$KILL_AT")/recipe_state.json
  echo "+ setsid ${cmd[*]} & (SIGKILL after $first)" | tee -a "$log"
  if [ "$DRY" = 0 ]; then
    setsid "${cmd[@]}" >>"$d/killed-run.log" 2>&1 &
    local pid=$! until=$(($(date +%s) + ${PART_LEFT:-300} / 2))
    echo "$pid" >>"$WORK/groups"  # the watchdog kills this group too if the part runs out of time
    while [ ! -f "$first" ] && kill -0 $pid 2>/dev/null && [ "$(date +%s)" -lt $until ]; do sleep 0.2; done
    [ -f "$first" ] && echo "killed after $first" | tee -a "$log" || echo "FAILED: no $first to kill after" \
      | tee -a "$log" "$WORK/failures.txt"
    kill -9 -- -$pid 2>/dev/null
    wait $pid 2>/dev/null
  fi
  step "$log" "${cmd[@]}"
  [ "$DRY" = 1 ] && return 0
  RUN=$RUN python3 - "$d" <<'EOF' 2>&1 | tee -a "$log"
import json, os, sys
from pathlib import Path
from safetensors.torch import load_file
d, run = Path(sys.argv[1]), os.environ["RUN"]
a = load_file(f"{run}/stage1/final/model.safetensors")
b = load_file(f"{run}-resume/stage1/final/model.safetensors")
diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
loss = lambda p: [json.loads(x)["loss"] for x in Path(p).read_text().splitlines() if '"loss"' in x and "val/" not in x]
la, lb = loss(f"{run}/stage1/metrics.jsonl"), loss(f"{run}-resume/stage1/metrics.jsonl")
r = {"resumed": "resuming from" in (d / "log.txt").read_text(), "max_abs_weight_diff_vs_uninterrupted": diff,
     "bit_identical_weights": diff == 0.0, "losses_identical": la == lb,
     "max_abs_loss_diff": max((abs(x - y) for x, y in zip(la, lb)), default=None), "n_losses": [len(la), len(lb)]}
(d / "resume.json").write_text(json.dumps(r, indent=1) + "\n")
print("resume:", json.dumps(r))
EOF
  [ "${PIPESTATUS[0]}" = 0 ] || { echo "FAILED: resume check" | tee -a "$WORK/failures.txt"; FAILED=1; }
  readme_results
  python3 - "$d/report.json" <<'EOF' 2>/dev/null | tee -a "$log"
import json, sys
r = json.load(open(sys.argv[1]))
o = r.get("overall", r)
print("eval:", {k: o.get(k) for k in ("outputs_match_ar", "exact_match_fraction", "near_tie_mismatches",
                                      "real_mismatches", "tau", "speedup") if k in o})
EOF
  return 0
}

decode_shape() {  # decode_shape PART CONFIG
  local part=$1 c=$2 gpu
  gpu=$(gpu_slug)
  read -r -a args <<<"$DECODE_ARGS"
  step "$WORK/$part/log.txt" python lab/scripts/bench_gpu.py --config "$c" --device "$DEV" "${args[@]}" \
    --out "$WORK/$part/decode-$c-$gpu.json" --note "random weights; scripts/gpu_session.sh part $part"
}
part_decode() { decode_shape decode "$([ "$LOCAL" = 1 ] && echo small || echo llava15_7b)"; }
part_decode_13b() { decode_shape decode_13b "$([ "$LOCAL" = 1 ] && echo small || echo llava15_13b)"; }
part_decode_qwen2vl() { decode_shape decode_qwen2vl "$([ "$LOCAL" = 1 ] && echo small_qwen || echo qwen2vl_7b)"; }

train_sizes() {  # train_sizes PART SIZES: bench_train.py on the 7B-shaped folder, then OOM sizes with checkpointing
  local part=$1 sizes=$2 shape=llava15_7b gpu log dir out
  gpu=$(gpu_slug) log=$WORK/$part/log.txt
  dir=/tmp/msd-$shape$([ "$LOCAL" = 1 ] && echo -small)
  out=$WORK/$part/train-$shape-$gpu$([ "$part" = train ] || echo "-mb${sizes//,/-}").json
  read -r -a args <<<"$TRAIN_ARGS"
  if [ "$DRY" = 1 ] || [ ! -f "$dir/config.json" ]; then  # a warm machine keeps the folder
    step "$log" python lab/scripts/make_large_target.py "$dir" --shape "$shape" "${SHAPE_ARGS[@]}"
  fi
  step "$log" python lab/scripts/bench_train.py --target "$dir" --seq-len "$SEQ" --micro-batches "$sizes" "${args[@]}" \
    --out "$out" --note "$([ "$LOCAL" = 1 ] && echo "7B shape scaled down (--layers 1 --scale small), CPU check" ||
      echo "7B shape, random bf16 weights; online features, ZeRO-2, one GPU"); gpu_session.sh part $part"
  [ "$DRY" = 1 ] && { echo "(sizes that run out of memory: again with --gradient-checkpointing, if time is left)"; return 0; }
  grep -q '"oom": true' "$out" 2>/dev/null || return 0
  local oom left
  oom=$(python3 -c "import json,sys; print(','.join(str(r['micro_batch_size']) for r in json.load(open(sys.argv[1]))['rows'] if r.get('oom')))" "$out")
  left=$((${PART_DEADLINE:-0} - $(date +%s)))
  if [ $left -lt 60 ]; then
    echo "SKIP gradient checkpointing for micro-batch $oom (out of memory): ${left} s left of this part's share" | tee -a "$log"
    return 0
  fi
  local noprof=() a
  for a in "${args[@]}"; do [ "$a" = --profile ] || noprof+=("$a"); done
  step "$log" python lab/scripts/bench_train.py --target "$dir" --seq-len "$SEQ" --micro-batches "$oom" \
    --gradient-checkpointing "${noprof[@]}" --out "${out%.json}-gc.json"
}
part_train() { train_sizes train "$MICRO_BATCH"; }
part_train_mb() { train_sizes train_mb "$TRAIN_MB_SIZES"; }

# ----------------------------------------------------------------------------- the session
STATUS=()  # "part status seconds estimate share" lines, for summary.json

total_line() {  # total_line PARTS...: the sum of their estimates against the budget
  local p total=0
  for p in "$@"; do total=$((total + $(estimate "$p"))); done
  echo "total: $(minutes $total) min (budget $BUDGET_MIN min)"
}

plan() {  # plan PARTS...: the budget and each part's estimate; the total is the last line
  local p est
  echo "budget: $BUDGET_MIN min ($BUDGET s) for this call; parts in order, each started only if its estimate fits in what is left"
  echo "plan ($([ "$LOCAL" = 1 ] && echo "this CPU, --local" || echo "estimates for an H100"); EST_<part>=seconds overrides one):"
  for p in "$@"; do
    est=$(estimate "$p")
    printf '  %-15s %5s  %s\n' "$p" "$(mmss "$est")" "${WHAT[$p]}"
  done
  total_line "$@"
}

took_in_dry_run() {  # DRY_TOOK="readme=300 decode=20": the dry run's clock for PART
  local kv
  for kv in ${DRY_TOOK:-}; do [ "${kv%%=*}" = "$1" ] && { echo "${kv#*=}"; return; }; done
  estimate "$1"
}

run_part() {  # run_part PART LIMIT: in its own process group, stopped at LIMIT seconds
  local p=$1 limit=$2 pid rc t0 dead
  t0=$(date +%s) dead=$((t0 + limit))
  : >"$WORK/groups"
  PART_DEADLINE=$dead PART_LEFT=$limit setsid bash "$SELF" __part "$p" > >(tee -a "$SLOG") 2>&1 &
  pid=$!
  while kill -0 $pid 2>/dev/null; do
    if [ "$(date +%s)" -ge $dead ]; then
      echo "TIMEOUT: part $p stopped at its share of $(mmss "$limit")" | tee -a "$SLOG" "$WORK/failures.txt"
      local g
      for g in $pid $(cat "$WORK/groups"); do kill -TERM -- -"$g" 2>/dev/null; done
      sleep 3
      for g in $pid $(cat "$WORK/groups"); do kill -KILL -- -"$g" 2>/dev/null; done
      wait $pid 2>/dev/null
      return 124
    fi
    sleep 1
  done
  wait $pid
  rc=$?
  for g in $(cat "$WORK/groups"); do kill -KILL -- -"$g" 2>/dev/null; done  # nothing the part started outlives it
  return $rc
}

finish_part() {  # the part's folder -> $OUT/<part>.tar.gz (files over 8 MiB left out, listed)
  local p=$1
  [ -d "$WORK/$p" ] && [ "$p" != setup ] || return 0
  find "$WORK/$p" -type f -size +8388608c -printf '%P (%s bytes) left out: over 8 MiB\n' >"$WORK/$p/left-out.txt"
  [ -s "$WORK/$p/left-out.txt" ] || rm -f "$WORK/$p/left-out.txt"
  (cd "$WORK" && find "$p" -type f -size -8388609c -print0 | tar czf "$OUT/$p.tar.gz" --null -T -)
}

session() {  # session PARTS...
  local p est left limit t0 el rc status took
  if [ "$DRY" = 1 ]; then
    WORK=$(mktemp -d) SLOG=/dev/null
  else
    SLOG=$OUT/session.log
    mkdir -p "$OUT" "$WORK" && rm -rf "${WORK:?}"/* && : >"$SLOG"
  fi
  T0=$(date +%s) SIM=0
  elapsed() { if [ "$DRY" = 1 ]; then echo $SIM; else echo $(($(date +%s) - T0)); fi; }
  if [ "$LOCAL" = 0 ]; then
    export PYTHONPATH=/tmp/site:$ROOT PATH=/tmp/msd-bin:/tmp/site/bin:$PATH
  else
    export PYTHONPATH=$ROOT
  fi
  export WANDB_SILENT=true PYTHONUNBUFFERED=1 OUT WORK DRY LOCAL
  {
    echo "$(date -u +%FT%TZ) scripts/gpu_session.sh run $* ($([ "$DRY" = 1 ] && echo "dry run" || echo "$OUT"))"
    plan "$@"
  } | tee -a "$SLOG"
  for p in "$@"; do
    est=$(estimate "$p") el=$(elapsed)
    left=$((BUDGET - el))
    if [ "$est" -gt "$left" ]; then
      echo "[$(mmss "$el")] SKIP $p: its estimate $(mmss "$est") is over the $(mmss $((left > 0 ? left : 0))) left of the budget" \
        | tee -a "$SLOG"
      STATUS+=("$p skipped 0 $est 0")
      continue
    fi
    limit=$(share "$est" "$left")
    echo "[$(mmss "$el")] == $p (estimate $(mmss "$est"), stopped at $(mmss "$limit") if still running)" \
      | tee -a "$SLOG"
    mkdir -p "$WORK/$p"
    if [ "$DRY" = 1 ]; then
      FAILED=0 PART_LEFT=$limit "part_$p"
      took=$(took_in_dry_run "$p")
      if [ "$took" -gt "$limit" ]; then
        echo "(the dry run's clock: $p takes $(mmss "$took"), TIMEOUT at its share of $(mmss "$limit"))"
        took=$limit
      fi
      SIM=$((SIM + took)) status=planned
    else
      t0=$(date +%s)
      run_part "$p" "$limit"
      rc=$?
      took=$(($(date +%s) - t0))
      case $rc in 0) status=ok ;; 124) status=timeout ;; *) status=failed ;; esac
      finish_part "$p"
      echo "[$(mmss "$(elapsed)")] $p $status in $(mmss "$took")" | tee -a "$SLOG"
    fi
    STATUS+=("$p $status $took $est $limit")
  done
  [ "$DRY" = 1 ] && { rm -rf "$WORK"; total_line "$@"; return 0; }
  summary "$@"
}

summary() {
  local n
  printf '%s\n' "${STATUS[@]}" | GPU=$(gpu_slug) BUDGET=$BUDGET SECONDS_TOTAL=$(($(date +%s) - T0)) \
    FAILURES="$WORK/failures.txt" python3 -c '
import json, os, sys
parts = [dict(zip(("part", "status", "seconds", "estimate_s", "share_s"), line.split())) for line in sys.stdin if line.strip()]
for p in parts:
    for k in ("seconds", "estimate_s", "share_s"):
        p[k] = int(p[k])
f = os.environ["FAILURES"]
failures = open(f).read().splitlines() if os.path.exists(f) else []
json.dump({"gpu": os.environ["GPU"], "budget_s": int(os.environ["BUDGET"]), "seconds": int(os.environ["SECONDS_TOTAL"]),
           "parts": parts, "failures": failures}, sys.stdout, indent=1)
print()' >"$OUT/summary.json"
  [ -s "$WORK/failures.txt" ] && { echo "failures:"; cat "$WORK/failures.txt"; } | tee -a "$SLOG"
  n=$(find "$OUT" -type f | wc -l)
  find "$OUT" -type f -size +16M -printf 'warning: %P is over 16 MiB and will not come back\n' | tee -a "$SLOG"
  [ "$n" -le 8 ] || echo "warning: $n files under $OUT; a device call brings back 8" | tee -a "$SLOG"
  echo "took $(mmss $(($(date +%s) - T0))) of the $BUDGET_MIN min budget; $n files under $OUT: $(cd "$OUT" && ls | tr '\n' ' ')" \
    | tee -a "$SLOG"
  [ ! -s "$WORK/failures.txt" ]
}

unpack() {  # unpack DIR: what came back (files_at) -> benchmarks/gpu/
  local src=${1:?unpack DIR (the folder where the device call files came back)} gpu dest=${DEST:-benchmarks/gpu} t n=0
  if [ ! -d "$src" ] || [ -z "$(ls -A "$src" 2>/dev/null)" ]; then
    echo "error: unpack $src: no such folder, or nothing in it; give the folder the device call's files came back to (its files_at)" >&2
    return 1
  fi
  gpu=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['gpu'])" "$src/summary.json" 2>/dev/null || echo gpu)
  mkdir -p "$dest"
  # a killed unpack's temporary folder (its pid gone) is removed; this one's on any exit
  local old
  for old in "${TMPDIR:-/tmp}"/gpu-unpack.*; do
    [ -d "$old" ] || continue
    t=${old##*/gpu-unpack.}
    kill -0 "${t%%.*}" 2>/dev/null || rm -rf "$old"
  done
  local tmp="" copied
  trap '[ -z "$tmp" ] || rm -rf "$tmp"' EXIT
  trap 'exit 130' INT TERM
  for t in "$src"/*.tar.gz; do
    [ -e "$t" ] || continue
    tmp=$(mktemp -d "${TMPDIR:-/tmp}/gpu-unpack.$$.XXXXXX")
    tar xzf "$t" -C "$tmp"
    # decode-*/train-* tables (json, md, profiles) side by side; the README journey in its own folder
    copied=$(find "$tmp" -type f \( -name 'decode-*' -o -name 'train-*' \) -exec cp {} "$dest/" \; -printf "$dest/%f\n")
    [ -z "$copied" ] || { echo "$copied"; n=$((n + $(echo "$copied" | wc -l))); }
    if [ -d "$tmp/readme" ]; then
      mkdir -p "$dest/readme-$gpu" && cp "$tmp"/readme/* "$dest/readme-$gpu/" && echo "$dest/readme-$gpu/" && n=$((n + 1))
    fi
    rm -rf "$tmp"
    tmp=""
  done
  for t in env.txt summary.json session.log; do
    [ -f "$src/$t" ] && cp "$src/$t" "$dest/session-$gpu-$t" && echo "$dest/session-$gpu-$t" && n=$((n + 1))
  done
  if [ "$n" = 0 ]; then
    echo "error: unpack $src: no results in it (no <part>.tar.gz, env.txt, summary.json or session.log); nothing was copied" >&2
    return 1
  fi
  echo "then: git add $dest && git commit -m '...measured on $gpu...' -- $dest"
}

main() {
  local cmd=${1:-}
  shift || true
  case $cmd in
    pack) pack "$@" ;;
    check) check_wheels ;;
    unpack) unpack "$@" ;;
    __part)  # one part, in its own process group (run_part)
      local p=$1
      "part_$p"
      exit $FAILED ;;
    run)
      local parts=() a p
      for a in "$@"; do
        case $a in
          --dry-run) DRY=1 ;;
          --local) LOCAL=1 ;;
          main|all) parts+=("${MAIN_PARTS[@]}") ;;
          extra) parts+=("${EXTRA_PARTS[@]}") ;;
          throughput) parts+=(train) ;;  # the old name
          *)
            if [[ " ${ALL_PARTS[*]} " == *" $a "* ]]; then parts+=("$a")
            else echo "unknown argument $a (parts: ${ALL_PARTS[*]}; main, extra; --dry-run, --local)"; exit 2; fi ;;
        esac
      done
      [ ${#parts[@]} -gt 0 ] || parts=("${MAIN_PARTS[@]}")
      # setup first, once, when any part needs the wheels
      if [[ " ${parts[*]} " != *" setup "* ]] && [ "$LOCAL" = 0 ]; then parts=(setup "${parts[@]}"); fi
      # the settings depend on --local: read them again with it in the environment
      export DRY LOCAL
      exec bash "$SELF" __session "${parts[@]}" ;;
    *) sed -n '2,31p' "$SELF"; exit 2 ;;
  esac
}

if [ "${1:-}" = __session ]; then shift; session "$@"; exit; fi
main "$@"
