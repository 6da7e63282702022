"""Training runs through the real entry point and launchers (CPU, gloo)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def train(args, launcher=(sys.executable,), check=True, **kw):
    cmd = [*launcher, str(ROOT / "train.py"), *args]
    out = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900, **kw)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}")
    return out


def weights(run_dir, stage=1, name="final"):
    return load_file(Path(run_dir) / f"stage{stage}" / name / "model.safetensors")


def losses(run_dir, stage=1):
    lines = (Path(run_dir) / f"stage{stage}" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["loss"] for x in lines if '"loss"' in x and "val/" not in x]


@pytest.mark.slow
def test_resume_after_kill_is_exact(mini_run, tmp_path):
    common = [*mini_run, "train.max_steps=8", "checkpoint.every=2", "eval.every=100",
              "train.micro_batch_size=2", "train.grad_accum=2"]
    train(["stage=1", *common, f"run_dir={tmp_path / 'straight'}"])
    run = tmp_path / "resumed"
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), "stage=1", *common, f"run_dir={run}"],
                            cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = run / "stage1" / "checkpoints" / "step-000002" / "recipe_state.json"
    deadline = time.time() + 300
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run / "stage1" / "final").exists(), "the run finished before it could be interrupted"
    out = train(["stage=1", *common, f"run_dir={run}"])
    assert "resuming from" in out.stderr + out.stdout
    a, b = weights(tmp_path / "straight"), weights(run)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    assert losses(tmp_path / "straight") == losses(run)
    # a finished stage is not retrained by the same command
    again = train(["stage=1", *common, f"run_dir={run}"])
    assert "already finished" in again.stderr + again.stdout


@pytest.mark.slow
def test_two_ranks_equal_one_rank_with_double_accumulation(mini_run, tmp_path):
    common = [*mini_run, "train.max_steps=3", "eval.every=100", "checkpoint.every=100",
              "train.micro_batch_size=2", "train.noise=none"]
    train(["stage=1", *common, "train.grad_accum=2", f"run_dir={tmp_path / 'one'}"])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533"]
    train(["stage=1", *common, "train.grad_accum=1", f"run_dir={tmp_path / 'two'}"], launcher=torchrun)
    a, b = weights(tmp_path / "one"), weights(tmp_path / "two")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    assert losses(tmp_path / "one") == pytest.approx(losses(tmp_path / "two"), rel=1e-5)


def test_stage2_refuses_without_stage1(mini_run, tmp_path):
    out = train(["stage=2", *mini_run, f"run_dir={tmp_path}"], check=False)
    assert out.returncode != 0
    assert "holds no exported head; run stage=1 with the same run_dir first" in out.stderr + out.stdout



@pytest.mark.slow
def test_deepspeed_launcher_two_stages_on_the_embedded_default(tmp_path):
    """The README journey, shortened: `deepspeed train.py stage=1`, then `stage=2`."""
    from msd_train.data.curriculum import mm_share
    from msd_train.draft import MSDDraftModel

    ds = ["deepspeed", "--num_gpus", "1", "--master_port", "29541"]
    common = [f"run_dir={tmp_path}", "logging.wandb.mode=disabled", "logging.progress=false",
              f"data.cache_dir={tmp_path / 'cache'}", "data.max_heldout=16", "eval.every=1000"]
    train(["stage=1", *common, "train.max_steps=30"], launcher=ds)
    ramp = ["stage.curriculum.start=0.25", "stage.curriculum.end=0.75", "stage.curriculum.ramp_steps=10"]
    train(["stage=2", *common, "train.max_steps=12", *ramp], launcher=ds)
    for stage in (1, 2):
        head = MSDDraftModel.from_pretrained(tmp_path / f"stage{stage}" / "final")
        assert head.config.decouple_visual
    rows = [json.loads(x) for x in (tmp_path / "stage2" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "mm_share" in r]
    assert len(steps) == 12
    global_batch = 4
    for r in steps:
        sched = mm_share(r["step"] - 1, 0.25, 0.75, 10)
        assert r["mm_share_scheduled"] == pytest.approx(sched)
        assert abs(r["mm_share"] - sched) <= 1 / global_batch + 1e-9
    # held-out agreement rises over stage 1 (validation runs at step 0 and at the end)
    val1 = [json.loads(x) for x in (tmp_path / "stage1" / "metrics.jsonl").read_text().splitlines()
            if "val/text/top1" in x]
    assert val1[-1]["val/text/top1"] > val1[0]["val/text/top1"] + 0.05
    # stage 2 validates on both held-out sets
    val2 = [json.loads(x) for x in (tmp_path / "stage2" / "metrics.jsonl").read_text().splitlines() if "val/" in x]
    assert "val/mm/sim_tau" in val2[-1] and "val/text/sim_tau" in val2[-1]
