"""lab/scripts/bench_gpu.py: the small config runs end to end on a CPU and writes every field."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "lab" / "scripts" / "bench_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpu"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name, published", [("llava15_7b", 7.06e9), ("llava15_13b", 13.35e9), ("qwen2vl_7b", 8.29e9)])
def test_a_published_config_builds_the_published_model_and_prompt(name, published):
    """The model the GPU bench times has the published checkpoint's size (built on the meta
    device: no memory), and its prompt is LLaVA-1.5's: 640 tokens, 576 of them visual."""
    import torch

    bench = _load()
    target = bench.build_target(name, torch.device("meta"), torch.bfloat16)
    assert sum(p.numel() for p in target.model.parameters()) == pytest.approx(published, rel=1e-3)
    prompt = bench.build_prompt(target)
    assert len(prompt.input_ids) == 640 and int((prompt.input_ids == target.image_token_id).sum()) == 576


@pytest.mark.slow
def test_small_config_writes_every_field(tmp_path):
    bench = _load()
    out = tmp_path / "b.json"
    argv = ["--config", "small", "--device", "cpu", "--repeats", "1", "--warmup", "0", "--new-tokens", "3",
            "--out", str(out)]
    bench.main(argv)
    r = json.loads(out.read_text())
    md = out.with_suffix(".md").read_text()
    assert md.startswith("# MSD decoder")
    assert r["dry_run"] is True and "not a GPU measurement" in r["dry_run_note"]
    assert r["complete"] is True and r["hf_caches"] == ["dynamic", "static"]  # the JSON is rewritten per section
    for key in ("config", "device", "dtype", "created", "command", "environment", "target", "draft", "bandwidth",
                "prompt_tokens", "plain_decoding", "cycle", "ensemble", "goals", "goals_met"):
        assert key in r, key
    assert r["prompt_tokens"] == 640
    for key in ("torch", "transformers", "python", "deepspeed", "gpu"):
        assert key in r["environment"], key

    # 1. plain decoding: the project's loop, generate() with both caches, the bandwidth limit
    p = r["plain_decoding"]
    assert p["outputs_match"] and p["hf_static_outputs_match"]  # same tokens as generate(), graphs or not
    # both generate() modes ran (timings of one repeat of 3 tokens are noise: not asserted)
    assert p["hf_generate_ms_per_token"] is not None and p["hf_generate_static_ms_per_token"] is not None
    assert p["hf_static_note"] is None
    # the limit counts what one step reads: the language model (fp32 here) and the lm_head, not the embeddings
    t = bench.CONFIGS["small"]["text"]
    h, inter, layers, vocab = t["hidden_size"], t["intermediate_size"], t["num_hidden_layers"], t["vocab_size"]
    params = layers * (4 * h * h + 3 * h * inter + 2 * h) + h + vocab * h
    assert p["weight_gb_per_step"] == pytest.approx(4 * params / 1e9, abs=1e-3)
    limit = p["weight_gb_per_step"] / r["bandwidth"]["gb_per_s"] * 1e3
    assert p["bandwidth_limit_ms_per_token"] == pytest.approx(limit, rel=0.01)
    assert p["fraction_of_bandwidth_limit"] == pytest.approx(limit / p["project_ar_ms_per_token"], rel=0.01)
    assert "bandwidth limit" in md and "static cache" in md

    # 2-5. the cycle table: every tree size, and the ratios follow from the parts
    c = r["cycle"]
    assert list(c["verify_ms_by_tree_size"]) == [str(n) for n in bench.TREE_SIZES]
    for n in bench.TREE_SIZES:
        assert f"| {n} | " in md, n
    assert c["default_tree"]["nodes"] == 60
    b = c["bookkeeping_ms"]
    assert b["forced_path"][0] == 0 and len(b["forced_path"]) >= 2
    cy = c["cycle"]
    parts = (c["draft_tree_ms"]["median"] + c["default_tree_verify_ms"]["median"]
             + b["accept_greedy_and_read"]["median"] + b["commit_forced_path"]["median"])
    assert cy["cycle_ms"] == pytest.approx(parts, rel=1e-3)
    assert cy["step_ms"] == pytest.approx(p["project_ar_ms_per_token"], rel=1e-3)
    assert cy["cycle_over_step"] == pytest.approx(cy["cycle_ms"] / cy["step_ms"], rel=1e-3)
    assert set(cy["speedup_at_tau"]) == {"2", "3", "4", "4.54"}
    for tau, s in cy["speedup_at_tau"].items():
        # the report rounds to 4 decimals: on a loaded CPU the ratio is large and the
        # speedup small enough (0.0349) that the rounding exceeds the relative tolerance
        assert s == pytest.approx(float(tau) / cy["cycle_over_step"], rel=1e-3, abs=5e-5)
    loop = cy["in_decode_loop_ms"]
    assert loop["total"]["n"] == loop["draft"]["n"] > 0  # timed_decode timed every cycle

    # 5b. ensemble rows
    en = r["ensemble"]
    assert en["rows"]["ibed-MTP (padded)"] == en["rows"]["M"]  # M is the longest row
    for m in ("tree", "chain_k5"):
        assert en[m]["overhead"] == pytest.approx(en[m]["ibed-MTP"]["median"] / en[m]["M"]["median"] - 1, abs=1e-3)
    assert "5b. Ensemble drafting" in md
    assert set(r["goals_met"]) >= {"speedup at tau 4.54 >= 3.0", "project AR >= 80% of the bandwidth limit"}


