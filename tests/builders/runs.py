"""Runs for tests: configs composed as the entry points compose them, the recipe in-process,
the feature store's inputs, and the launcher helpers the robustness tests share (start,
wait for steps, kill a session, fake or check a checkpoint)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch

from builders import ROOT
from msd_train.config import CONF_DIR, strip_launcher_args
from msd_train.training import checkpoint as ckpt


def recipe(overrides):
    from hydra import compose, initialize_config_dir

    from msd_train.training.recipe import TrainRecipe

    with initialize_config_dir(str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=["logging.wandb.mode=disabled", "logging.progress=false", *overrides])
    r = TrainRecipe(cfg)
    r.setup()
    return r


def compose(name: str, overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(str(CONF_DIR), version_base=None):
        return hydra_compose(name, overrides=overrides)


def data_overrides(mini_run):
    return [o for o in mini_run if o.startswith(("target.", "data."))]


def gen_cfg(mini_run, path, *extra):
    return compose("generate_features", [*data_overrides(mini_run), f"features.path={path}",
                                         "features.samples_per_shard=8", "features.dtype=fp32", "progress=false",
                                         *extra])


def train_cfg(mini_run, path, *extra):
    return compose("config", [*mini_run, "stage='2'", "features=offline", f"features.path={path}", *extra])


def batch_of(target, rows):
    from msd_train.data.collate import collate

    return collate(rows, target, pixels=True)


def split_rows(mini_run, target, name):
    from msd_train.data.dataset import build_split
    from msd_train.features.generate import split_sources

    cfg = gen_cfg(mini_run, "unused")
    ds = build_split(split_sources(cfg, name), target, cfg.data.max_length, "skip", cfg.data.cache_dir).dataset
    return [ds[i] for i in range(len(ds))]

ENV = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
       "PYTHONPATH": str(ROOT)}

FAST = ["eval.every=1000", "train.micro_batch_size=2", "data.max_heldout=4"]


def steps(run_dir, stage=1):
    lines = (Path(run_dir) / f"stage{stage}" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["step"] for x in lines if '"loss"' in x and "val/" not in x]


def fake_checkpoint(root: Path, step: int, state: dict | None = None) -> Path:
    """A checkpoint folder shaped like the recipe's (engine files are real torch zips)."""
    p = ckpt.step_dir(root, step)
    (p / "engine").mkdir(parents=True)
    torch.save({"w": torch.zeros(2)}, p / "engine" / "mp_rank_00_model_states.pt")
    torch.save({"o": torch.zeros(2)}, p / "engine" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (p / ckpt.STATE_FILE).write_text(json.dumps(state or {"step": step, "curriculum": {}, "bad_total": 0,
                                                          "best_tau": -1.0, "global_batch": 4, "world_size": 1}))
    return p


def base_train_cfg(tmp_path) -> dict:
    data = tmp_path / "d.json"
    data.write_text("[]")
    return {"seed": 0, "resume": "auto", "stage": {"id": 2, "curriculum": {"start": 0.0, "end": 0.5, "ramp_steps": 5,
                                                                            "schedule": "linear"}},
            "train": {"max_steps": 10, "micro_batch_size": 2, "grad_accum": 1, "lr": 1e-4, "betas": [0.9, 0.95],
                      "noise": "uniform", "precision": "auto", "gradient_checkpointing": False},
            "eval": {"every": 5}, "checkpoint": {"every": 5, "keep": 2},
            "data": {"text": [{"path": str(data)}], "heldout_text": [], "heldout_multimodal": [],
                     "multimodal": [{"path": str(data), "image_root": str(tmp_path)}], "on_bad_sample": "skip",
                     "max_length": 64, "num_proc": 1},
            "logging": {"wandb": {"mode": "disabled"}}, "features": {"mode": "online"}}


def wait_for_steps(run: Path, proc, n: int = 2) -> None:
    deadline = time.time() + 600
    metrics = run / "stage1" / "metrics.jsonl"
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len([x for x in metrics.read_text().splitlines() if '"loss"' in x]) >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"training did not start (exit {proc.poll()})")


def trainer_processes(launcher_pid: int) -> list:
    import psutil

    return [p for p in psutil.Process(launcher_pid).children(recursive=True) if "train.py" in " ".join(p.cmdline())
            and not any(s in " ".join(p.cmdline()) for s in ("deepspeed.launcher", "torch.distributed.run"))]


def kill_session(proc) -> None:
    """SIGKILL the launcher's session: nothing of a failed case may live on."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def assert_stopped_with_checkpoint(run, output: str) -> int:
    """A stopped launch left a complete checkpoint of a step it logged, and said so; returns the step."""
    saved = ckpt.complete_checkpoints(run / "stage1" / "checkpoints")
    assert saved, f"no checkpoint was saved:\n{output[-5000:]}"
    step = ckpt.read_state(saved[-1])["step"]
    assert step >= 2 and step in steps(run)
    assert f"interrupted at step {step}; checkpoint saved" in output, output[-5000:]
    return step


# entry point -> (config folder, config name)
ENTRY_POINTS = {
    "train.py": (CONF_DIR, "config"),
    "eval.py": (CONF_DIR, "eval"),
    "scripts/export.py": (CONF_DIR / "hub", "export"),
    "scripts/import_reference.py": (CONF_DIR / "hub", "import_reference"),
    "scripts/push_to_hub.py": (CONF_DIR / "hub", "push"),
    "scripts/check_data.py": (CONF_DIR, "check_data"),
}


def compose_entry(entry, overrides=()):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    conf_dir, name = ENTRY_POINTS[entry]
    argv = [entry, *overrides]
    strip_launcher_args(argv)  # what train.py and eval.py do first (stage=1 -> stage='1')
    with initialize_config_dir(config_dir=str(conf_dir), version_base=None):
        return hydra_compose(config_name=name, overrides=argv[1:])
