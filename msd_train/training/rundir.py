"""Who owns a run_dir and what a launch may do with what is already in it.

- :func:`stage_dir`: where a stage's checkpoints, exports and records live (``run_dir/stageN``).
- :class:`RunDirLock`: one launch per run_dir. ``run_dir/.lock`` holds the owner's pid,
  host, start time and command; a second launch is refused with that owner named. A lock
  that names no live owner on this host (its pid gone or reused, or no owner at all: empty,
  ``{}``, not JSON) is stale and taken over. An unwritable run_dir is one message.
- :func:`set_aside`: ``resume=false`` moves a stage's previous outputs (checkpoints,
  exports, metrics, evaluation reports) into ``stageN/replaced-<time>/``, so two runs are
  never mixed and nothing is deleted.
- :func:`identity_differences` / :func:`world_size_refusal`: what must match between a
  checkpoint and the launch resuming it; another number of processes continues with the
  checkpoint's global batch (:func:`resumed_grad_accum`). ``training.resume`` applies them.
- :func:`truncate_metrics`: ``metrics.jsonl`` keeps only the steps of the run that continues.
- :func:`exit_with_launcher`: the trainer stops (through its SIGTERM path: checkpoint, exit)
  when the launcher that started it is gone, instead of training on as an orphan.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import threading
import time
from pathlib import Path

from msd_train.outputs import OwnerLock
from msd_train.runtime import atomic_write_text

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"


def stage_dir(cfg) -> Path:
    """``run_dir/stageN`` of a config (``run_dir`` made absolute)."""
    return Path(cfg.run_dir).resolve() / f"stage{int(cfg.stage.id)}"


class RunDirError(RuntimeError):
    """The run_dir cannot be used by this launch (the message says why and what to do)."""


class RunDirBusy(RunDirError):
    """Another live launch owns the run_dir."""


class RunDirLock(OwnerLock):
    """``with RunDirLock(run_dir):`` for the whole launch (rank 0 only): ``run_dir/.lock``,
    the same owner lock every command's output folder takes (``msd_train.outputs``)."""

    def __init__(self, run_dir: str | Path):
        super().__init__(Path(run_dir) / LOCK_FILE, f"run_dir {run_dir}")

    def busy(self, owner: dict) -> Exception:
        return RunDirBusy(
            f"run_dir {self.path.parent} is in use by another launch: pid {owner['pid']} on "
            f"{owner['host']}, started {owner.get('started')} ({owner.get('command')}). Two "
            f"launches into one run_dir would overwrite each other's checkpoints and metrics; wait "
            f"for it to end, stop it, or choose another run_dir. If that launch is gone (its machine "
            f"died), delete {self.path}.")

    def unwritable(self, e: OSError) -> Exception:
        return RunDirError(
            f"cannot write the run_dir lock {self.path} ({type(e).__name__}: {e.strerror or e}); training "
            f"writes its checkpoints, exports and metrics into run_dir={self.path.parent}, so it must be "
            f"writable: fix its permissions or free space, or choose another run_dir")


def set_aside(stage_dir: Path) -> Path | None:
    """Move everything a previous run left in ``stage_dir`` into ``stage_dir/replaced-<time>/``;
    returns that folder (None when there was nothing to move)."""
    if not stage_dir.is_dir():
        return None
    old = [p for p in stage_dir.iterdir() if not p.name.startswith("replaced-")]
    if not old:
        return None
    dest = stage_dir / f"replaced-{time.strftime('%Y%m%d-%H%M%S')}"
    n = 0
    while dest.exists():
        n += 1
        dest = stage_dir / f"replaced-{time.strftime('%Y%m%d-%H%M%S')}-{n}"
    dest.mkdir()
    for p in old:
        shutil.move(str(p), str(dest / p.name))
    return dest


_IDENTITY_KEYS = ("name", "family", "hidden_size", "vocab_size", "tokenizer_size", "image_token_id",
                  "chat_template_sha1", "adapter")


def identity_differences(saved: dict, current: dict) -> list[str]:
    """What differs between the target a checkpoint was trained on and this launch's
    (both from ``msd_train.targets.identity.target_identity``)."""
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, this launch {current.get(k)!r}"
             for k in _IDENTITY_KEYS if saved.get(k) != current.get(k)]
    a, b = saved.get("weights_sha256"), current.get("weights_sha256")
    if a and b and a != b:
        diffs.append(f"weights: the embedding table and lm_head of {current.get('name')} differ from those of "
                     f"the target the checkpoint was trained on ({saved.get('name')})")
    return diffs


def needs_portable(state: dict, world: int, zero_stage: int) -> bool:
    """Whether a checkpoint (its recipe state) was written by another number of processes or
    another ZeRO stage than this launch's: DeepSpeed's per-process files do not load then, its
    portable state (``checkpoint.PORTABLE_FILE``) does."""
    saved, saved_zero = state.get("world_size"), state.get("zero_stage")
    return (saved is not None and int(saved) != world) or (saved_zero is not None and int(saved_zero) != zero_stage)