# ----- scripts/gpu_session.sh: the one-call plan, its budget and the carried wheels -----------------

SESSION = ROOT / "scripts" / "gpu_session.sh"
PLAN_LINE = re.compile(r"^  (\w+)\s+(\d+):(\d\d)  \S")
TOTAL = re.compile(r"^total: (\d+(?:\.\d)?) min \(budget (\d+) min\)$")


def _session(*args, tmp_path, env=None, timeout=60):
    """Run gpu_session.sh with an empty wheel folder (the dry run must not depend on a pack)."""
    wheels = tmp_path / "whl"
    wheels.mkdir(exist_ok=True)
    full = {k: v for k, v in os.environ.items() if not k.startswith(("EST_", "DRY_TOOK", "BUDGET_MIN", "MIN_SLACK"))}
    full.update(WHL=str(wheels), OUT=str(tmp_path / "out"), WORK=str(tmp_path / "work"), **(env or {}))
    return subprocess.run(["bash", str(SESSION), *args], capture_output=True, text=True, env=full, timeout=timeout,
                          cwd=ROOT)


def _plan(stdout: str) -> dict[str, int]:
    """The plan lines printed before the first part starts: part -> estimated seconds."""
    head = stdout.split("\n[0:00]")[0]
    return {m[1]: int(m[2]) * 60 + int(m[3]) for line in head.splitlines() if (m := PLAN_LINE.match(line))}


