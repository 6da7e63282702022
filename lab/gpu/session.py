"""The GPU session in one device call: what runs, in which order, within a budget of device time.

    here:  python -m lab.gpu.session pack --no-wandb     # wheels into .whl/ (git-ignored), size-checked
           python -m lab.gpu.session prepare              # a sparse checkout of what the commands read
           python -m lab.gpu.session check                # what a call carries: tree + wheels <= 48 MiB
           python -m lab.gpu.session run --dry-run        # the plan, each part's estimate, the budget
    there: python -m lab.gpu.session run                  # the one call: setup readme decode train
           python -m lab.gpu.session run extra            # the optional second call (what did not fit)
           python -m lab.gpu.session run PART...          # only these parts (a rerun after a fix)
    here:  python -m lab.gpu.session restore              # the whole checkout again
           python -m lab.gpu.session unpack DIR           # what came back -> benchmarks/gpu/

The lending arrangement is arguments, with today's values as defaults: ``--budget-min`` (8: the
minutes of one call's plan), ``--carry-limit-mib`` (48: working tree plus carried wheels, of the
64 a device call takes; lab/gpu/carry.py),
``--max-files`` (8: the files a call brings back, 16 MiB each: ``--file-limit-mib``).

Parts, in this order (each one's results land in ``OUT/<part>.tar.gz`` as soon as it ends):

  setup           install .whl/ into /tmp/site; env.txt (GPU, driver, versions)
  readme          the README's commands on CUDA with the tiny target in bf16 (short step counts):
                  deepspeed train.py stage=1, stage=2, python eval.py (the decoder's exactness
                  against plain decoding), then a SIGKILL mid-run and a resume
  decode          lab/bench/decoder_table.py at the LLaVA-1.5-7B shape, repeats cut to fit
  train           lab/bench/train.py at the 7B shape, one micro-batch size (--micro-batch, default 2);
                  gradient checkpointing if it runs out of memory
  extra call: decode_13b, decode_qwen2vl (the other decode shapes), train_mb (micro-batches 1,4)

The budget is printed at the start and checked before each part: a part whose estimate does not
fit in what is left is skipped with a line saying so, and a running part is stopped at its share
(its estimate + half, at least --min-slack seconds, never past the budget). A part's failure never
stops the next. ``--estimate PART=SECONDS`` overrides an estimate; ``--dry-took PART=SECONDS``
makes the dry run's clock take that long for a part (to see a skip). ``--local`` runs the same
flow with this machine's packages and CPU-sized settings (no install). Output under ``--out``
(default $OUT, the folder a device call brings back, else /tmp/gpu-out): session.log, env.txt, summary.json and one <part>.tar.gz per part that ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SITE = Path("/tmp/site")     # where setup installs the carried wheels on the GPU machine
BIN = Path("/tmp/msd-bin")   # `python` for the README's commands (the image may have only python3)


# ----------------------------------------------------------------------------- the parts


@dataclass(frozen=True)
class Part:
    name: str
    what: str
    gpu_s: int   # estimate on an H100: reasoned, to be replaced by the first summary.json's seconds
    cpu_s: int   # estimate with --local on this project's shared 2-core CPU


PARTS = {p.name: p for p in (
    Part("setup", "install .whl/ into /tmp/site; env.txt (GPU, driver, versions)", 40, 10),
    Part("readme", "README journey on CUDA, tiny target, bf16: deepspeed train.py stage=1, stage=2, "
                   "python eval.py (exactness), kill + resume", 165, 300),
    Part("decode", "decoder table at the LLaVA-1.5-7B shape (lab/bench/decoder_table.py): plain vs generate() "
                   "vs bandwidth limit, verify by tree size, drafting, cycle/step", 120, 60),
    Part("train", "online training throughput at the 7B shape (lab/bench/train.py): target tokens/s, "
                  "peak memory", 150, 90),
    Part("decode_13b", "decoder table at the LLaVA-1.5-13B shape", 150, 60),
    Part("decode_qwen2vl", "decoder table at the Qwen2-VL-7B shape", 120, 60),
    Part("train_mb", "7B-shape training throughput at other micro-batch sizes", 170, 120),
)}
MAIN = ("setup", "readme", "decode", "train")
EXTRA = ("setup", "decode_13b", "decode_qwen2vl", "train_mb")
GROUPS = {"main": MAIN, "all": MAIN, "extra": EXTRA, "throughput": ("train",)}  # throughput: train's old name


class PlanError(ValueError):
    """A session asked for something that is not a part."""


def choose_parts(names: list[str], local: bool) -> list[str]:
    """The parts to run, in the order asked: groups expanded, the main call when none is named,
    and setup first when any part needs the carried wheels (not with --local)."""
    parts: list[str] = []
    for name in names:
        if name in GROUPS:
            parts += GROUPS[name]
        elif name in PARTS:
            parts.append(name)
        else:
            raise PlanError(f"unknown part {name!r} (parts: {' '.join(PARTS)}; main, extra)")
    parts = parts or list(MAIN)
    if not local and "setup" not in parts:
        parts.insert(0, "setup")
    return parts


# ----------------------------------------------------------------------------- the planner


def mmss(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 60}:{s % 60:02d}"


def minutes(seconds: int) -> str:
    """Minutes, rounded up to a tenth."""
    tenths = -(-seconds // 6)
    return str(tenths // 10) if tenths % 10 == 0 else f"{tenths // 10}.{tenths % 10}"


def share(estimate: int, left: int, min_slack: int = 30) -> int:
    """How long a running part may take: its estimate plus half (at least ``min_slack``), never
    past what is left of the budget."""
    return min(estimate + max(estimate // 2, min_slack), left)


@dataclass(frozen=True)
class Decision:
    part: str
    at: int         # seconds of the budget spent when the part comes up
    estimate: int
    start: bool     # False: skipped, its estimate is over what is left
    share: int      # the running part is stopped here (0 when skipped)
    left: int       # what was left of the budget


def decide(part: str, estimate: int, elapsed: int, budget_s: int, min_slack: int = 30) -> Decision:
    """Start a part only if its estimate fits in what is left of the budget."""
    left = budget_s - elapsed
    if estimate > left:
        return Decision(part, elapsed, estimate, False, 0, max(left, 0))
    return Decision(part, elapsed, estimate, True, share(estimate, left, min_slack), left)


def simulate(parts: list[str], estimates: dict[str, int], budget_s: int, took: dict[str, int] | None = None,
             min_slack: int = 30) -> list[tuple[Decision, int]]:
    """The dry run's clock: each started part takes ``took[part]`` (default its estimate), cut at
    its share; returns each part's decision and the seconds it took (0 when skipped)."""
    took = took or {}
    elapsed, out = 0, []
    for p in parts:
        d = decide(p, estimates[p], elapsed, budget_s, min_slack)
        spent = min(took.get(p, estimates[p]), d.share) if d.start else 0
        elapsed += spent
        out.append((d, spent))
    return out


