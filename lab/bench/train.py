"""Training throughput of the MSD recipe: TrainRecipe itself, on CPU or GPU.

    python -m lab.bench.train [overrides...]                 # the embedded default (tiny), CPU or GPU
    python -m lab.bench.train --target DIR --seq-len 2048 --micro-batches 1,2,4 \\
        --out benchmarks/gpu/train-llava15_7b-h100.json            # 7B shape (lab/targets/make_large_target.py)

Each micro-batch size runs in its own process (clean peak memory) through the real recipe:
``TrainRecipe.setup()`` from the Hydra config, then ``train_step()`` (DataLoader collation,
online features = the frozen target forward, head forward/backward, DeepSpeed step; ZeRO-2
by default). ``--steps`` optimizer steps are timed after ``--warmup`` ones without any
extra synchronisation; then ``--split-steps`` more are run with the device synchronised
around each phase to split the time into data (waiting for the DataLoader and the copy to
the device), target forward, head forward + loss + backward, and optimizer (DeepSpeed's
step, with ZeRO's reductions).

``--seq-len N`` trains on synthetic samples of exactly N tokens with one image each (a
random image and character-level text, truncated by ``data.max_length=N``; stage 2 with
a multimodal share of 1, a fresh head); without it the configured data are used.

Reported per micro-batch size: target tokens/s (every token the frozen target reads,
padding excluded), samples/s, s/step, peak memory (CUDA allocator peak; max RSS on CPU),
the time split, and MFU: model FLOPs (target forward incl. vision tower, head forward and
backward, the loss's lm_head products; attention counted causal) over the step time and
the GPU's dense bf16 peak. Writes ``--out`` (JSON) and the same name with ``.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lab.cli import at_least, counts
from msd_train.config import CONF_DIR, REPO_ROOT, strip_launcher_args

ROOT = Path(__file__).resolve().parents[2]

GOAL_TOKENS_PER_S, FIRST_BAR = 20000, 15000  # the goal: one H100, 7B shape, seq 2048, one image
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "GH200": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}
PHASES = ("data", "target_forward", "head_fwd_bwd", "loss", "optimizer")


# ----------------------------------------------------------------------------- synthetic data
def synthetic_data(folder: Path, seq_len: int, n: int, side: int = 336, seed: int = 0) -> list[str]:
    """``n`` LLaVA-format conversations with one random image each and more text than
    ``seq_len`` tokens can hold (truncation makes every sample exactly ``seq_len`` long)."""
    import numpy as np
    from PIL import Image

    rng = random.Random(seed)
    words = "the a of image shows red blue green cat dog on table near window light small large".split()
    folder.mkdir(parents=True, exist_ok=True)
    recs = []
    for i in range(n):
        pixels = np.random.default_rng([seed, i]).integers(0, 256, (side, side, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{i}.png")
        q = " ".join(rng.choices(words, k=12))
        a = " ".join(rng.choices(words, k=seq_len))  # characters >> tokens left after the image
        recs.append({"id": f"s{i}", "image": f"{i}.png",
                     "conversations": [{"from": "human", "value": "<image>\n" + q}, {"from": "gpt", "value": a}]})
    (folder / "train.json").write_text(json.dumps(recs))
    return ["stage='2'", "stage.init_from=null", "stage.splits=[multimodal]", "stage.curriculum.start=1.0",
            "stage.curriculum.end=1.0", "stage.curriculum.ramp_steps=0", f"data.max_length={seq_len}",
            "data.text=[]", "data.heldout_text=[]", "data.heldout_multimodal=[]",
            f"data.multimodal=[{{path:{folder / 'train.json'},image_root:{folder}}}]"]


# ----------------------------------------------------------------------------- timing
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PhaseTimer:
    """Wall time per phase with the device synchronised at both ends (split pass only)."""

    def __init__(self, device):
        self.device, self.on, self.t = device, False, dict.fromkeys(PHASES, 0.0)

    def wrap(self, name, fn):
        def timed(*a, **kw):
            if not self.on:
                return fn(*a, **kw)
            _sync(self.device)
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            _sync(self.device)
            self.t[name] += time.perf_counter() - t0
            return out
        return timed


class TimedEngine:
    """The DeepSpeed engine as the recipe sees it, with its step (the optimizer) timed."""

    def __init__(self, engine, timer: PhaseTimer):
        self._engine = engine
        self.step = timer.wrap("optimizer", engine.step)

    def __call__(self, *a, **kw):
        return self._engine(*a, **kw)

    def __getattr__(self, name):
        return getattr(self._engine, name)


class StepShape:
    """Token counts of the steps the recipe consumed (for FLOPs)."""

    def __init__(self):
        self.lengths, self.loss_tokens, self.images = [], 0, 0

    def record(self, item: dict) -> None:
        for b in item["micro_batches"]:
            self.lengths += b["attention_mask"].sum(1).tolist()
            self.loss_tokens += int(b["loss_mask"][:, 2:].sum())
            self.images += int(b["n_images"])


def model_flops(recipe, shape: StepShape, vision_tokens_per_image: int) -> float:
    """Estimated FLOPs of the recorded steps (see the module docstring)."""
    target, head = recipe.target, recipe.engine.module
    tc = getattr(target.config, "text_config", target.config)
    inner = getattr(target.model, "model", target.model)
    vision = [m for m in (getattr(inner, "vision_tower", None), getattr(inner, "multi_modal_projector", None),
                          getattr(inner, "visual", None)) if m is not None]
    n_vis = sum(p.numel() for m in vision for p in m.parameters())
    n_all = sum(p.numel() for p in target.model.parameters())
    n_lm = n_all - n_vis - target.embed_tokens.weight.numel() - target.lm_head.weight.numel()
    L, d = tc.num_hidden_layers, tc.hidden_size
    n_head = sum(p.numel() for p in head.parameters() if p.requires_grad)
    hl = getattr(head.config, "num_hidden_layers", 1)
    V, H = target.lm_head.weight.shape
    s1, s2 = sum(shape.lengths), sum(s * s for s in shape.lengths)
    target_f = 2 * n_lm * s1 + 2 * L * d * s2 + 2 * n_vis * vision_tokens_per_image * shape.images
    head_f = 3 * (2 * n_head * s1 + 2 * hl * H * s2)
    loss_f = 2 * V * H * shape.loss_tokens * 3  # target logits (no grad), draft logits forward + input grad
    return float(target_f + head_f + loss_f)


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in sorted(PEAK_BF16.items(), key=lambda kv: -len(kv[0])) if k in name), None)


def profile_steps(recipe, args, device) -> Path:
    """Two steps under torch.profiler: the operator table (by device time) beside ``--out``."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts, record_shapes=False) as prof:
        for _ in range(2):
            recipe.train_step()
            recipe.step += 1
        _sync(device)
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    out = Path(args.out)
    path = out.with_name(f"{out.stem}-mb{recipe.cfg.train.micro_batch_size}-profile.txt")
    path.write_text(prof.key_averages().table(sort_by=key, row_limit=40) + "\n")
    return path