def world_size_refusal(ckpt: Path, state: dict, world: int, micro_batch_size: int, zero_stage: int) -> str | None:
    """Why ``ckpt``, written by another number of processes or another ZeRO stage, cannot
    continue at ``world`` and ``zero_stage`` (None when it can, or when it was written by
    this layout). It can when it holds the portable state (``checkpoint.PORTABLE_FILE``),
    this launch does not partition the weights (ZeRO-3), and its global batch splits into
    ``micro_batch_size`` x ``world`` x a whole grad_accum."""
    from msd_train.training.checkpoint import PORTABLE_FILE

    if not needs_portable(state, world, zero_stage):
        return None
    saved = int(state.get("world_size") or world)
    saved_zero = state.get("zero_stage")
    layout = (f"{saved} process(es)" + (f" with ZeRO stage {saved_zero}" if saved_zero is not None else "")
              + f" and this launch has {world}" + (f" with stage {zero_stage}" if saved_zero is not None else ""))
    same = (f"Relaunch with {saved} process(es) (`deepspeed --num_gpus {saved}` or `torchrun --nproc_per_node "
            f"{saved}`)" + (f" and deepspeed=zero{saved_zero}" if saved_zero is not None and saved_zero != zero_stage
                            else "")
            + ", or start this stage over with resume=false (the old outputs are moved aside, not deleted).")
    if not (ckpt / PORTABLE_FILE).is_file():
        return (f"{ckpt} was written by {layout}, but it holds only DeepSpeed's per-process state (no "
                f"{PORTABLE_FILE}: written with deepspeed=zero3, or by a version from before checkpoints kept the "
                f"state any number of processes loads); ZeRO splits that state per process and it cannot be loaded "
                f"into another layout. {same}")
    if zero_stage >= 3:
        return (f"{ckpt} was written by {layout}; this launch's deepspeed=zero3 partitions the weights too: a "
                f"checkpoint continues at another number of processes or stage with zero1 or zero2 "
                f"(deepspeed=zero2, the default). Relaunch with deepspeed=zero2, or: {same}")
    global_batch = int(state["global_batch"])
    if global_batch % (micro_batch_size * world):
        fits = [w for w in range(1, global_batch + 1) if global_batch % (micro_batch_size * w) == 0]
        micro = [m for m in range(1, global_batch + 1) if global_batch % (m * world) == 0]
        return (f"{ckpt} was trained with a global batch of {global_batch} ({saved} process(es)); this launch has "
                f"{world} process(es) x train.micro_batch_size={micro_batch_size} = {world * micro_batch_size} "
                f"samples per accumulation step, which does not divide {global_batch}, so the global batch (and with "
                f"it the data order and the loss) cannot be kept: grad_accum = global batch / (micro_batch_size x "
                f"processes) must be whole. Relaunch with "
                + (f"a number of processes in {fits} (at micro_batch_size {micro_batch_size}), or " if fits else "")
                + (f"train.micro_batch_size in {micro} (at {world} process(es)), or " if micro else "")
                + "with resume=false to start this stage over (the old outputs are moved aside, not deleted).")
    return None


def resumed_grad_accum(state: dict, world: int, micro_batch_size: int) -> int:
    """The grad_accum that keeps a checkpoint's global batch at ``world`` processes
    (after :func:`world_size_refusal` found none)."""
    return int(state["global_batch"]) // (micro_batch_size * world)


def truncate_metrics(path: Path, step: int) -> None:
    """Keep the records of steps <= ``step`` (0: none): what a killed launch logged after
    the checkpoint it resumes from (or before any checkpoint) was lost work."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the kill
        if step > 0 and isinstance(rec, dict) and rec.get("step", 0) <= step:
            keep.append(line)
    atomic_write_text(path, "".join(line + "\n" for line in keep))


def _is_launcher(argv: list[str]) -> bool:
    """``deepspeed ...`` / ``torchrun ...`` (their scripts run by python or not), or the
    modules they run: ``python -m deepspeed.launcher.launch`` / ``torch.distributed.run``."""
    head = argv[:3]
    return (any(Path(a).name in ("deepspeed", "torchrun") for a in head)
            or any(m in argv for m in ("deepspeed.launcher.launch", "deepspeed.launcher.runner",
                                       "torch.distributed.run", "torch.distributed.launch")))


def _launcher_chain() -> list:
    """The launcher processes this trainer depends on: its parent, and the parent's
    parent when that is the ``deepspeed`` runner (which starts ``deepspeed.launcher.launch``,
    which starts the trainer)."""
    import psutil

    chain, p = [], psutil.Process()
    for _ in range(2):
        p = p.parent()
        if p is None or p.pid <= 1:
            break
        if not _is_launcher(p.cmdline()):
            break
        chain.append(p)
    return chain


def exit_with_launcher(interval: float = 1.0) -> None:
    """When started by a launcher, send ourselves SIGTERM once any launcher process of
    the chain is gone (e.g. SIGTERM to the top-level ``deepspeed`` alone, which does not
    forward it): the trainer then checkpoints at the next step boundary and exits."""
    try:
        chain = _launcher_chain()
    except Exception:  # psutil missing or /proc unreadable: nothing to watch
        return
    if not chain:
        return

    import psutil

    def alive(p) -> bool:
        try:  # a killed launcher stays a zombie until its own parent reaps it
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def watch():
        while all(alive(p) for p in chain):
            time.sleep(interval)
        log.warning("the launcher (pid %s) is gone: stopping at the next step boundary",
                    ", ".join(str(p.pid) for p in chain if not alive(p)))
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()