def plan_lines(parts: list[str], estimates: dict[str, int], budget_min: float, local: bool,
               what: dict[str, str] | None = None) -> list[str]:
    """The budget and each part's estimate; the total is the last line."""
    what = what or {}
    lines = [f"budget: {budget_min:g} min ({round(budget_min * 60)} s) for this call; parts in order, "
             "each started only if its estimate fits in what is left",
             f"plan ({'this CPU, --local' if local else 'estimates for an H100'}; "
             "--estimate PART=SECONDS overrides one):"]
    lines += [f"  {p:<15} {mmss(estimates[p]):>5}  {what.get(p, PARTS[p].what)}" for p in parts]
    return lines + [total_line(parts, estimates, budget_min)]


def total_line(parts: list[str], estimates: dict[str, int], budget_min: float) -> str:
    return f"total: {minutes(sum(estimates[p] for p in parts))} min (budget {budget_min:g} min)"


# ----------------------------------------------------------------------------- settings


@dataclass
class Settings:
    """What the parts run. The defaults are the GPU's; ``Settings.local()`` the CPU check's."""

    local: bool = False
    device: str = "cuda"
    run_dir: str = "runs/tiny"          # runs/tiny: the README's commands exactly
    stage1_steps: int = 100
    stage2_steps: int = 50
    checkpoint_every: int = 50
    kill_at: int = 50                   # the resumed run is SIGKILLed after this step's checkpoint
    eval_items: int = 4
    val_every: int = 50
    train_local: str = ""               # overrides of the readme's train.py commands with --local only
    decode_args: str = "--repeats 5 --warmup 1 --hf-caches dynamic"
    shape_args: str = ""                # make_large_target.py's size
    seq_len: int = 2048
    micro_batch: int = 2
    train_args: str = "--steps 10 --warmup 3 --split-steps 3 --profile"
    train_mb_sizes: str = "1,4"
    train_extra: str = ""               # appended to each train.py command
    eval_extra: str = ""                # appended to each eval.py command

    @classmethod
    def local_cpu(cls, **kw) -> Settings:
        """This CPU, sized to check the flow, not to measure speed."""
        return cls(**{**dict(local=True, device="cpu", run_dir="runs/gpu-local", stage1_steps=4, stage2_steps=4,
                             checkpoint_every=2, kill_at=2, eval_items=1, val_every=1000,
                             train_local="data.max_heldout=8",  # validation: at the end, on 8 conversations
                             decode_args="--repeats 1 --warmup 0 --new-tokens 4 --hf-caches dynamic",
                             shape_args="--layers 1 --scale small", seq_len=1024, micro_batch=1,
                             train_args="--steps 2 --warmup 1 --split-steps 1 --samples 4", train_mb_sizes="2"),
                          **kw})


def what_of(s: Settings) -> dict[str, str]:
    return {"train": f"{PARTS['train'].what}, micro-batch {s.micro_batch}, seq {s.seq_len}",
            "train_mb": f"7B-shape training throughput at micro-batches {s.train_mb_sizes}"}


# ----------------------------------------------------------------------------- the carried wheels

# What the training stack needs that the GPU image (torch 2.11, transformers 5.17, python 3.12)
# lacks, pinned to this project's environment; deepspeed is built from its sdist (pure Python;
# its CUDA ops compile at first use, and the recipe uses none: torch's AdamW).
WHEELS = ("hydra-core==1.3.8", "omegaconf==2.3.1", "antlr4-python3-runtime==4.9.3", "hjson==3.1.0",
          "pydantic==2.13.4", "pydantic-core==2.46.4", "annotated-types==0.7.0", "typing-inspection==0.4.2",
          "datasets==5.2.0", "dill==0.4.1", "multiprocess==0.70.19")
# wandb (imported only when logging.wandb.mode is not disabled) and what only it needs: 20.5 of
# the 26.3 MiB. `pack --no-wandb` leaves them out; `run` then adds logging.wandb.mode=disabled.
WANDB_WHEELS = ("wandb==0.31.0", "platformdirs==4.14.7", "sniffio==1.3.1", "distro==1.9.0", "cwevals==0.0.1b1",
                "opentelemetry-api==1.45.2", "opentelemetry-sdk==1.45.2", "opentelemetry-proto==1.45.2",
                "opentelemetry-semantic-conventions==0.66b2", "opentelemetry-exporter-otlp-proto-http==1.45.2",
                "opentelemetry-exporter-otlp-proto-common==1.45.2", "opentelemetry-exporter-http-transport==0.66b2",
                "opentelemetry-exporter-otlp-common==0.66b2", "googleapis-common-protos==1.76.0")
DEEPSPEED = "deepspeed==0.19.8"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
# What the wheels require that the GPU image already has (its package list as read 2026-11-17):
# the check warns about any requirement found in neither.
IMAGE_HAS = ("anyio httpx typing-extensions filelock numpy pyarrow pandas tqdm xxhash fsspec huggingface-hub "
             "packaging pyyaml einops msgpack ninja psutil py-cpuinfo torch protobuf requests click").split()