# ----------------------------------------------------------------------------- one size
def run_one(args, overrides: list[str]) -> dict:
    from hydra import compose, initialize_config_dir

    from msd_train.training.recipe import TrainRecipe

    argv = ["bench", *overrides]
    strip_launcher_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        extra = synthetic_data(tmp / "data", args.seq_len, args.samples) if args.seq_len else []
        with initialize_config_dir(str(CONF_DIR), version_base=None):
            cfg = compose("config", overrides=[f"run_dir={tmp / 'run'}", f"data.cache_dir={tmp / 'cache'}",
                                               "logging.wandb.mode=disabled", "logging.progress=false",
                                               *extra, *argv[1:]])
        recipe = TrainRecipe(cfg)
        recipe.setup()
        device = recipe.device
        timer, shape = PhaseTimer(device), StepShape()
        recipe.features = timer.wrap("target_forward", recipe.features)
        # the token loss's lm_head products (their gradient is taken in the forward): the loss
        # function the msd, on-policy and dflash objectives call, and msd3's target distribution
        # and per-step logits
        import msd_train.draft.msd3 as msd3_model
        import msd_train.training.objective as objective

        saved = (objective.msd_loss, objective.MSD3Objective._targets, msd3_model.MSD3DraftModel.draft_logits)
        objective.msd_loss = timer.wrap("loss", saved[0])
        objective.MSD3Objective._targets = timer.wrap("loss", saved[1])
        msd3_model.MSD3DraftModel.draft_logits = timer.wrap("loss", saved[2])
        next_batches = timer.wrap("data", recipe._next_batches)
        to_device = timer.wrap("data", recipe._to_device)

        def consumed():
            item = next_batches()
            shape.record(item)
            return item

        recipe._next_batches, recipe._to_device = consumed, to_device
        recipe.engine = TimedEngine(recipe.engine, timer)
        cuda = device.type == "cuda"
        try:
            for _ in range(args.warmup):
                recipe.train_step()
                recipe.step += 1
            _sync(device)
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            shape.__init__()
            tokens = samples = 0
            t0 = time.perf_counter()
            for _ in range(args.steps):
                m = recipe.train_step()
                recipe.step += 1
                tokens += m["tokens"]
                samples += recipe.global_batch
            _sync(device)
            dt = time.perf_counter() - t0
            flops = model_flops(recipe, shape, args.vision_tokens)
            timer.on = True
            t1 = time.perf_counter()
            for _ in range(args.split_steps):
                recipe.train_step()
                recipe.step += 1
            _sync(device)
            split_total = time.perf_counter() - t1
            timer.on = False
            if args.profile:
                profile_steps(recipe, args, device)
        except torch.OutOfMemoryError as e:
            return {"micro_batch_size": int(cfg.train.micro_batch_size), "oom": True,
                    "error": str(e).splitlines()[0]}
        peak = (torch.cuda.max_memory_allocated(device) if cuda
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        t = timer.t
        objective.msd_loss, objective.MSD3Objective._targets, msd3_model.MSD3DraftModel.draft_logits = saved
        # the head's forward and backward, the loss's forward part left out (msd3's logits'
        # backward, run by autograd, stays in head_fwd_bwd)
        t["head_fwd_bwd"] = max(split_total - t["data"] - t["target_forward"] - t["loss"] - t["optimizer"], 0.0)
        pf = peak_flops(device)
        row = {
            "micro_batch_size": int(cfg.train.micro_batch_size), "grad_accum": int(cfg.train.grad_accum),
            "world_size": recipe.world, "steps_timed": args.steps,
            "target_tokens_per_s": tokens / dt, "samples_per_s": samples / dt, "s_per_step": dt / args.steps,
            "tokens_per_step": tokens / args.steps,
            "model_tflops_per_s": flops / dt / 1e12, "mfu": flops / dt / pf if pf else None,
            "peak_memory_bytes": int(peak), "peak_memory_gib": round(peak / 2**30, 3),
            "split_steps": args.split_steps,
            "split_ms_per_step": {k: 1e3 * t[k] / max(args.split_steps, 1) for k in PHASES},
            "split_share": {k: t[k] / split_total if split_total else None for k in PHASES},
            "target": cfg.target.name_or_path.replace(str(REPO_ROOT) + "/", ""),
            "stage": int(cfg.stage.id), "features": cfg.features.mode,
            "gradient_checkpointing": bool(cfg.train.gradient_checkpointing),
            "zero_stage": int(cfg.deepspeed.get("zero_optimization", {}).get("stage", 0)),
            "precision": "bf16" if recipe.engine.bfloat16_enabled() else "fp32",
            "target_dtype": str(recipe.target.dtype).replace("torch.", ""),
            "loader_workers": int(cfg.train.loader_workers),
        }
        recipe.cleanup()
    return row


# ----------------------------------------------------------------------------- report
def environment() -> dict:
    import transformers

    from msd_train.evaluation.cpu_setting import cpu_identity

    env = {"cpu": cpu_identity(), "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "platform": platform.platform(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "load_average": [round(x, 2) for x in os.getloadavg()]}
    try:
        import deepspeed

        env["deepspeed"] = deepspeed.__version__
    except ImportError:
        env["deepspeed"] = None
    if torch.cuda.is_available():
        env.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda,
                   gpu_memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
    else:
        env["gpu"] = None
    return env


def markdown(r: dict) -> str:
    e = r["environment"]
    lines = [f"# MSD training throughput: `{r['target']}` on {e['gpu'] or e.get('cpu') or 'CPU'}", "",
             f"- command: `{r['command']}`", f"- created: {r['created']}",
             f"- torch {e['torch']}, transformers {e['transformers']}, deepspeed {e['deepspeed']}, "
             f"cuda {e.get('cuda')}, python {e['python']}; {e['cpu_count']} CPUs, load {e['load_average']}",
             f"- {r['sample']}", ""]
    if r.get("note"):
        lines += [r["note"], ""]
    lines += ["| micro-batch | s/step | target tokens/s | MFU | peak GiB | data | target fwd | head fwd+bwd | loss | optimizer |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        if row.get("oom") or row.get("failed"):
            what = "OOM" if row.get("oom") else "failed: " + " ".join(row.get("error") or []).replace("|", "/")
            lines.append(f"| {row['micro_batch_size']} | {what} | | | | | | | | |")
            continue
        sp = row["split_share"]
        mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "-"
        lines.append(f"| {row['micro_batch_size']} | {row['s_per_step']:.3f} | {row['target_tokens_per_s']:.0f} | "
                     f"{mfu} | {row['peak_memory_gib']:.2f} | "
                     + " | ".join(f"{100 * sp[k]:.0f}%" if sp.get(k) is not None else "-" for k in PHASES) + " |")
    best = r["best_target_tokens_per_s"]
    lines += ["", f"best {best:.0f} target tokens/s (goal >= {GOAL_TOKENS_PER_S}, first bar {FIRST_BAR}, "
                  "on one H100 at the 7B shape)", ""]
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="target.name_or_path (a folder from make_large_target.py)")
    ap.add_argument("--micro-batches", type=counts(), default=None, help="e.g. 1,2,4 (default: the config's)")
    ap.add_argument("--seq-len", type=at_least(1), default=None, help="synthetic one-image samples of this many tokens")
    ap.add_argument("--samples", type=at_least(1), default=32, help="synthetic samples (the curriculum cycles over them)")
    ap.add_argument("--vision-tokens", type=at_least(1), default=577, help="vision tower tokens per image (FLOPs)")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--steps", type=at_least(1), default=20)
    ap.add_argument("--warmup", type=at_least(0), default=3)
    ap.add_argument("--split-steps", type=at_least(1), default=5)
    ap.add_argument("--profile", action="store_true", help="also write a torch.profiler table per size")
    ap.add_argument("--note", default=None)
    ap.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "train" / "tiny_cpu.json"))
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # child process: one size
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    overrides = list(args.overrides)
    if args.target:
        overrides.append(f"target.name_or_path={args.target}")
    if args.gradient_checkpointing:
        overrides.append("train.gradient_checkpointing=true")
    if args.one:
        print("BENCH_ROW " + json.dumps(run_one(args, overrides)), flush=True)
        return {}

    sizes = args.micro_batches or [None]
    rows = []
    for mb in sizes:
        child = [sys.executable, "-m", "lab.bench.train", "--one", "--steps", str(args.steps),
                 "--warmup", str(args.warmup), "--split-steps", str(args.split_steps), "--samples", str(args.samples),
                 "--vision-tokens", str(args.vision_tokens), "--out", args.out]
        child += ["--profile"] if args.profile else []
        if args.seq_len:
            child += ["--seq-len", str(args.seq_len)]
        child += ["--", *overrides] + ([f"train.micro_batch_size={mb}"] if mb else [])
        # the child finds the lab where this process did (its relative paths stay relative to the same folder)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        proc = subprocess.run(child, capture_output=True, text=True, env=env)
        found = [line for line in proc.stdout.splitlines() if line.startswith("BENCH_ROW ")]
        if proc.returncode != 0 or not found:
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
            rows.append({"micro_batch_size": mb, "failed": True, "error": proc.stderr.strip().splitlines()[-1:]})
            continue
        rows.append(json.loads(found[-1][len("BENCH_ROW "):]))
        r = rows[-1]
        print(f"micro-batch {r['micro_batch_size']}: " + ("OOM" if r.get("oom") else
              f"{r['target_tokens_per_s']:.0f} target tokens/s, {r['s_per_step']:.3f} s/step, "
              f"peak {r['peak_memory_gib']:.2f} GiB"), flush=True)
    ok = [r for r in rows if "target_tokens_per_s" in r]
    best = max((r["target_tokens_per_s"] for r in ok), default=0.0)
    result = {
        "what": "MSD training step through TrainRecipe (DataLoader collation, online or offline features, "
                "head forward/backward, DeepSpeed step)",
        "target": ok[0]["target"] if ok else args.target,
        "sample": (f"synthetic: {args.seq_len} tokens per sample with one image (stage 2 path, multimodal share 1)"
                   if args.seq_len else "the configured data"),
        "command": " ".join(["python -m lab.bench.train", *(sys.argv[1:] if argv is None else argv)]),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": environment(), "rows": rows, "best_target_tokens_per_s": best,
        "goal_target_tokens_per_s": GOAL_TOKENS_PER_S, "first_bar_target_tokens_per_s": FIRST_BAR,
        "note": args.note,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    failed = [r for r in rows if r.get("failed")]
    if failed:  # a broken run is not a measurement: the caller (the GPU session's step) sees it
        raise SystemExit(f"lab.bench.train: micro-batch {', '.join(str(r['micro_batch_size']) for r in failed)} failed "
                         f"({' '.join(failed[0]['error'])}); the output above says why")
    return result


if __name__ == "__main__":
    from msd_train.errors import run_main

    run_main(main)  # a known failure (a missing path, a full disk, Ctrl-C): one line, exit non-zero
