"""Issue 49, part B: paths that stay inside their roots, a cache that notices content, records
of what happened, one clear message in place of a traceback, the promised locks.

Library-level checks run in-process; an entry point is run as a user runs it (a subprocess)
only where the message is what is promised.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from builders import random_image

from msd_train.data.formats import read_conversations

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
       "HF_HUB_OFFLINE": "1"}
ENV.pop("MSD_DEBUG", None)


def llava_file(path: Path, images: list[str]) -> Path:
    recs = [{"id": f"s{i}", "image": im,
             "conversations": [{"from": "human", "value": "<image>\nwhat is it?"}, {"from": "gpt", "value": "a cat"}]}
            for i, im in enumerate(images)]
    path.write_text(json.dumps(recs))
    return path


# ----------------------------------------------------------------------------- image paths inside image_root


def test_image_paths_outside_image_root_are_bad_samples_named(tmp_path):
    root = tmp_path / "images"
    root.mkdir()
    secret = tmp_path / "secret.png"
    random_image(0, 8).save(secret)
    random_image(1, 8).save(root / "ok.png")
    data = llava_file(tmp_path / "d.json", ["ok.png", str(secret), "../secret.png", "sub/../../secret.png",
                                           "sub/../ok.png"])
    out = list(read_conversations(data, "auto", root))
    good = [r for r in out if isinstance(r, dict)]
    bad = [r for r in out if not isinstance(r, dict)]
    assert [r["id"] for r in good] == ["s0", "s4"]
    assert [b.id for b in bad] == ["s1", "s2", "s3"]
    for b in bad:
        assert "outside image_root" in b.message() and str(root) in b.message()
    assert all(str(secret) not in r["images"][0] for r in good)


def test_regenerated_multimodal_data_trains_inside_its_image_root(tmp_path):
    """The merged file of scripts/regenerate_data.py is a data file like any other: its image
    paths are relative to the image_root its manifest names, so the readers take them."""
    from msd_train.data.regenerate import MERGED, regenerate
    from msd_train.targets import load_target

    root = tmp_path / "images"
    (root / "sub").mkdir(parents=True)
    random_image(0, 16).save(root / "sub" / "a.png")
    data = llava_file(tmp_path / "d.json", ["sub/a.png"])
    target = load_target(str(ROOT / "data" / "tiny-llava"), "float32", "cpu")
    out = tmp_path / "out"
    manifest = regenerate(target, {
        "out": str(out), "inputs": [{"path": str(data), "format": "auto", "image_root": str(root)}], "limit": None,
        "max_new_tokens": 2, "max_turns": 1, "max_prompt_tokens": 512, "temperature": 0.0, "top_p": 1.0,
        "top_k": 0, "seed": 0, "progress": False})
    read = list(read_conversations(out / MERGED, "auto", manifest["image_root"]))
    assert [r["images"] for r in read] == [[str(root / "sub" / "a.png")]]