# the GPU box's interpreter: requirements whose markers are false there are not needed
GPU_BOX = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _is_wheel_of(path: Path, spec: str) -> bool:
    name, version = spec.split("==")
    return _norm(path.name).startswith(f"{_norm(name)}-{_norm(version)}-")


def tree_bytes(root: Path = ROOT) -> int:
    """What travels besides the carried paths: tracked and untracked-not-ignored files."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                           capture_output=True, text=True).stdout.split("\0")
    return sum((root / f).stat().st_size for f in files if f and (root / f).is_file())


def check_wheels(wheels: Path, carry_limit_mib: float, tree: int, specs=WHEELS + (DEEPSPEED,)) -> tuple[bool, list[str]]:
    """Sizes against what a device call carries, requirements against the image, the pinned
    wheels present. Returns (ok, the lines to print)."""
    from packaging.requirements import Requirement

    found = sorted(wheels.glob("*.whl"), key=lambda p: -p.stat().st_size)
    mib = 2 ** 20
    total = sum(p.stat().st_size for p in found)
    lines = [f"wheels: {len(found)} files, {total / mib:.1f} MiB in {wheels}/; working tree {tree / mib:.1f} MiB; "
             f"together {(total + tree) / mib:.1f} MiB of the {carry_limit_mib:g} MiB a session may send"]
    have = {_norm(p.name.split("-")[0]) for p in found} | {_norm(x) for x in IMAGE_HAS}
    missing = set()
    for p in found:
        try:
            with zipfile.ZipFile(p) as z:
                meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
                text = z.read(meta).decode().splitlines()
        except (StopIteration, zipfile.BadZipFile):
            continue  # not a real wheel (a test's stand-in)
        for line in text:
            if line.startswith("Requires-Dist:"):
                req = Requirement(line.split(":", 1)[1].strip())
                if (req.marker is None or req.marker.evaluate(GPU_BOX)) and _norm(req.name) not in have:
                    missing.add(f"{_norm(req.name)} (for {p.name.split('-')[0]})")
    lines += [f"warning: required, but neither a wheel here nor in the GPU image's package list: {m}"
              for m in sorted(missing)]
    ok = True
    if total + tree > carry_limit_mib * mib:
        ok = False
        lines.append(f"TOO BIG: {(total + tree) / mib:.1f} MiB would travel, over the {carry_limit_mib:g} MiB limit "
                     "of a session's call. Biggest wheels:")
        lines += [f"  {p.stat().st_size / mib:6.1f} MiB  {p.name}" for p in found[:5]]
        lines.append("Send only the session's files (`python -m lab.gpu.session prepare`: a sparse checkout, "
                     "`restore` undoes it) and drop what the run can do without (`pack --no-wandb` leaves wandb out: "
                     "20.5 MiB; the run then disables wandb logging).")
    absent = [s for s in specs if not any(_is_wheel_of(p, s) for p in found)]
    lines += [f"missing wheel: {s}" for s in absent]
    if absent:
        ok = False
        lines.append("run 'python -m lab.gpu.session pack' first (here, with network)")
    return ok, lines


def pack(wheels: Path, no_wandb: bool, carry_limit_mib: float) -> bool:
    """Download (or build) the pinned wheels into ``wheels``, remove any other, check the size."""
    specs = WHEELS + (() if no_wandb else WANDB_WHEELS)
    wheels.mkdir(parents=True, exist_ok=True)
    present = lambda spec: any(_is_wheel_of(p, spec) for p in wheels.glob("*.whl"))  # noqa: E731
    pip = [sys.executable, "-m", "pip"]
    if not present(DEEPSPEED):
        subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", DEEPSPEED, "-w", str(wheels)],
                       check=True)
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    for spec in specs:
        if present(spec):
            continue
        # A binary for CPython 3.12 on x86-64 Linux; a pure-Python sdist (antlr4) is built into one.
        got = subprocess.run([*pip, "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                              "--implementation", "cp", *platforms, "-d", str(wheels), spec], capture_output=True)
        if got.returncode != 0:
            subprocess.run([*pip, "wheel", "-q", "--no-deps", spec, "-w", str(wheels)], check=True)
    # Anything else in the folder (an older pin, wandb after --no-wandb) would travel and install
    # too: two versions of one package stop the whole install there.
    for p in wheels.glob("*.whl"):
        if not any(_is_wheel_of(p, s) for s in specs + (DEEPSPEED,)):
            print(f"removing {p.name} (not in this pack's list)")
            p.unlink()
    ok, lines = check_wheels(wheels, carry_limit_mib, tree_bytes(), specs + (DEEPSPEED,))
    print("\n".join(lines))
    return ok


# ----------------------------------------------------------------------------- running the parts


@dataclass
class Context:
    """What a part needs: settings, where to write, dry or real, and its failures."""

    settings: Settings
    dry: bool
    out: Path
    work: Path
    wheels: Path
    carry_limit_mib: float
    deadline: float = 0.0     # wall-clock time the part is stopped at
    limit: int = 300          # the part's share, seconds
    failed: bool = False
    log: Path | None = None
    commands: list[list[str]] | None = None   # every command stepped, when a caller collects them (lab/gpu/carry.py)

    def say(self, line: str, *logs: Path) -> None:
        print(line, flush=True)
        for path in (self.log, *logs):
            if path is not None and not self.dry:
                with open(path, "a") as f:
                    f.write(line + "\n")

    def step(self, cmd: list[str], log: Path) -> int:
        """Run one command (a dry run prints it), its output into ``log`` too; a failure is
        recorded and the part goes on."""
        self.log = log
        self.say("+ " + shlex.join(cmd))
        if self.commands is not None:
            self.commands.append(list(cmd))
        if self.dry:
            return 0
        with open(log, "a") as f:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
            for line in proc.stdout:
                sys.stdout.write(line)
                f.write(line)
            rc = proc.wait()
        if rc != 0:
            self.say(f"FAILED (exit {rc}): {shlex.join(cmd)}", self.work / "failures.txt")
            self.failed = True
        return rc

    def register_group(self, pid: int) -> None:
        """A process group the watchdog kills too if the part runs out of time."""
        with open(self.work / "groups", "a") as f:
            f.write(f"{pid}\n")


#: the GPUs a session names its results by (``gpu_slug``); "gpu" and "cpu" besides
GPUS = ("gh200", "h100", "h200", "a100", "l40s")


def gpu_slug(ctx: Context) -> str:
    if ctx.settings.local or not shutil.which("nvidia-smi"):
        return "gpu" if ctx.dry and not ctx.settings.local else "cpu"
    name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                          text=True).stdout.lower()
    m = re.search("|".join(GPUS), name)
    return m[0] if m else "gpu"


def wandb_off(ctx: Context) -> list[str]:
    """wandb absent (pack --no-wandb): the run logs without it."""
    if ctx.dry:
        return []
    absent = subprocess.run([sys.executable, "-c", "import wandb"], capture_output=True).returncode != 0
    return ["logging.wandb.mode=disabled"] if absent else []


ENV_REPORT = """
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
import deepspeed, hydra, datasets
print("imports: deepspeed, hydra, datasets ok")
"""


def part_setup(ctx: Context) -> None:
    log, env = ctx.work / "setup" / "log.txt", ctx.work / "setup" / "env.txt"
    if not ctx.settings.local:
        ok, lines = check_wheels(ctx.wheels, ctx.carry_limit_mib, tree_bytes())
        print("\n".join(lines))
        ctx.failed |= not ok
        names = sorted(p.name for p in ctx.wheels.glob("*.whl"))
        marker = SITE / ".msd-wheels"
        if ctx.dry:
            print(f"+ python3 -m pip install --no-index --no-deps --target {SITE} {ctx.wheels}/*.whl")
        elif marker.is_file() and marker.read_text().split() == names:
            print(f"wheels already installed in {SITE} (a warm machine)")
        else:
            ctx.step([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                      "--no-cache-dir", "--upgrade", "--target", str(SITE), *(str(ctx.wheels / n) for n in names)], log)
            if not ctx.failed:
                marker.write_text("\n".join(names) + "\n")
        if not ctx.dry:  # The README says `python`; the image may have only python3.
            BIN.mkdir(parents=True, exist_ok=True)
            (BIN / "python").unlink(missing_ok=True)
            (BIN / "python").symlink_to(sys.executable)
    print("+ env.txt: nvidia-smi, versions")
    if ctx.dry:
        return
    parts = [datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")]
    for cmd in (["nvidia-smi", "--query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm,"
                 "clocks.max.mem", "--format=csv"], ["nvidia-smi"]):
        try:
            parts.append(subprocess.run(cmd, capture_output=True, text=True).stdout)
        except FileNotFoundError:
            parts.append("no nvidia-smi")
            break
    report = subprocess.run([sys.executable, "-c", ENV_REPORT], capture_output=True, text=True)
    parts.append(report.stdout + report.stderr)
    ctx.failed |= report.returncode != 0
    text = "\n".join(parts)
    env.write_text(text)
    print(text)
    shutil.copy(env, ctx.out / "env.txt")


def _readme_results(ctx: Context) -> None:
    """Copy what exists so far into the part's folder (a part stopped later keeps it)."""
    if ctx.dry:
        return
    d, run = ctx.work / "readme", ROOT / ctx.settings.run_dir
    copies = [(run / f"stage{s}" / "metrics.jsonl", d / f"stage{s}-metrics.jsonl") for s in (1, 2)]
    copies.append((Path(f"{run}-resume") / "stage1" / "metrics.jsonl", d / "resume-stage1-metrics.jsonl"))
    copies += [(run / "eval" / n, d / n) for n in ("report.json", "report.md", "samples.jsonl")]
    for src, dst in copies:
        if src.is_file():
            shutil.copy(src, dst)


