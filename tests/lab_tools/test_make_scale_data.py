"""lab/data/make_scale_data.py: the recipe's data shape at any size, deterministic, with its
bad records found by the training data path."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args):
    return subprocess.run([sys.executable, "-m", "lab.data.make_scale_data", *map(str, args)], capture_output=True, text=True, cwd=ROOT)


def test_arguments_are_checked_before_any_work(tmp_path):
    for args, msg in ((["--n", "0"], "--n 0"), (["--images", "0"], "--images 0"), (["--bad", "9", "--n", "10"], "--bad 9"),
                      (["--text-only-share", "1.5"], "--text-only-share")):
        p = _run(tmp_path / "out", *args)
        assert p.returncode != 0 and msg in p.stderr
        assert not (tmp_path / "out").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    p = _run(tmp_path / "full", "--n", "10")
    assert p.returncode != 0 and "not an empty folder" in p.stderr


def test_small_copy_is_deterministic_and_its_bad_records_are_caught(tmp_path, llava_target):
    from msd_train.data.dataset import build_split

    a, b = tmp_path / "a", tmp_path / "b"
    for out in (a, b):
        p = _run(out, "--n", "300", "--images", "12", "--bad", "2")
        assert p.returncode == 0, p.stderr
    assert (a / "llava_mix.json").read_bytes() == (b / "llava_mix.json").read_bytes()
    assert (a / "sharegpt.json").read_bytes() == (b / "sharegpt.json").read_bytes()
    made = json.loads((a / "manifest.json").read_text())
    mix = json.loads((a / "llava_mix.json").read_text())
    assert len(mix) == 300 and made["mix"]["text_only"] == sum("image" not in r for r in mix) > 0
    assert made["sharegpt_records"] == len(json.loads((a / "sharegpt.json").read_text())) == 31
    assert len(list((a / "images").rglob("*.jpg"))) == 12 + 2  # the distinct images and the truncated copies
    split = build_split([{"path": str(a / "llava_mix.json"), "format": "llava", "image_root": str(a / "images")}],
                        llava_target, 4096, cache_dir=str(tmp_path / "cache"), num_proc=2)
    reasons = [s.reason for s in split.skipped]
    assert len(reasons) == 6 and sum("cut short" in r for r in reasons) == 2
    assert sum("not found" in r for r in reasons) == 2 and sum("is empty" in r for r in reasons) == 2
    assert len(split) == 294
