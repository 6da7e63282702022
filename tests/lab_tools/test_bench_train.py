"""lab/bench/train.py, the program the GPU session's `train` part runs, measures a real step on
the embedded default: a broken hook would cost a GPU session's minutes, so it runs here."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_one_timed_step_gives_a_row_with_its_time_split_and_names_the_machine(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "lab.bench.train", "--steps", "1", "--warmup", "0",
                           "--split-steps", "1", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    (row,) = r["rows"]
    assert row["target_tokens_per_s"] > 0 and row["s_per_step"] > 0
    # every phase was timed, the token loss among them (the hook on the objectives' loss function)
    assert all(row["split_ms_per_step"][k] > 0 for k in ("target_forward", "head_fwd_bwd", "loss", "optimizer"))
    assert r["environment"]["cpu"] in out.with_suffix(".md").read_text()