def resume_check(run: str, log_text: str) -> dict:
    """The resumed run against the uninterrupted one: weights and losses."""
    from safetensors.torch import load_file

    a = load_file(f"{run}/stage1/final/model.safetensors")
    b = load_file(f"{run}-resume/stage1/final/model.safetensors")
    diff = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)

    def losses(path):
        return [json.loads(x)["loss"] for x in Path(path).read_text().splitlines() if '"loss"' in x and "val/" not in x]

    la, lb = losses(f"{run}/stage1/metrics.jsonl"), losses(f"{run}-resume/stage1/metrics.jsonl")
    return {"resumed": "resuming from" in log_text, "max_abs_weight_diff_vs_uninterrupted": diff,
            "bit_identical_weights": diff == 0.0, "losses_identical": la == lb,
            "max_abs_loss_diff": max((abs(x - y) for x, y in zip(la, lb)), default=None), "n_losses": [len(la), len(lb)]}


def part_readme(ctx: Context) -> None:
    s, d = ctx.settings, ctx.work / "readme"
    log = d / "log.txt"
    run = [] if s.run_dir == "runs/tiny" else [f"run_dir={s.run_dir}"]
    tail = [f"checkpoint.every={s.checkpoint_every}", f"eval.every={s.val_every}", *s.train_local.split(),
            *wandb_off(ctx), *shlex.split(s.train_extra)]
    s1 = [*run, f"train.max_steps={s.stage1_steps}", *tail]
    s2 = [*run, f"train.max_steps={s.stage2_steps}", f"stage.curriculum.ramp_steps={s.stage2_steps // 2}", *tail]
    if not ctx.dry:  # fresh runs: nothing to resume from
        for r in (ROOT / s.run_dir, ROOT / f"{s.run_dir}-resume"):
            shutil.rmtree(r, ignore_errors=True)
    # The README's commands (CUDA is picked automatically; bf16 on CUDA by default), short.
    ctx.step(["deepspeed", "train.py", "stage=1", *s1], log)
    _readme_results(ctx)
    ctx.step(["deepspeed", "train.py", "stage=2", *s2], log)
    _readme_results(ctx)
    # eval.py: plain decoding and the tree decoder on the same prompts; report.json says whether
    # the outputs match (exact_match_fraction, near_tie vs real mismatches in bf16).
    ctx.step(["python", "eval.py", f"draft={s.run_dir}/stage2/final", f"out={s.run_dir}/eval",
              f"bench.max_per_category={s.eval_items}", *shlex.split(s.eval_extra)], log)
    _readme_results(ctx)
    # Kill and relaunch: SIGKILL the launcher's whole group once the kill_at checkpoint exists.
    cmd = ["deepspeed", "train.py", "stage=1", f"run_dir={s.run_dir}-resume", *s1[len(run):]]
    first = ROOT / f"{s.run_dir}-resume" / "stage1" / "checkpoints" / f"step-{s.kill_at:06d}" / "recipe_state.json"
    ctx.say(f"+ setsid {shlex.join(cmd)} & (SIGKILL after {first.relative_to(ROOT)})")
    if not ctx.dry:
        with open(d / "killed-run.log", "a") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        ctx.register_group(proc.pid)
        until = time.time() + ctx.limit / 2
        while not first.is_file() and proc.poll() is None and time.time() < until:
            time.sleep(0.2)
        if first.is_file():
            ctx.say(f"killed after {first.relative_to(ROOT)}")
        else:
            ctx.say(f"FAILED: no {first.relative_to(ROOT)} to kill after", ctx.work / "failures.txt")
            ctx.failed = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    ctx.step(cmd, log)
    if ctx.dry:
        return
    try:
        r = resume_check(str(ROOT / s.run_dir), log.read_text())
        (d / "resume.json").write_text(json.dumps(r, indent=1) + "\n")
        ctx.say("resume: " + json.dumps(r))
    except Exception as e:  # noqa: BLE001 - the check's failure is a result of the part, not its end
        ctx.say(f"FAILED: resume check: {e}", ctx.work / "failures.txt")
        ctx.failed = True
    _readme_results(ctx)
    if (d / "report.json").is_file():
        r = json.loads((d / "report.json").read_text())
        o = r.get("overall", r)
        ctx.say("eval: " + str({k: o.get(k) for k in ("outputs_match_ar", "exact_match_fraction",
                                                       "near_tie_mismatches", "real_mismatches", "tau", "speedup")
                                if k in o}))


