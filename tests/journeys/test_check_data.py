"""scripts/check_data.py: counts, skipped samples with reasons, lengths, truncation, exit codes."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "data" / "examples"


@pytest.fixture(scope="module")
def check_data():
    spec = importlib.util.spec_from_file_location("check_data", ROOT / "scripts" / "check_data.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def target_path(mini_run):
    return next(o.split("=", 1)[1] for o in mini_run if o.startswith("target.name_or_path="))


def run(check_data, args, monkeypatch) -> int:
    """The exit status of the command as a user types it (Hydra reads sys.argv)."""
    monkeypatch.setattr(sys, "argv", ["check_data.py", *args])
    try:
        check_data.main()
    except SystemExit as e:
        return e.code
    return 0


def examples_overrides(target_path, tmp_path, max_length=200):
    return [f"target.name_or_path={target_path}", f"data.text.0.path={EXAMPLES / 'sharegpt_excerpt.json'}",
            f"data.multimodal.0.path={EXAMPLES / 'llava_excerpt.json'}",
            f"data.multimodal.0.image_root={EXAMPLES / 'images'}", "data.heldout_text=[]",
            "data.heldout_multimodal=[]", f"data.max_length={max_length}", f"data.cache_dir={tmp_path / 'cache'}"]


def test_report_on_the_real_world_excerpts(check_data, target_path, tmp_path, capsys, monkeypatch):
    out = tmp_path / "report.json"
    rc = run(check_data, [*examples_overrides(target_path, tmp_path), f"json={out}", "show=2"], monkeypatch)
    text = capsys.readouterr().out
    assert rc == 0, text
    rep = json.loads(out.read_text())
    t, m = rep["text"], rep["multimodal"]
    assert t["records"] == 19 and m["records"] == 13
    assert t["kept"] + t["skipped"] == 19 and m["kept"] + m["skipped"] == 13
    assert m["images_not_found"] == 1 and "images not found: 1" in text
    assert t["salvaged"] == 1 and "kept up to a break inside the conversation (listed as truncated): 1" in text
    assert m["text_only"] == 1  # the ShareGPT-style entry inside the LLaVA mix is kept as text
    assert "turn N has unknown role 'narrator'" in t["skipped_by_reason"]
    assert any("image cannot be decoded" in r for r in m["skipped_by_reason"])
    # the long pangram conversation: its answer lies past max_length=200, so it is skipped
    assert any(s["id"] == "mN2bC4x_0" and "max_length=200" in s["reason"] for s in t["skipped_samples"])
    assert t["length"]["max"] <= 200 and set(t["length"]) >= {"p50", "p90", "p99"}
    assert 0 < m["truncated_share"] < 1
    assert any(s["id"] == "000000999999" and s["reason"].startswith("image 000000999999.jpg not found")
               for s in m["skipped_samples"])
    assert "p50" in text and "truncated:" in text and "more (show=N, or json=FILE" in text


def test_prediction_matches_what_training_keeps(check_data, target_path, tmp_path):
    """check_data applies max_length itself; the result must equal build_split's at that max_length."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from msd_train.config import CONF_DIR
    from msd_train.data.dataset import build_split
    from msd_train.features.generate import load_target_skeleton

    with initialize_config_dir(str(CONF_DIR), version_base=None):
        cfg = compose("config", examples_overrides(target_path, tmp_path, max_length=160))
    target = load_target_skeleton(cfg.target)
    for name in ("text", "multimodal"):
        rep = check_data.check_split(cfg, target, name)
        sources = [OmegaConf.to_container(s, resolve=True) for s in cfg.data[name]]
        split = build_split(sources, target, 160, "skip", None)
        dropped = [b for b in split.skipped if b.action != "truncated"]  # truncated ones are kept
        assert rep["kept"] == len(split) and rep["skipped"] == len(dropped)
        assert rep["tokens"] == sum(len(x) for x in split.dataset["input_ids"])
        assert sorted(s["id"] for s in rep["skipped_samples"]) == sorted(b.id for b in dropped)


def test_nothing_usable_exits_nonzero(check_data, target_path, tmp_path, capsys, monkeypatch):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"id": i, "conversations": [{"from": "human", "value": "hi"},
                                                            {"from": "gpt", "value": ""}]} for i in range(3)]))
    over = [f"target.name_or_path={target_path}", f"data.text.0.path={bad}", "data.multimodal=[]",
            "data.heldout_text=[]", "data.heldout_multimodal=[]", f"data.cache_dir={tmp_path / 'cache'}"]
    assert run(check_data, over, monkeypatch) == 1
    assert "no usable samples remain in data.text" in capsys.readouterr().out
    missing = [o.replace(str(bad), str(tmp_path / "nope.json")) for o in over]
    assert run(check_data, missing, monkeypatch) == 2
    assert "data file not found" in capsys.readouterr().out
    assert run(check_data, [*over, "splits=[text,txt]"], monkeypatch) == 2
    assert "unknown split(s) 'txt'" in capsys.readouterr().err
