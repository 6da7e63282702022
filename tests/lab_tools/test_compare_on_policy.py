"""lab/studies/on_policy.py, smoke: both arms from one head, two steps each, one JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_both_arms_train_from_the_same_head_and_are_measured(mini_run, head_dir, tmp_path):
    out = tmp_path / "out"
    def study(*arms):
        return subprocess.run(
            [sys.executable, "-m", "lab.studies.on_policy", "--head", head_dir, "--budget", "600",
             "--max-steps", "2", "--out", str(out), *arms, "--", *mini_run, f"data.cache_dir={tmp_path / 'cache'}",
             "train.micro_batch_size=2", "train.rollout_steps=2", "train.loader_workers=0"],
            cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})

    proc = study()
    assert proc.returncode == 0, proc.stderr[-3000:]
    arms = json.loads((out / "results.json").read_text())["arms"]
    assert set(arms) == {"before", "on_policy", "supervised"}
    assert arms["on_policy"]["steps"] == arms["supervised"]["steps"] == 2
    for arm in arms.values():
        assert len(arm["text"]["accept_at_pos"]) == 5 and arm["sim_tau"] >= 1.0
    assert (out / "on_policy" / "stage3" / "final" / "model.safetensors").is_file()
    assert (out / "supervised" / "stage2" / "final" / "model.safetensors").is_file()

    # one arm again: the other's results stay, this arm's decoder runs of its earlier head move aside
    (out / "eval-supervised-chain").mkdir()
    (out / "eval-supervised-chain" / "report.json").write_text("{}")
    proc = study("--arms", "supervised")
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = json.loads((out / "results.json").read_text())["arms"]
    assert again["on_policy"] == arms["on_policy"] and again["supervised"]["steps"] == 2
    assert not (out / "eval-supervised-chain").exists()
    assert [p.name.startswith("eval-supervised-chain-") for p in (out / "earlier").iterdir()] == [True]