def decode_shape(ctx: Context, part: str, config: str) -> None:
    s = ctx.settings
    ctx.step(["python", "-m", "lab.bench.decoder_table", "--config", config, "--device", s.device,
              *shlex.split(s.decode_args), "--out", str(ctx.work / part / f"decode-{config}-{gpu_slug(ctx)}.json"),
              "--note", f"random weights; lab/gpu/session.py part {part}"], ctx.work / part / "log.txt")


def part_decode(ctx):
    decode_shape(ctx, "decode", "small" if ctx.settings.local else "llava15_7b")


def part_decode_13b(ctx):
    decode_shape(ctx, "decode_13b", "small" if ctx.settings.local else "llava15_13b")


def part_decode_qwen2vl(ctx):
    decode_shape(ctx, "decode_qwen2vl", "small_qwen" if ctx.settings.local else "qwen2vl_7b")


def train_sizes(ctx: Context, part: str, sizes: str) -> None:
    """lab/bench/train.py on the 7B-shaped folder, then the sizes that ran out of memory again with
    gradient checkpointing if a minute of the part's share is left."""
    s, shape = ctx.settings, "llava15_7b"
    log = ctx.work / part / "log.txt"
    folder = Path(f"/tmp/msd-{shape}" + ("-small" if s.local else ""))
    out = ctx.work / part / (f"train-{shape}-{gpu_slug(ctx)}" + ("" if part == "train" else f"-mb{sizes.replace(',', '-')}")
                             + ".json")
    if ctx.dry or not (folder / "config.json").is_file():  # a warm machine keeps the folder
        ctx.step(["python", "-m", "lab.targets.make_large_target", str(folder), "--shape", shape,
                  *shlex.split(s.shape_args)], log)
    args = shlex.split(s.train_args)
    note = ("7B shape scaled down (--layers 1 --scale small), CPU check" if s.local
            else "7B shape, random bf16 weights; online features, ZeRO-2, one GPU")
    ctx.step(["python", "-m", "lab.bench.train", "--target", str(folder), "--seq-len", str(s.seq_len),
              "--micro-batches", sizes, *args, "--out", str(out), "--note", f"{note}; lab/gpu/session.py part {part}"],
             log)
    if ctx.dry:
        print("(sizes that run out of memory: again with --gradient-checkpointing, if time is left)")
        return
    rows = json.loads(out.read_text()).get("rows", []) if out.is_file() else []
    oom = ",".join(str(r["micro_batch_size"]) for r in rows if r.get("oom"))
    if not oom:
        return
    left = int(ctx.deadline - time.time())
    if left < 60:
        ctx.say(f"SKIP gradient checkpointing for micro-batch {oom} (out of memory): {left} s left of this part's share")
        return
    ctx.step(["python", "-m", "lab.bench.train", "--target", str(folder), "--seq-len", str(s.seq_len),
              "--micro-batches", oom, "--gradient-checkpointing", *(a for a in args if a != "--profile"),
              "--out", str(out.with_name(out.stem + "-gc.json"))], log)


def part_train(ctx):
    train_sizes(ctx, "train", str(ctx.settings.micro_batch))


def part_train_mb(ctx):
    train_sizes(ctx, "train_mb", ctx.settings.train_mb_sizes)


RUNNERS = {"setup": part_setup, "readme": part_readme, "decode": part_decode, "train": part_train,
           "decode_13b": part_decode_13b, "decode_qwen2vl": part_decode_qwen2vl, "train_mb": part_train_mb}


