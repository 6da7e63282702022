"""lab/bench/decoder_table.py: the small config runs end to end on a CPU and writes every field; the
lab's programs refuse bad arguments before any work, as the user commands do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load():
    from lab.bench import decoder_table

    return decoder_table


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


# ----- developer programs behave like user commands: arguments, device and memory checked first -----


@pytest.mark.parametrize("module, args, phrase", [
    ("lab.bench.train", ["--steps", "0"], "argument --steps: 0 must be at least 1"),
    ("lab.bench.compression", ["--ks", "all,0"], "argument --ks: 0 must be at least 1"),
    ("lab.bench.train", ["--micro-batches", "2,x"], "argument --micro-batches: 'x' is not a whole number"),
    ("lab.bench.features", ["--steps", "-1"], "argument --steps: -1 must be at least 1"),
    ("lab.bench.decoder_table", ["--repeats", "0"], "argument --repeats: 0 must be at least 1"),
    ("lab.studies.ablation", ["--jobs", "0"], "argument --jobs: 0 must be at least 1"),
])
def test_lab_programs_refuse_bad_counts_before_any_work(module, args, phrase, tmp_path):
    """`--steps 0` / `--ks 0` were accepted, and minutes of work went by before they failed."""
    out = ["--out", str(tmp_path / "out")] + (["--run-dir", str(tmp_path / "runs")] if "compression" in module
                                              or "ablation" in module else [])  # never the tree's, whatever happens
    r = subprocess.run([sys.executable, "-m", module, *args, *out], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)  # as the docs say: `python -m lab.<folder>.<program>` from the repository root
    assert r.returncode == 2 and phrase in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_decoder_table_checks_device_and_memory_before_building(monkeypatch, capsys):
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
    """lab/bench/train_data_path.sh without a built target exited 1 with nothing on the terminal."""
    import shutil

    root = tmp_path / "repo"
    (root / "lab" / "bench").mkdir(parents=True)
    shutil.copy(ROOT / "lab" / "bench" / "train_data_path.sh", root / "lab" / "bench")
    script = ["bash", str(root / "lab" / "bench" / "train_data_path.sh"), str(tmp_path / "w"), str(tmp_path / "o")]
    r = subprocess.run(script, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "build it first with python -m lab.targets.make_smollm2_llava" in r.stderr, r.stderr
    assert not (tmp_path / "w").exists()
    (root / "data" / "smollm2-llava").mkdir(parents=True)
    (root / "data" / "smollm2-llava" / "config.json").write_text("{}")
    (root / "data" / "sharegpt-v3-prefix.jsonl").write_text("{}\n")
    r = subprocess.run(script, capture_output=True, text=True, timeout=60, env={**os.environ, "VLLM_PYTHON": "/bin/true"})
    assert r.returncode != 0 and "error: a step failed" in r.stderr and "regen-hf-decoder-16.log" in r.stderr, r.stderr
    assert "scripts/regenerate_data.py" in r.stderr  # the end of the failed step's log: python's own complaint
