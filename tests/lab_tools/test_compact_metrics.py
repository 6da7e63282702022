"""lab/studies/real_lm/compact_metrics.py and scale_collect.sh WORK RUN: a run's committed metrics
keep every validation line whole and what the tables read of each training step."""

import gzip
import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(work: Path, name: str) -> list[dict]:
    rows = [{"step": s, "loss": 1.0 / s, "feat_loss": 0.3, "tok_loss": 2.123456789, "top1": 0.5123456,
             "mm_share": 0.375, "lr": 1e-4, "tokens": 3472.0, "tokens_per_s": 1031.52902} for s in (1, 2)]
    rows.append({"step": 2, "val/sim_tau": 1.93612345, "val/text/sim_tau": 1.9, "val/mm/sim_tau": 2.2})
    stage = work / "runs" / name / "stage2"
    stage.mkdir(parents=True)
    (stage / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    return rows


def test_collect_compacts_the_named_runs_metrics(tmp_path):
    rows = _run(tmp_path, "probe-run")
    out = tmp_path / "collected"
    subprocess.run(["bash", "lab/studies/real_lm/scale_collect.sh", str(tmp_path), "probe-run"], cwd=ROOT,
                   check=True, capture_output=True, text=True, env={**os.environ, "OUT": str(out)})
    got = [json.loads(line) for line in gzip.open(out / "runs" / "probe-run" / "stage2" / "metrics.jsonl.gz", "rt")]
    assert got[2] == rows[2]  # the validation line whole
    assert got[0] == {"step": 1, "loss": 1.0, "top1": 0.51235, "mm_share": 0.375, "lr": 1e-4, "tokens_per_s": 1031.5}
    assert len(got) == 3  # the blank line dropped


def test_collect_names_a_run_it_cannot_find(tmp_path):
    res = subprocess.run(["bash", "lab/studies/real_lm/scale_collect.sh", str(tmp_path), "no-such-run"], cwd=ROOT,
                         capture_output=True, text=True)
    assert res.returncode != 0
    assert f"no {tmp_path}/runs/no-such-run/stage*/metrics.jsonl" in res.stderr


def test_collect_everything_compacts_every_runs_metrics_the_same_way(tmp_path):
    rows = _run(tmp_path, "probe-run")
    (tmp_path / "runs" / "no-metrics-yet" / "stage1").mkdir(parents=True)  # a run that has not logged: passed over
    (tmp_path / "splits").mkdir()
    (tmp_path / "splits" / "splits.json").write_text("{}")
    out = tmp_path / "collected"
    subprocess.run(["bash", "lab/studies/real_lm/scale_collect.sh", str(tmp_path)], cwd=ROOT, check=True,
                   capture_output=True, text=True, env={**os.environ, "OUT": str(out)})
    got = [json.loads(line) for line in gzip.open(out / "runs" / "probe-run" / "stage2" / "metrics.jsonl.gz", "rt")]
    assert got[2] == rows[2] and set(got[0]) == {"step", "loss", "top1", "mm_share", "lr", "tokens_per_s"}
    assert not (out / "runs" / "no-metrics-yet").exists()
    assert (out / "splits.json").read_text() == "{}"
