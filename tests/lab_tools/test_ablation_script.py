"""lab/studies/ablation.py over several seeds: each cell is the mean ± sd of the seeds' numbers."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _stage(folder: Path, sim_tau: float) -> None:
    (folder / "final").mkdir(parents=True)
    (folder / "final" / "config.json").write_text("{}")
    rows = [{"step": s, "tokens": 100, "tokens_per_s": 100.0 * s / (2.0 * s)} for s in (1, 2)]  # 2 s/step
    rows.append({"step": 2, "val/sim_tau": sim_tau, "val/text/sim_tau": sim_tau})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _report(folder: Path, tau: float, accept: list[float]) -> None:
    folder.mkdir(parents=True)
    report = {"overall": {"tau": tau, "accept_at_pos": accept, "outputs_match_ar": True, "n_turns": 3},
              "per_category": {"text": {"tau": tau}}, "decoding": {"method": "tree"}, "device": "cpu"}
    (folder / "report.json").write_text(json.dumps(report))


def test_the_table_gives_mean_and_sd_over_seeds(tmp_path):
    run = tmp_path / "runs"
    for seed, root, tau in ((0, run, 2.0), (1, run / "seed1", 2.2)):
        for stage_dir, name in ((root / "msd" / "stage1", "a"), (root / "msd" / "stage2", "b"),
                                (root / "coupled" / "stage2", "c")):
            _stage(stage_dir, sim_tau=1.5 + seed * 0.1)
            # position 3 reached by seed 0 only
            _report(root / "eval" / f"msd-{name}-tree", tau, [0.5, 0.4, 0.3] if seed == 0 else [0.7, 0.6])
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "lab.studies.ablation", "--seeds", "0", "1",
                           "--run-dir", str(run), "--out", str(out), "--table-only"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = (out / "ablation.md").read_text()
    assert "mean ± sample standard deviation over 2 seeds (0, 1)" in table
    # steps, s/step, sim tau text, tree tau, tree: text, matches AR
    assert "| msd a: stage 1 only | 2 | 2.000 ± 0.000 | 1.550 ± 0.071 | 2.100 ± 0.141 | 2.100 ± 0.141 | True |" in table
    assert "| msd b: stage 1 + 2 (decoupled) | tree | 0.600 ± 0.141 | 0.500 ± 0.141 | 0.300 | - | - | - |" in table
    rows = json.loads((out / "ablation.json").read_text())["rows"]
    assert rows["msd c: stage 1 + 2, decoupling off"]["tree"]["tau"]["values"] == [2.0, 2.2]
    assert "Missing" not in table
