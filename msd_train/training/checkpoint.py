"""Checkpoint folders: atomic writes, newest-complete lookup, rotation.

Layout of a stage folder::

    stage1/checkpoints/step-000100/   DeepSpeed engine state (tag "engine") + recipe_state.json
    stage1/checkpoints/.tmp-...       a write in progress (ignored, removed on the next save)
    stage1/final/, stage1/best/       exports: config.json + model.safetensors

A checkpoint is complete when ``recipe_state.json`` exists in it; it is written last and
the folder is renamed into place only after that, so a crash leaves at most a ``.tmp``
folder that resume ignores.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from msd_train.runtime import atomic_dir, replace_dir

STATE_FILE = "recipe_state.json"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith("step-") and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def newest_checkpoint(root: Path) -> Path | None:
    done = complete_checkpoints(root)
    return done[-1] if done else None


def read_state(ckpt: Path) -> dict:
    return json.loads((ckpt / STATE_FILE).read_text())


def finish(tmp: Path, final: Path, state: dict) -> None:
    """Write the recipe state last, then move the folder into place."""
    with open(tmp / STATE_FILE, "w") as f:
        json.dump(state, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    replace_dir(tmp, final)


def rotate(root: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` complete checkpoints and stale temp folders."""
    for p in complete_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
    for p in root.glob(".tmp-*"):
        shutil.rmtree(p, ignore_errors=True)


def export_atomic(model, out: Path, extra_files: dict[str, str] | None = None) -> None:
    """``save_pretrained`` into a temp folder, then rename over ``out``."""
    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)

    atomic_dir(out, write)
