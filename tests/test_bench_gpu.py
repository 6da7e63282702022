"""scripts/bench_gpu.py: the small config runs end to end on a CPU and writes every field."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load():
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "scripts" / "bench_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpu"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_llava15_7b_config_matches_the_published_shape():
    c = _load().CONFIGS["llava15_7b"]
    t, v = c["text"], c["vision"]
    assert (t["num_hidden_layers"], t["hidden_size"], t["intermediate_size"], t["num_attention_heads"],
            t["vocab_size"]) == (32, 4096, 11008, 32, 32064)
    assert (v["image_size"] // v["patch_size"]) ** 2 == 576 and v["num_hidden_layers"] == 24
    assert c["image_token_id"] == 32000


def test_small_config_writes_every_field(tmp_path):
    bench = _load()
    out = tmp_path / "b.json"
    argv = ["--config", "small", "--device", "cpu", "--repeats", "1", "--warmup", "0", "--new-tokens", "3",
            "--out", str(out)]
    bench.main(argv)
    r = json.loads(out.read_text())
    assert out.with_suffix(".md").read_text().startswith("# MSD decoder")
    assert r["dry_run"] is True and "not a GPU measurement" in r["dry_run_note"]
    for key in ("config", "device", "dtype", "created", "command", "environment", "target", "draft",
                "prompt_tokens", "plain_decoding", "cycle", "ensemble", "goals", "goals_met"):
        assert key in r, key
    assert r["prompt_tokens"] == 640
    for key in ("torch", "transformers", "python", "deepspeed", "gpu"):
        assert key in r["environment"], key
    p = r["plain_decoding"]
    for key in ("project_ar_ms_per_token", "hf_generate_ms_per_token", "project_over_hf_speed", "outputs_match"):
        assert key in p, key
    assert p["outputs_match"]  # the project's AR loop and generate() agree token for token
    c = r["cycle"]
    assert set(c["verify_ms_by_tree_size"]) == {str(n) for n in bench.TREE_SIZES}
    assert c["default_tree"]["nodes"] == 60 and c["draft_tree_ms"]["median"] > 0
    b = c["bookkeeping_ms"]
    for key in ("accept_greedy", "commit_as_accepted", "commit_forced_path"):
        assert b[key]["median"] >= 0, key
    assert b["forced_path"][0] == 0 and len(b["forced_path"]) >= 2
    en = r["ensemble"]
    assert en["tree"]["M"]["median"] > 0 and en["chain_k5"]["ibed-MTP"]["median"] > 0
    assert en["rows"]["ibed-MTP (padded)"] == en["rows"]["M"]  # M is the longest row
    assert "5b. Ensemble drafting" in out.with_suffix(".md").read_text()
    cy = c["cycle"]
    assert cy["cycle_over_step"] > 0 and set(cy["speedup_at_tau"]) == {"2", "3", "4"}
    for tau, s in cy["speedup_at_tau"].items():
        assert s == pytest.approx(int(tau) / cy["cycle_over_step"], rel=1e-3)