# ----------------------------------------------------------------------------- the session


@dataclass
class Session:
    parts: list[str]
    settings: Settings
    out: Path = Path("/tmp/gpu-out")
    work: Path = Path("/tmp/msd-gpu-work")   # each part's files, packed into OUT/<part>.tar.gz when it ends
    wheels: Path = ROOT / ".whl"
    budget_min: float = 8
    carry_limit_mib: float = 48
    max_files: int = 8
    file_limit_mib: float = 16
    part_file_limit_mib: float = 8
    min_slack: int = 30
    estimates: dict[str, int] = field(default_factory=dict)   # overrides
    dry_took: dict[str, int] = field(default_factory=dict)

    @property
    def budget_s(self) -> int:
        return round(self.budget_min * 60)

    def estimate(self, part: str) -> int:
        p = PARTS[part]
        return self.estimates.get(part, p.cpu_s if self.settings.local else p.gpu_s)

    def context(self, dry: bool) -> Context:
        return Context(self.settings, dry, self.out, self.work, self.wheels, self.carry_limit_mib)

    def run(self, dry: bool) -> int:
        estimates = {p: self.estimate(p) for p in self.parts}
        if dry:
            self.work = Path(tempfile.mkdtemp(prefix="gpu-dry-"))
            log = None
        else:
            self.out.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(self.work, ignore_errors=True)
            self.work.mkdir(parents=True)
            log = self.out / "session.log"
            log.write_text("")
        self._env()

        def say(line: str) -> None:
            print(line, flush=True)
            if log is not None:
                with open(log, "a") as f:
                    f.write(line + "\n")

        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        say(f"{stamp} lab/gpu/session.py run {' '.join(self.parts)} ({'dry run' if dry else self.out})")
        for line in plan_lines(self.parts, estimates, self.budget_min, self.settings.local, what_of(self.settings)):
            say(line)
        t0, clock, status = time.time(), 0, []
        for p in self.parts:
            elapsed = clock if dry else int(time.time() - t0)
            d = decide(p, estimates[p], elapsed, self.budget_s, self.min_slack)
            if not d.start:
                say(f"[{mmss(elapsed)}] SKIP {p}: its estimate {mmss(d.estimate)} is over the {mmss(d.left)} left "
                    "of the budget")
                status.append({"part": p, "status": "skipped", "seconds": 0, "estimate_s": d.estimate, "share_s": 0})
                continue
            say(f"[{mmss(elapsed)}] == {p} (estimate {mmss(d.estimate)}, stopped at {mmss(d.share)} if still running)")
            (self.work / p).mkdir(parents=True, exist_ok=True)
            if dry:
                ctx = self.context(True)
                ctx.limit = d.share
                RUNNERS[p](ctx)
                took = self.dry_took.get(p, d.estimate)
                if took > d.share:
                    print(f"(the dry run's clock: {p} takes {mmss(took)}, TIMEOUT at its share of {mmss(d.share)})")
                    took = d.share
                clock += took
                result = "planned"
            else:
                start = time.time()
                rc = self._run_part(p, d.share, say)
                took = int(time.time() - start)
                result = {0: "ok", 124: "timeout"}.get(rc, "failed")
                self._pack_part(p)
                say(f"[{mmss(time.time() - t0)}] {p} {result} in {mmss(took)}")
            status.append({"part": p, "status": result, "seconds": took, "estimate_s": d.estimate, "share_s": d.share})
        if dry:
            shutil.rmtree(self.work, ignore_errors=True)
            print(total_line(self.parts, estimates, self.budget_min))
            return 0
        return self._summary(status, int(time.time() - t0), say)

    def _env(self) -> None:
        """What every part's commands see: the carried wheels first on the GPU machine."""
        path = [str(SITE), str(ROOT)] if not self.settings.local else [str(ROOT)]
        os.environ["PYTHONPATH"] = os.pathsep.join(path)
        if not self.settings.local:
            os.environ["PATH"] = os.pathsep.join([str(BIN), str(SITE / "bin"), os.environ.get("PATH", "")])
        os.environ.update(WANDB_SILENT="true", PYTHONUNBUFFERED="1")

    def _run_part(self, part: str, limit: int, say) -> int:
        """One part in its own process group, stopped at ``limit`` seconds with every group it started."""
        groups = self.work / "groups"
        groups.write_text("")
        state = self.work / "session.json"
        state.write_text(json.dumps({"session": _to_json(self), "part": part, "limit": limit,
                                     "deadline": time.time() + limit}))
        proc = subprocess.Popen([sys.executable, "-m", "lab.gpu.session", "_part", str(state)], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        log = open(self.out / "session.log", "a")  # noqa: SIM115 - written to by the reader thread below

        def pump():
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)
                log.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        dead = time.time() + limit
        rc = None
        while (rc := proc.poll()) is None and time.time() < dead:
            time.sleep(0.2)
        others = [int(x) for x in groups.read_text().split()]
        if rc is None:
            line = f"TIMEOUT: part {part} stopped at its share of {mmss(limit)}"
            say(line)
            with open(self.work / "failures.txt", "a") as f:
                f.write(line + "\n")
            for sig in (signal.SIGTERM, signal.SIGKILL):
                for g in [proc.pid, *others]:
                    try:
                        os.killpg(g, sig)
                    except (ProcessLookupError, PermissionError):
                        pass
                if sig == signal.SIGTERM:
                    try:
                        proc.wait(timeout=3)
                    except subprocess.TimeoutExpired:
                        pass
            proc.wait()
            rc = 124
        for g in others:  # nothing the part started outlives it
            try:
                os.killpg(g, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        reader.join(timeout=5)
        log.close()
        return rc

    def _pack_part(self, part: str) -> None:
        """The part's folder -> OUT/<part>.tar.gz (files over the per-file limit left out, listed)."""
        folder = self.work / part
        if part == "setup" or not folder.is_dir():
            return
        limit = self.part_file_limit_mib * 2 ** 20
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        big = [p for p in files if p.stat().st_size > limit]
        if big:
            (folder / "left-out.txt").write_text("".join(
                f"{p.relative_to(folder)} ({p.stat().st_size} bytes) left out: over {self.part_file_limit_mib:g} MiB\n"
                for p in big))
            files = sorted(p for p in folder.rglob("*") if p.is_file())
        with tarfile.open(self.out / f"{part}.tar.gz", "w:gz") as t:
            for p in files:
                if p.stat().st_size <= limit:
                    t.add(p, arcname=str(p.relative_to(self.work)))

    def _summary(self, status: list[dict], seconds: int, say) -> int:
        fail_file = self.work / "failures.txt"
        failures = fail_file.read_text().splitlines() if fail_file.is_file() else []
        ctx = self.context(False)
        summary = {"gpu": gpu_slug(ctx), "budget_s": self.budget_s, "seconds": seconds, "parts": status,
                   "failures": failures}
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        if failures:
            say("failures:")
            for line in failures:
                say(line)
        for line in out_warnings(self.out, self.max_files, self.file_limit_mib):
            say(line)
        names = sorted(p.name for p in self.out.iterdir())
        say(f"took {mmss(seconds)} of the {self.budget_min:g} min budget; {len(names)} files under {self.out}: "
            + " ".join(names))
        return 1 if failures else 0


def out_warnings(out: Path, max_files: int, file_limit_mib: float) -> list[str]:
    """What would not come back from a device call: files over the size limit, too many files."""
    files = sorted(p for p in out.rglob("*") if p.is_file())
    lines = [f"warning: {p.relative_to(out)} is over {file_limit_mib:g} MiB and will not come back"
             for p in files if p.stat().st_size > file_limit_mib * 2 ** 20]
    if len(files) > max_files:
        lines.append(f"warning: {len(files)} files under {out}; a device call brings back {max_files}")
    return lines


def _to_json(s: Session) -> dict:
    d = dataclasses.asdict(s)
    return {k: str(v) if isinstance(v, Path) else v for k, v in d.items()}


def _from_json(d: dict) -> Session:
    d = dict(d)
    d["settings"] = Settings(**d["settings"])
    for k in ("out", "work", "wheels"):
        d[k] = Path(d[k])
    return Session(**d)


def run_one_part(state_file: str) -> int:
    """A part, in its own process group (Session._run_part)."""
    state = json.loads(Path(state_file).read_text())
    s = _from_json(state["session"])
    ctx = s.context(False)
    ctx.limit, ctx.deadline = state["limit"], state["deadline"]
    RUNNERS[state["part"]](ctx)
    return 1 if ctx.failed else 0


# ----------------------------------------------------------------------------- what came back


def unpack(src: Path, dest: Path, tmpdir: Path | None = None) -> int:
    """What came back (the device call's files_at) -> ``dest``: decode-*/train-* files side by
    side, the README journey in readme-<gpu>/, env.txt, summary.json and session.log as
    session-<gpu>-*. Nothing to unpack is an error; so is anything that could write outside
    ``dest`` or bring a file of this machine into it (:func:`unpack_refusal`), before anything
    is copied."""
    if not src.is_dir() or not any(src.iterdir()):
        print(f"error: unpack {src}: no such folder, or nothing in it; give the folder the device call's files came "
              "back to (its files_at)", file=sys.stderr)
        return 1
    try:
        gpu = json.loads((src / "summary.json").read_text())["gpu"]
    except (OSError, ValueError, KeyError, TypeError):
        gpu = "gpu"
    why = unpack_refusal(src, gpu)
    if why:
        print(f"error: unpack {src}: {why}; nothing was copied", file=sys.stderr)
        return 1
    from msd_train import leftovers

    tmpdir = Path(tmpdir or tempfile.gettempdir())
    for old in tmpdir.glob("gpu-unpack.*"):  # a killed unpack's temporary folder (its marker says so)
        leftovers.remove_if_left(old)
    copied = []
    dest.mkdir(parents=True, exist_ok=True)
    for t in sorted(src.glob("*.tar.gz")):
        tmp = Path(tempfile.mkdtemp(prefix=f"gpu-unpack.{os.getpid()}.", dir=tmpdir))
        leftovers.mark(tmp)
        try:
            with tarfile.open(t) as tar:  # its members were checked (unpack_refusal); the filter checks again
                if hasattr(tarfile, "data_filter"):
                    tar.extractall(tmp, filter="data")
                else:
                    tar.extractall(tmp)  # noqa: S202
            for f in sorted(tmp.rglob("*")):
                if f.is_file() and not f.is_symlink() and f.name.startswith(("decode-", "train-")):
                    shutil.copy(f, dest / f.name)
                    copied.append(dest / f.name)
            if (tmp / "readme").is_dir():
                r = dest / f"readme-{gpu}"
                r.mkdir(exist_ok=True)
                for f in (tmp / "readme").iterdir():
                    if f.is_file() and not f.is_symlink():
                        shutil.copy(f, r / f.name)
                copied.append(r)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    for name in ("env.txt", "summary.json", "session.log"):
        if (src / name).is_file():
            shutil.copy(src / name, dest / f"session-{gpu}-{name}")
            copied.append(dest / f"session-{gpu}-{name}")
    if not copied:
        print(f"error: unpack {src}: no results in it (no <part>.tar.gz, env.txt, summary.json or session.log); "
              "nothing was copied", file=sys.stderr)
        return 1
    print("\n".join(map(str, copied)))
    print(f"then: git add {dest} && git commit -m '...measured on {gpu}...' -- {dest}")
    return 0


def unpack_refusal(src: Path, gpu) -> str | None:
    """Why ``src`` is not unpacked, or None: a ``gpu`` name (from summary.json, it names
    folders) that is not one :func:`gpu_slug` gives; a file of ``src`` that is a link (it
    would copy a file of this machine); a tar member that is a link, a device, an absolute
    path or one with ``..``, or a tar that does not open."""
    if not isinstance(gpu, str) or gpu not in (*GPUS, "gpu", "cpu"):
        return (f"summary.json names the GPU {str(gpu)!r}, not one a session names ({', '.join(GPUS)}, gpu, cpu); "
                f"its name makes folder names, so fix summary.json's \"gpu\" or delete summary.json")
    for f in sorted(src.iterdir()):
        if f.is_symlink():
            return f"{f.name} is a link (to {os.readlink(f)}), not a file the session wrote; remove it"
    for t in sorted(src.glob("*.tar.gz")):
        try:
            with tarfile.open(t) as tar:
                for m in tar.getmembers():
                    parts = Path(m.name).parts
                    if m.name.startswith(("/", "\\")) or ".." in parts:
                        return f"{t.name} holds {m.name!r}, a path out of the folder it is unpacked into"
                    if not (m.isfile() or m.isdir()):
                        return f"{t.name} holds {m.name!r}, which is not a plain file or folder (a link or a device)"
        except (OSError, tarfile.TarError) as e:
            return f"{t.name} does not open as a tar.gz ({e}); run that part again"
    return None


# ----------------------------------------------------------------------------- the command


def _seconds(text: str) -> tuple[str, int]:
    part, _, value = text.partition("=")
    if part not in PARTS or not value.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: give PART=SECONDS, PART one of {' '.join(PARTS)}")
    return part, int(value)


def _positive(kind):
    def parse(text):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text} must be above 0")
        return value
    parse.__name__ = kind.__name__
    return parse


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lab.gpu.session", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    sub = ap.add_subparsers(dest="command", required=True)
    lending = argparse.ArgumentParser(add_help=False)
    lending.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="the carried wheels' folder (.whl)")
    lending.add_argument("--carry-limit-mib", type=_positive(float), default=48,
                         help="working tree + carried wheels a session may send (48; a device call takes 64)")
    p = sub.add_parser("pack", parents=[lending], help="the wheels the GPU image lacks, into --wheels")
    p.add_argument("--no-wandb", action="store_true", help="leave wandb out (20.5 MiB); the run disables it")
    sub.add_parser("check", parents=[lending],
                   help="what a device call carries (working tree + wheels) against the limit; the wheels' requirements")
    sub.add_parser("prepare", help="a sparse checkout of the files the session's commands read (restore undoes it)")
    sub.add_parser("restore", help="the whole checkout again, after prepare")
    r = sub.add_parser("run", parents=[lending], help="the session (or its plan with --dry-run)")
    r.add_argument("parts", nargs="*", help=f"parts ({' '.join(PARTS)}) or main, extra (default: main)")
    r.add_argument("--dry-run", action="store_true", help="print the plan and the commands, run nothing")
    r.add_argument("--local", action="store_true", help="this machine's packages, CPU-sized settings")
    r.add_argument("--budget-min", type=_positive(float), default=8, help="minutes of this call's plan (8)")
    r.add_argument("--max-files", type=_positive(int), default=8, help="files a device call brings back (8)")
    r.add_argument("--file-limit-mib", type=_positive(float), default=16, help="size of one file that comes back (16)")
    r.add_argument("--estimate", type=_seconds, action="append", default=[], metavar="PART=SECONDS")
    r.add_argument("--dry-took", type=_seconds, action="append", default=[], metavar="PART=SECONDS",
                   help="the dry run's clock: this part takes that long")
    r.add_argument("--min-slack", type=int, default=30, help="a running part's share is at least its estimate + this")
    r.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "/tmp/gpu-out"),
                   help="what comes back: the device call's $OUT (default $OUT, else /tmp/gpu-out)")
    r.add_argument("--work", type=Path, default=Path("/tmp/msd-gpu-work"))
    for f in dataclasses.fields(Settings):
        if f.name in ("local", "device"):
            continue
        r.add_argument("--" + f.name.replace("_", "-"), type=_positive(int) if f.type == "int" else str,
                       default=None, help=f"default {getattr(Settings(), f.name)!r}; --local "
                                          f"{getattr(Settings.local_cpu(), f.name)!r}")
    u = sub.add_parser("unpack", help="what came back -> benchmarks/gpu/")
    u.add_argument("src", type=Path, help="the folder the device call's files came back to (its files_at)")
    u.add_argument("--dest", type=Path, default=ROOT / "benchmarks" / "gpu")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_part"]:
        return run_one_part(argv[1])
    a = parser().parse_args(argv)
    if a.command == "pack":
        return 0 if pack(a.wheels, a.no_wandb, a.carry_limit_mib) else 1
    if a.command in ("prepare", "restore"):
        from lab.gpu import carry

        return carry.prepare() if a.command == "prepare" else carry.restore()
    if a.command == "check":
        from lab.gpu import carry

        tree = tree_bytes()
        ok, lines = check_wheels(a.wheels, a.carry_limit_mib, tree)
        print("\n".join(carry.carry_lines(tree) + lines))
        return 0 if ok else 1
    if a.command == "unpack":
        return unpack(a.src, a.dest)
    try:
        parts = choose_parts(a.parts, a.local)
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    chosen = {f.name: getattr(a, f.name) for f in dataclasses.fields(Settings)
              if f.name not in ("local", "device") and getattr(a, f.name) is not None}
    settings = Settings.local_cpu(**chosen) if a.local else Settings(**chosen)
    session = Session(parts, settings, out=a.out, work=a.work, wheels=a.wheels, budget_min=a.budget_min,
                      carry_limit_mib=a.carry_limit_mib, max_files=a.max_files, file_limit_mib=a.file_limit_mib,
                      min_slack=a.min_slack, estimates=dict(a.estimate), dry_took=dict(a.dry_took))
    return session.run(dry=a.dry_run)


if __name__ == "__main__":
    sys.exit(main())