@pytest.mark.parametrize("local", [False, True])
def test_dry_run_prints_the_plan_and_ends_with_the_total(tmp_path, local):
    r = _session("run", "--dry-run", *(["--local"] if local else []), tmp_path=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    plan = _plan(r.stdout)
    assert list(plan) == ["setup", "readme", "decode", "train"]
    assert all(s > 0 for s in plan.values())
    m = TOTAL.match(lines[-1])
    assert m, lines[-1]
    total, budget = float(m[1]), int(m[2])
    assert budget == 8 and total <= budget
    assert 0 <= total - sum(plan.values()) / 60 < 0.1  # rounded up to a tenth
    assert lines[0].endswith("(dry run)") and any(line.startswith("budget: 8 min") for line in lines[:3])
    # every part starts in order, none skipped, and prints its commands (nothing is run)
    starts = [line.split("== ")[1].split()[0] for line in lines if "] == " in line]
    assert starts == list(plan) and "SKIP" not in r.stdout
    order = ["deepspeed train.py stage=1", "deepspeed train.py stage=2", "python eval.py", "setsid deepspeed",
             "python lab/scripts/bench_gpu.py", "python lab/scripts/make_large_target.py", "python lab/scripts/bench_train.py"]
    at = [r.stdout.index("+ " + cmd) for cmd in order]
    assert at == sorted(at)
    device = "cpu" if local else "cuda"
    assert f"--device {device}" in r.stdout
    bench_train = next(line for line in lines if line.startswith("+ python lab/scripts/bench_train.py"))
    assert "--micro-batches" in bench_train and "," not in bench_train.split("--micro-batches ")[1].split()[0]
    assert not (tmp_path / "out").exists()  # a dry run writes nothing under $OUT


def test_the_plan_follows_the_estimates_and_the_budget(tmp_path):
    r = _session("run", "--dry-run", tmp_path=tmp_path, env={"EST_decode": "200", "BUDGET_MIN": "10"})
    plan = _plan(r.stdout)
    assert plan["decode"] == 200
    m = TOTAL.match(r.stdout.strip().splitlines()[-1])
    assert m and int(m[2]) == 10 and 0 <= float(m[1]) - sum(plan.values()) / 60 < 0.1


def test_a_part_whose_estimate_does_not_fit_is_skipped_and_the_next_still_runs(tmp_path):
    plan = _plan(_session("run", "--dry-run", tmp_path=tmp_path).stdout)
    # decode estimated at the whole budget: it cannot fit once setup and readme have run; train still does
    r = _session("run", "--dry-run", tmp_path=tmp_path, env={"EST_decode": str(8 * 60)})
    assert r.returncode == 0
    skip = [line for line in r.stdout.splitlines() if "SKIP" in line]
    assert len(skip) == 1 and "SKIP decode" in skip[0], skip
    assert skip[0].startswith(f"[{(plan['setup'] + plan['readme']) // 60}:")
    assert "+ python lab/scripts/bench_gpu.py" not in r.stdout and "+ python lab/scripts/bench_train.py" in r.stdout
    assert TOTAL.match(r.stdout.strip().splitlines()[-1])


def test_an_overrunning_part_is_stopped_at_its_share_and_later_parts_skipped(tmp_path):
    """The dry run's clock: readme takes far longer than its estimate (a hang): it is stopped at
    its share, and what is left of the budget decides which later parts still start."""
    budget = 8 * 60
    plan = _plan(_session("run", "--dry-run", tmp_path=tmp_path).stdout)
    r = _session("run", "--dry-run", tmp_path=tmp_path, env={"DRY_TOOK": "readme=3000"})
    out = r.stdout
    assert "TIMEOUT at its share" in out
    line = next(x for x in out.splitlines() if "== readme" in x)
    mm, ss = re.search(r"stopped at (\d+):(\d\d)", line).groups()
    share = int(mm) * 60 + int(ss)
    assert plan["readme"] < share <= budget - plan["setup"]
    elapsed = plan["setup"] + share
    for part in ("decode", "train"):
        fits = elapsed + plan[part] <= budget
        assert (f"SKIP {part}" in out) != fits, (part, elapsed, plan)
        if fits:
            elapsed += plan[part]
    assert "SKIP train" in out  # with these estimates, a hung readme costs the throughput part


def test_extra_call_plans_the_other_shapes_and_sizes(tmp_path):
    r = _session("run", "extra", "--dry-run", tmp_path=tmp_path)
    assert list(_plan(r.stdout)) == ["setup", "decode_13b", "decode_qwen2vl", "train_mb"]
    assert "--config llava15_13b" in r.stdout and "--config qwen2vl_7b" in r.stdout
    assert "--config llava15_7b" not in r.stdout
    m = TOTAL.match(r.stdout.strip().splitlines()[-1])
    assert m and float(m[1]) <= int(m[2])
    # a rerun of one part after a fix: setup (the wheels) comes first by itself
    r = _session("run", "decode", "--dry-run", tmp_path=tmp_path)
    assert list(_plan(r.stdout)) == ["setup", "decode"]


def test_pack_check_names_the_biggest_wheels_when_over_the_carried_limit(tmp_path):
    wheels = tmp_path / "whl"
    wheels.mkdir()
    for name, mib in (("big_pkg-1.0-py3-none-any.whl", 70), ("small_pkg-1.0-py3-none-any.whl", 1)):
        with open(wheels / name, "wb") as f:
            f.truncate(mib << 20)  # sparse: the size counts, not the disk
    r = _session("check", tmp_path=tmp_path)
    assert r.returncode != 0
    assert "TOO BIG" in r.stdout and "big_pkg-1.0" in r.stdout
    assert r.stdout.index("big_pkg") < r.stdout.index("small_pkg")  # biggest first
    assert "--no-wandb" in r.stdout


def test_pack_check_passes_the_size_and_names_missing_wheels(tmp_path):
    wheels = tmp_path / "whl"
    wheels.mkdir()
    (wheels / "hjson-3.1.0-py3-none-any.whl").write_bytes(b"x" * 1000)
    r = _session("check", tmp_path=tmp_path)
    assert "TOO BIG" not in r.stdout and re.search(r"together [\d.]+ MiB of the 64 MiB", r.stdout)
    assert r.returncode != 0 and "missing wheel: deepspeed==" in r.stdout
    assert "missing wheel: hjson" not in r.stdout


@pytest.mark.slow
def test_a_real_run_stops_a_part_at_its_share_and_goes_on(tmp_path):
    """The watchdog, not the dry run's clock: each part killed at a 1 s share (its whole process
    group), recorded, and the session goes on to the next; summary.json and the log come back."""
    import time

    t0 = time.time()
    r = _session("run", "setup", "setup", "--local", tmp_path=tmp_path, env={"EST_setup": "1", "MIN_SLACK": "0"})
    assert time.time() - t0 < 30
    assert r.returncode != 0
    out = tmp_path / "out"
    s = json.loads((out / "summary.json").read_text())
    assert [(p["part"], p["status"]) for p in s["parts"]] == [("setup", "timeout")] * 2
    assert all(p["seconds"] <= 5 for p in s["parts"]) and s["budget_s"] == 480
    assert "TIMEOUT: part setup" in (out / "session.log").read_text()
    assert len(list(out.iterdir())) <= 8


def test_unpack_puts_what_came_back_under_benchmarks_gpu_by_gpu_name(tmp_path):
    import tarfile

    back, work = tmp_path / "back", tmp_path / "w"
    back.mkdir()
    for part, names in (("decode", ["decode-llava15_7b-h100.json", "decode-llava15_7b-h100.md", "log.txt"]),
                        ("readme", ["resume.json", "report.json", "log.txt"])):
        (work / part).mkdir(parents=True)
        for n in names:
            (work / part / n).write_text("{}")
        with tarfile.open(back / f"{part}.tar.gz", "w:gz") as t:
            t.add(work / part, arcname=part)
    (back / "summary.json").write_text(json.dumps({"gpu": "h100", "parts": []}))
    (back / "env.txt").write_text("NVIDIA H100 80GB HBM3\n")
    dest = tmp_path / "bench"
    r = _session("unpack", str(back), tmp_path=tmp_path, env={"DEST": str(dest)})
    assert r.returncode == 0, r.stdout + r.stderr
    got = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert got == ["decode-llava15_7b-h100.json", "decode-llava15_7b-h100.md", "readme-h100/log.txt",
                   "readme-h100/report.json", "readme-h100/resume.json", "session-h100-env.txt",
                   "session-h100-summary.json"]


def test_unpack_of_nothing_is_an_error_and_a_killed_unpacks_folder_is_removed(tmp_path):
    """`unpack` of a missing or empty folder copied nothing, exited 0 and said to commit; a
    killed unpack left its temporary folder in /tmp for good."""
    dest, tmpdir = tmp_path / "bench", tmp_path / "tmp"
    tmpdir.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    killed = tmpdir / f"gpu-unpack.{int(dead.stdout)}.abcdef"
    (killed / "decode").mkdir(parents=True)
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    for src, phrase in ((tmp_path / "missing", "no such folder, or nothing in it"),
                        (tmp_path / "empty", "no such folder, or nothing in it"),
                        (tmp_path / "other", "no results in it")):
        r = _session("unpack", str(src), tmp_path=tmp_path, env={"DEST": str(dest), "TMPDIR": str(tmpdir)})
        assert r.returncode == 1 and f"error: unpack {src}: {phrase}" in r.stderr, r.stdout + r.stderr
        assert "git commit" not in r.stdout
    assert not killed.exists() and not any(tmpdir.iterdir())


# ----- developer programs behave like user commands: arguments, device and memory checked first -----


@pytest.mark.parametrize("script, args, phrase", [
    ("lab/scripts/bench_train.py", ["--steps", "0"], "argument --steps: 0 must be at least 1"),
    ("lab/scripts/bench_compression.py", ["--ks", "all,0"], "argument --ks: 0 must be at least 1"),
    ("lab/scripts/bench_train.py", ["--micro-batches", "2,x"], "argument --micro-batches: 'x' is not a whole number"),
    ("lab/scripts/bench_features.py", ["--steps", "-1"], "argument --steps: -1 must be at least 1"),
    ("lab/scripts/bench_gpu.py", ["--repeats", "0"], "argument --repeats: 0 must be at least 1"),
    ("lab/scripts/ablation.py", ["--jobs", "0"], "argument --jobs: 0 must be at least 1"),
])
def test_lab_programs_refuse_bad_counts_before_any_work(script, args, phrase, tmp_path):
    """`--steps 0` / `--ks 0` were accepted, and minutes of work went by before they failed."""
    out = ["--out", str(tmp_path / "out")] + (["--run-dir", str(tmp_path / "runs")] if "compression" in script
                                              or "ablation" in script else [])  # never the tree's, whatever happens
    r = subprocess.run([sys.executable, str(ROOT / script), *args, *out], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and phrase in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_bench_gpu_checks_device_and_memory_before_building(monkeypatch, capsys):
    """With no arguments on a machine without CUDA it built a 7B model in fp32 (~28 GB)."""
    import torch

    from msd_train.errors import run_main

    bench = _load()
    built = []
    real = bench.build_target
    monkeypatch.setattr(bench, "build_target", lambda name, device, dtype: (
        built.append(device.type), real(name, device, dtype))[1])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv, phrase in (([], "no CUDA device is visible here, and --config llava15_7b is a GPU measurement"),
                         (["--device", "cpu"], "needs about 33.9 GB on cpu (weights and activations), and 24.0 GB")):
        monkeypatch.setattr(bench, "free_bytes", lambda device: 24 * 10**9)
        with pytest.raises(SystemExit) as e:
            run_main(lambda argv=argv: bench.main(argv))
        err = capsys.readouterr().err
        assert e.value.code == 1 and phrase in err and "--config small --device cpu" in err, err
    assert set(built) == {"meta"}  # counted on the meta device, never built


def test_data_path_benchmark_says_what_is_missing_and_which_step_failed(tmp_path):
    """benchmarks/train/data_path.sh without a built target exited 1 with nothing on the terminal."""
    import shutil

    root = tmp_path / "repo"
    (root / "benchmarks" / "train").mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks" / "train" / "data_path.sh", root / "benchmarks" / "train")
    script = ["bash", str(root / "benchmarks" / "train" / "data_path.sh"), str(tmp_path / "w"), str(tmp_path / "o")]
    r = subprocess.run(script, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "build it first with python scripts/make_smollm2_llava.py" in r.stderr, r.stderr
    assert not (tmp_path / "w").exists()
    (root / "data" / "smollm2-llava").mkdir(parents=True)
    (root / "data" / "smollm2-llava" / "config.json").write_text("{}")
    (root / "data" / "sharegpt-v3-prefix.jsonl").write_text("{}\n")
    r = subprocess.run(script, capture_output=True, text=True, timeout=60, env={**os.environ, "VLLM_PYTHON": "/bin/true"})
    assert r.returncode != 0 and "error: a step failed" in r.stderr and "regen-hf-decoder-16.log" in r.stderr, r.stderr
    assert "scripts/regenerate_data.py" in r.stderr  # the end of the failed step's log: python's own complaint
