"""The run's lifecycle: a logger never stands between a signal and its checkpoint,
locks heal, a stale torch-extensions build lock is named, a full disk is recognised by its
free space, and only a complete export counts as a finished stage."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from builders import ROOT
from builders.runs import (
    ENV,
    FAST,
    assert_stopped_with_checkpoint,
    base_train_cfg,
    fake_checkpoint,
    kill_session,
    steps,
    trainer_processes,
    wait_for_steps,
)

from msd_train.training import build_locks, rundir
from msd_train.training import checkpoint as ckpt

# ----------------------------------------------------------------------------- 1: Ctrl-C with wandb on


@pytest.mark.slow
def test_ctrl_c_under_deepspeed_with_wandb_offline_saves_a_checkpoint_and_releases_the_lock(mini_run, tmp_path):
    import psutil

    run = tmp_path / "run"
    args = [o for o in mini_run if not o.startswith("logging.wandb.mode=")]
    args += [*FAST, f"run_dir={run}", "stage=1", "train.max_steps=100000", "checkpoint.every=100000",
             "logging.wandb.mode=offline"]
    env = {k: v for k, v in ENV.items() if k != "WANDB_MODE"}
    from msd_train.runtime import free_port

    cmd = ["deepspeed", "--num_gpus", "1", "--master_port", str(free_port()), str(ROOT / "train.py"), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        wait_for_steps(run, proc)
        trainers = trainer_processes(proc.pid)
        assert trainers, "no trainer process found under the launcher"
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the launcher also takes down the trainer's wandb service
        output, _ = proc.communicate(timeout=300)
        psutil.wait_procs(trainers, timeout=120)
    finally:
        kill_session(proc)
    assert_stopped_with_checkpoint(run, output)
    assert not (run / ".lock").exists(), f"the run_dir lock was left behind:\n{output[-3000:]}"
    # the top-level `deepspeed` runner prints its own KeyboardInterrupt; the trainer prints none
    trainer_tracebacks = [t for t in output.split("Traceback (most recent call last):")[1:]
                          if "bin/deepspeed" not in t.splitlines()[1]]
    assert not trainer_tracebacks, output[-5000:]
    assert any((run / "wandb").glob("offline-run-*")), "wandb did not run: this case is about wandb on"


def test_a_dead_wandb_turns_wandb_off_with_one_warning_and_logging_goes_on(tmp_path, caplog, monkeypatch):
    """The fast half of the case above: a logger whose service is gone costs a warning, not the run."""
    import wandb
    from omegaconf import OmegaConf

    from msd_train.training.recipe import TrainRecipe

    class DeadRun:
        calls = 0

        def log(self, *a, **k):
            DeadRun.calls += 1
            raise ConnectionResetError("Connection lost")

    monkeypatch.setattr(wandb, "teardown", lambda *a, **k: (_ for _ in ()).throw(ConnectionResetError()))
    recipe = TrainRecipe(OmegaConf.create({"stage": {"id": 1}, "run_dir": str(tmp_path)}))
    recipe.main, recipe.wandb = True, DeadRun()
    recipe.stage_dir.mkdir(parents=True)
    with caplog.at_level("WARNING"):
        for step in (1, 2, 3):
            recipe._log({"step": step, "loss": 1.0})
    assert steps(tmp_path) == [1, 2, 3] and DeadRun.calls == 1 and recipe.wandb is None
    assert caplog.text.count("wandb failed while logging (ConnectionResetError: Connection lost)") == 1


# ----------------------------------------------------------------------------- 2: locks that heal


@pytest.mark.parametrize("content", ["", "{}", "[]", "null", '{"pid": -1}', '{"pid": "12", "host": 3}',
                                     "\x00\x81garbage{", '{"pid": 123'])
def test_a_lock_that_names_no_owner_is_taken_over(tmp_path, caplog, content):
    (tmp_path / rundir.LOCK_FILE).write_text(content)
    t0 = time.perf_counter()
    with caplog.at_level("WARNING"):
        with rundir.RunDirLock(tmp_path):
            assert json.loads((tmp_path / rundir.LOCK_FILE).read_text())["pid"] == os.getpid()
    assert time.perf_counter() - t0 < 2
    assert "names no owner" in caplog.text and "taking it over" in caplog.text
    assert not (tmp_path / rundir.LOCK_FILE).exists()


@pytest.mark.parametrize("err", [errno.EACCES, errno.EROFS])
def test_an_unwritable_run_dir_is_one_message(tmp_path, monkeypatch, capsys, err):
    """As a user sees it: train.py's run() prints one paragraph naming the run_dir, exit 1
    (a read-only mount, or a run_dir made read-only after a first run: Hydra's own folder
    inside it stays writable, the lock is the first write that fails)."""
    from omegaconf import OmegaConf

    from msd_train.training import run

    def refuse(path, *a, **k):
        raise OSError(err, os.strerror(err), str(path))

    monkeypatch.setattr(rundir.os, "open", refuse)
    monkeypatch.delenv("MSD_DEBUG", raising=False)
    cfg = OmegaConf.create({**base_train_cfg(tmp_path), "run_dir": str(tmp_path / "run")})
    with pytest.raises(SystemExit) as e:
        run(cfg)
    err_text = capsys.readouterr().err
    assert e.value.code == 1
    assert "Traceback" not in err_text and err_text.count("error:") == 1, err_text
    assert f"cannot write the run_dir lock {tmp_path / 'run' / rundir.LOCK_FILE}" in err_text
    assert "choose another run_dir" in err_text


# ----------------------------------------------------------------------------- 8: disk full, every form


def _head():
    from transformers import AutoConfig

    from msd_train.draft import MSDDraftConfig, MSDDraftModel

    cfg = MSDDraftConfig.from_target_config(AutoConfig.from_pretrained(ROOT / "data" / "tiny-llava"), "tiny")
    return MSDDraftModel(cfg)


def _no_room(monkeypatch):
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: type("U", (), {"free": 4096})())


def test_a_full_disk_is_recognised_whatever_torch_says(tmp_path, monkeypatch):
    root = tmp_path / "stage1" / "checkpoints"
    fake_checkpoint(root, 100)
    tmp = root / ".tmp-step-000200"
    cut = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1344 vs 1280")
    _no_room(monkeypatch)
    with pytest.raises(ckpt.CheckpointWriteError) as e:
        with ckpt.writing(root, tmp, "checkpoint step 200"):
            tmp.mkdir()
            raise cut
    assert "the disk is full" in str(e.value) and "kept: step-000100" in str(e.value)
    assert not tmp.exists()

    head = _head()  # the export path: the same message, and no partial export left behind
    monkeypatch.setattr(head, "save_pretrained", lambda *a, **k: (_ for _ in ()).throw(cut))
    with pytest.raises(ckpt.CheckpointWriteError, match="the disk is full: writing the final export"):
        ckpt.export_atomic(head, tmp_path / "stage1" / "final")
    assert sorted(p.name for p in (tmp_path / "stage1").iterdir()) == ["checkpoints"]


# ----------------------------------------------------------------------------- 9: an interrupted export


def test_only_a_complete_export_is_a_finished_stage(tmp_path):
    from omegaconf import OmegaConf

    from msd_train.training.recipe import TrainRecipe

    final = tmp_path / "stage1" / "final"
    final.mkdir(parents=True)
    (final / "config.json").write_text(_head().config.to_json_string())  # what a kill could once leave
    recipe = TrainRecipe(OmegaConf.create({"stage": {"id": 1}, "run_dir": str(tmp_path), "train": {"max_steps": 2},
                                           "logging": {"progress": False}}))
    recipe.step, recipe.main = 2, True  # resumed from the checkpoint of the last step
    exported = []
    recipe.export = exported.append
    recipe.train()
    assert exported == ["final"], "a final/ without weights was taken for a finished stage"

    ckpt.export_atomic(_head(), final)
    assert ckpt.export_complete(final)
    exported.clear()
    recipe.train()
    assert exported == [], "a complete final/ is a finished stage"
    weights = final / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # cut short
    assert not ckpt.export_complete(final)


def test_an_export_killed_mid_write_leaves_the_previous_one_whole(tmp_path):
    final = tmp_path / "final"
    ckpt.export_atomic(_head(), final)
    before = {p.name: p.read_bytes() for p in final.iterdir()}
    head = _head()

    def killed(folder, **kw):
        (Path(folder) / "config.json").write_text("{}")  # the first file is out, then the kill
        raise KeyboardInterrupt

    head.save_pretrained = killed
    with pytest.raises(KeyboardInterrupt):
        ckpt.export_atomic(head, final)
    assert {p.name: p.read_bytes() for p in final.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["final"], "the partial write must not stay behind"


# ----------------------------------------------------------------------------- 7: a stale build lock


def _build_lock(root: Path, age: float) -> Path:
    """A torch-extensions build folder as a killed build leaves it: build.ninja and an empty lock."""
    folder = root / "deepspeed_shm_comm"
    folder.mkdir(parents=True)
    (folder / "build.ninja").write_text("")
    lock = folder / build_locks.LOCK_NAME
    lock.touch()
    for f in folder.iterdir():
        os.utime(f, (time.time() - age, time.time() - age))
    return lock


def test_a_stale_build_lock_is_removed_and_named(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # never the real, shared cache
    lock = _build_lock(tmp_path, age=3600)
    with caplog.at_level("WARNING"):
        assert build_locks.clear_stale_build_locks() == [lock]
    assert not lock.exists() and (lock.parent / "build.ninja").exists()
    assert f"removed the stale build lock {lock}" in caplog.text


def test_a_build_lock_held_by_a_live_build_is_left_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = _build_lock(tmp_path, age=3600)  # old, but its builder is alive and holds it open
    builder = subprocess.Popen([sys.executable, "-c", f"import os, time; os.open({str(lock)!r}, os.O_RDONLY); "
                                                      "print('open', flush=True); time.sleep(60)"],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert builder.stdout.readline().strip() == "open"
        assert build_locks.clear_stale_build_locks() == []
        assert lock.exists()
    finally:
        builder.kill()
        builder.wait()


def test_a_fresh_unheld_build_lock_on_a_local_disk_is_removed_at_once(tmp_path, monkeypatch, caplog):
    """A launch killed while DeepSpeed compiled made every later launch wait 300 s, on a disk
    no other machine could be building on."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(build_locks, "on_shared_disk", lambda path: False)
    lock = _build_lock(tmp_path, age=0)
    t0 = time.perf_counter()
    with caplog.at_level("WARNING"):
        assert build_locks.clear_stale_build_locks(poll=0.1) == [lock]
    assert time.perf_counter() - t0 < 2 and not lock.exists()
    assert f"removed the stale build lock {lock}" in caplog.text and "on a local disk" in caplog.text
    assert "waiting for" not in caplog.text


def test_where_a_build_cache_lies_is_read_from_the_mounts(tmp_path, monkeypatch):
    mounts = "overlay / overlay rw 0 0\nserver:/home /home nfs4 rw 0 0\n"
    monkeypatch.setattr(build_locks.Path, "read_text", lambda self, *a, **k: mounts)
    assert build_locks.on_shared_disk(Path("/home/me/.cache/torch_extensions/py311_cpu/op/lock"))
    assert not build_locks.on_shared_disk(Path("/tmp/torch_extensions/op/lock"))


def test_a_fresh_unheld_build_lock_is_waited_for_with_its_name_then_taken_as_stale(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(build_locks, "STALE_AFTER", 1.0)
    monkeypatch.setattr(build_locks, "on_shared_disk", lambda path: True)  # another machine may build there
    lock = _build_lock(tmp_path, age=0)  # another machine sharing the cache may be building
    t0 = time.perf_counter()
    with caplog.at_level("WARNING"):
        assert build_locks.clear_stale_build_locks(poll=0.1) == [lock]
    assert 0.5 < time.perf_counter() - t0 < 5
    assert f"waiting for the build lock {lock}" in caplog.text and "delete it to go on now" in caplog.text
