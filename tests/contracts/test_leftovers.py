"""Litter is only what a command made: a writer removes a staging or moved-aside folder only
when the marker inside says a writer made it and that process is gone; a user's folder of
any name is never touched (``msd_train.leftovers``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from builders.runs import fake_checkpoint

from msd_train import leftovers, outputs, runtime
from msd_train.training import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def users_folder(path: Path) -> Path:
    path.mkdir()
    (path / "thesis.tex").write_text("mine")
    return path


def killed_while(code: str, out: Path) -> None:
    """Run ``code`` (with ``out``, ``outputs``, ``leftovers``, ``runtime`` in scope) in a
    process that kills itself with SIGKILL where ``code`` calls ``die()``."""
    prog = ("import os, signal; from pathlib import Path; from msd_train import leftovers, outputs, runtime\n"
            f"out = Path({str(out)!r})\n"
            "def die(*_): os.kill(os.getpid(), signal.SIGKILL)\n" + code)
    done = subprocess.run([sys.executable, "-c", prog], cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert done.returncode == -9, done.stderr


def test_a_write_into_a_new_out_keeps_the_users_folders_that_look_like_litter(tmp_path, caplog):
    out = tmp_path / "out"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    old = users_folder(tmp_path / f".old-out-{int(dead.stdout)}")  # a dead pid's number, no marker
    other = users_folder(tmp_path / ".old-out-backup")
    with outputs.output_dir(out, "test") as tmp:
        (tmp / "a").write_text("new")
    assert (out / "a").read_text() == "new" and sorted(p.name for p in out.iterdir()) == ["a"]
    for folder in (old, other):
        assert (folder / "thesis.tex").read_text() == "mine", folder
    assert "killed command" not in caplog.text


def test_a_users_folder_named_like_the_staging_folder_is_refused_not_deleted(tmp_path):
    out = tmp_path / "out"
    staging = users_folder(outputs.staging_path(out))
    with pytest.raises(leftovers.InTheWay) as e:
        with outputs.output_dir(out, "test") as tmp:
            (tmp / "a").write_text("new")
    assert str(staging) in str(e.value) and "Move or rename" in str(e.value)
    assert (staging / "thesis.tex").read_text() == "mine" and not out.exists()
    # the same for the staging folder of the writers that write a folder whole (exports, imports)
    head = tmp_path / "head"
    users_folder(tmp_path / ".tmp-head")
    with pytest.raises(leftovers.InTheWay, match=r"\.tmp-head is in the way"):
        runtime.atomic_dir(head, lambda d: (d / "a").write_text("1"))
    assert (tmp_path / ".tmp-head" / "thesis.tex").read_text() == "mine" and not head.exists()


def test_what_a_killed_writer_left_is_removed_by_the_next_one(tmp_path, caplog):
    out = tmp_path / "out"
    killed_while("with outputs.output_dir(out, 'test') as tmp:\n    (tmp / 'a').write_text('half')\n    die()", out)
    assert outputs.staging_path(out).is_dir()  # killed in the body: its staging folder is left
    with outputs.output_dir(out, "test") as tmp:
        (tmp / "a").write_text("first")
    killed_while("leftovers.move_aside(out); die()", out)  # between moving out aside and renaming
    aside = list(tmp_path.glob(".old-out-*"))
    assert len(aside) == 1 and (aside[0] / "a").read_text() == "first"
    caplog.set_level("WARNING")
    with outputs.output_dir(out, "test", overwrite=True) as tmp:
        (tmp / "a").write_text("second")
    assert (out / "a").read_text() == "second" and sorted(p.name for p in out.iterdir()) == ["a"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.msd-output", "out"], "no litter left"
    assert "left by a killed command" in caplog.text

    head = tmp_path / "head"  # a whole-folder writer killed half-way
    killed_while("runtime.atomic_dir(out, die)", head)
    assert (tmp_path / ".tmp-head").is_dir()
    runtime.atomic_dir(head, lambda d: (d / "a").write_text("1"))
    assert sorted(p.name for p in head.iterdir()) == ["a"] and not (tmp_path / ".tmp-head").exists()


def test_a_live_writers_staging_folder_is_not_taken(tmp_path):
    out = tmp_path / "out"
    tmp = outputs.staging_path(out)
    tmp.mkdir()
    leftovers.mark(tmp)  # this process, alive
    with pytest.raises(leftovers.InTheWay, match=f"being written by pid {os.getpid()}"):
        runtime.atomic_dir(out, lambda d: None)
    assert tmp.is_dir()


def test_checkpoint_rotation_removes_only_its_own_temp_folders(tmp_path):
    root = tmp_path / "checkpoints"
    fake_checkpoint(root, 100)
    (root / ".tmp-step-000200").mkdir()  # a checkpoint write that did not finish
    users_folder(root / ".tmp-notes")
    ckpt.rotate(root, keep=1)
    assert not (root / ".tmp-step-000200").exists()
    assert (root / ".tmp-notes" / "thesis.tex").read_text() == "mine"


def test_a_killed_writer_of_another_host_is_taken_only_under_the_lock(tmp_path):
    """A preempted job's rank 0 on another node left `.tmp-final`: training (which holds its run's
    lock) removes it; a writer without that lock cannot ask the other host, and refuses."""
    import json

    tmp = tmp_path / ".tmp-final"
    tmp.mkdir()
    (tmp / leftovers.MARKER).write_text(json.dumps({"pid": 1, "host": "another-node", "command": "train.py"}))
    with pytest.raises(leftovers.InTheWay, match="being written by pid 1 on another-node"):
        runtime.atomic_dir(tmp_path / "final", lambda d: (d / "a").write_text("1"))
    runtime.atomic_dir(tmp_path / "final", lambda d: (d / "a").write_text("1"), locked=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
