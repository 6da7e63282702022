"""Training throughput and peak memory of the MSD recipe.

    python scripts/bench_train.py [overrides...]      # e.g. stage=2 train.micro_batch_size=8

Runs the real recipe in one process (same code path as train.py), times ``steps``
optimizer steps after ``warmup`` steps, and writes a JSON under benchmarks/train/.
Target tokens/s counts every token the frozen target reads (padding excluded), which is
what bounds online training. Peak memory is the process's max RSS on CPU and the CUDA
allocator's peak on GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from msd_train.config import CONF_DIR, REPO_ROOT, strip_launcher_args  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "train" / "tiny_cpu.json"))
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    argv = ["bench", *args.overrides]
    strip_launcher_args(argv)
    with tempfile.TemporaryDirectory() as tmp, initialize_config_dir(str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=[f"run_dir={tmp}", "logging.wandb.mode=disabled",
                                           "logging.progress=false", *argv[1:]])
        from msd_train.training.recipe import TrainRecipe

        recipe = TrainRecipe(cfg)
        recipe.setup()
        cuda = recipe.device.type == "cuda"
        for _ in range(args.warmup):
            recipe.train_step()
            recipe.step += 1
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        tokens = samples = 0
        t0 = time.perf_counter()
        for _ in range(args.steps):
            m = recipe.train_step()
            recipe.step += 1
            tokens += m["tokens"]
            samples += recipe.global_batch
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        peak = (torch.cuda.max_memory_allocated() if cuda
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        result = {
            "what": "MSD training step (online features: frozen target forward + head forward/backward)",
            "target": cfg.target.name_or_path.replace(str(REPO_ROOT) + "/", ""),
            "stage": int(cfg.stage.id), "overrides": args.overrides,
            "micro_batch_size": cfg.train.micro_batch_size, "grad_accum": cfg.train.grad_accum,
            "world_size": recipe.world, "steps_timed": args.steps,
            "target_tokens_per_s": tokens / dt, "samples_per_s": samples / dt, "s_per_step": dt / args.steps,
            "peak_memory_bytes": int(peak), "peak_memory_kind": "cuda_max_allocated" if cuda else "process_max_rss",
            "device": torch.cuda.get_device_name() if cuda else f"cpu ({torch.get_num_threads()} threads)",
            "torch": torch.__version__, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d"),
        }
        recipe.cleanup()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
