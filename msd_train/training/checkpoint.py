"""Checkpoint folders: atomic writes, newest-loadable lookup, rotation, disk-full reports.

Layout of a stage folder::

    stage1/checkpoints/step-000100/   DeepSpeed engine state (tag "engine") + recipe_state.json
                                      + portable.pt (the same state in a form any world size loads)
                                      + token_counts.safetensors (the counts the stage started with:
                                      a resume trains over the same draft.train_vocab)
    stage1/checkpoints/.tmp-step-...  a write in progress (ignored, removed on the next save)
    stage1/final/, stage1/best/       exports: config.json + model.safetensors (written like
                                      checkpoints: into .tmp-final, then renamed; runtime.atomic_dir)

A checkpoint is complete when ``recipe_state.json`` exists in it; it is written last and
the folder is renamed into place only after that, so a crash leaves at most a ``.tmp``
folder that resume ignores. Folders whose name is not ``step-<digits>`` (a user's
``step-backup``, a copy) are not checkpoints and are never read, rotated or removed.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import shutil
import zipfile
from contextlib import contextmanager
from pathlib import Path

import torch

from msd_train.draft.vocabulary import save_counts
from msd_train.errors import disk_full
from msd_train.runtime import atomic_dir, replace_dir
from msd_train.trust import DEEPSPEED_TYPES, torch_load

log = logging.getLogger(__name__)

STATE_FILE = "recipe_state.json"
ENGINE_TAG = "engine"
STATE_KEYS = ("step", "curriculum", "bad_total", "best_tau", "global_batch")
#: the head's full fp32 master weights, optimizer moments and schedule, independent of the number
#: of processes and of how ZeRO partitioned them (see :func:`portable_state`)
PORTABLE_FILE = "portable.pt"
#: AdamW's per-parameter state besides its step count
MOMENTS = ("exp_avg", "exp_avg_sq")
_STEP_NAME = re.compile(r"^step-(\d+)$")
_TMP_NAME = re.compile(r"^\.tmp-step-(\d+)$")


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, quota, permissions); the message says
    where, what was kept and how to continue."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def _step_of(p: Path) -> int | None:
    m = _STEP_NAME.match(p.name)
    return int(m.group(1)) if m and p.is_dir() else None


def resume_disabled(cfg) -> bool:
    """``resume=false`` (or 0 / no): start the stage over instead of continuing."""
    return str(cfg.resume).lower() in ("false", "0", "no")


def zero_stage(cfg) -> int:
    """The ZeRO stage this launch's engine partitions with (``deepspeed.zero_optimization.stage``;
    recorded in each checkpoint, since another one loads only its portable state)."""
    from omegaconf import OmegaConf

    return int(OmegaConf.select(cfg, "deepspeed.zero_optimization.stage", default=0) or 0)


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root`` (``step-<digits>/`` with a state file), oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _step_of(p) is not None and (p / STATE_FILE).is_file()]
    return sorted(found, key=_step_of)


def read_state(ckpt: Path) -> dict:
    return json.loads((ckpt / STATE_FILE).read_text())


def check_checkpoint(ckpt: Path) -> str | None:
    """Why ``ckpt`` cannot be resumed from, or None when it looks whole.

    Cheap checks only (no tensor is read): the state file parses and has the recipe's
    keys, and the engine folder holds model states whose zip directories open (a torch
    file cut short has no central directory at its end)."""
    try:
        state = read_state(ckpt)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"{STATE_FILE} is unreadable ({type(e).__name__}: {e})"
    if not isinstance(state, dict) or any(k not in state for k in STATE_KEYS):
        missing = [k for k in STATE_KEYS if not isinstance(state, dict) or k not in state]
        return f"{STATE_FILE} lacks {', '.join(missing)}"
    engine = ckpt / ENGINE_TAG
    files = sorted(engine.glob("*.pt")) if engine.is_dir() else []
    if not any(f.name.endswith("model_states.pt") for f in files):
        return f"no DeepSpeed engine files in {engine}"
    for f in files:
        try:
            with zipfile.ZipFile(f):
                pass
        except (OSError, zipfile.BadZipFile) as e:
            return f"{f.name} is damaged ({e})"
    return None


def loadable_checkpoints(root: Path, log_skipped: bool = True) -> list[Path]:
    """Complete checkpoints that pass :func:`check_checkpoint`, newest first; each one
    skipped is logged with the reason, so the user knows which work was not resumed."""
    good = []
    for p in reversed(complete_checkpoints(root)):
        why = check_checkpoint(p)
        if why is None:
            good.append(p)
        elif log_skipped:
            log.warning("skipping checkpoint %s: %s", p, why)
    return good


def finish(tmp: Path, final: Path, state: dict) -> None:
    """Write the recipe state last, then move the folder into place."""
    with open(tmp / STATE_FILE, "w") as f:
        json.dump(state, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    replace_dir(tmp, final)


def rotate(root: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` complete checkpoints and the temp folders of
    checkpoint writes that did not finish (``.tmp-step-<digits>``, the names the recipe
    writes; the caller holds the run's lock, so none is being written)."""
    for p in complete_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(p, ignore_errors=True)
    for p in root.glob(".tmp-step-*"):
        if _TMP_NAME.match(p.name) and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)


@contextmanager
def writing(root: Path, tmp: Path, what: str):
    """Turn a failed checkpoint or export write into a :class:`CheckpointWriteError` that
    says the disk is full (when it is), where, and what is still there to resume from; the
    partial ``tmp`` folder is removed so it does not hold on to the little space left."""
    try:
        yield
    except Exception as err:
        shutil.rmtree(tmp, ignore_errors=True)
        kept = [p.name for p in complete_checkpoints(root)]
        keep_msg = (f"kept: {', '.join(kept)} in {root} (relaunching the same command resumes from {kept[-1]})"
                    if kept else f"no complete checkpoint is kept in {root}")
        # torch.save words a full disk its own way (``basic_ios::clear: iostream error``,
        # ``unexpected pos 123 vs 456``), differently between versions: disk_full also asks the disk
        if disk_full(err, root.parent if not root.exists() else root) is not None:
            free = shutil.disk_usage(root if root.exists() else root.parent).free
            raise CheckpointWriteError(
                f"the disk is full: writing {what} into {tmp.parent} failed ({free / 2**20:.0f} MiB free); "
                f"the partial write was removed; {keep_msg}. Free space on that disk (or lower checkpoint.keep, "
                f"or move run_dir to a larger disk) and launch the same command again.") from err
        raise


def export_complete(folder: Path) -> bool:
    """Whether ``folder`` holds a whole export: config.json parses and every weight file
    (model.safetensors, or an index and its shards) is there and opens, its header covering
    the file (one cut short does not). Cheap: no tensor is read. A finished stage is one
    whose ``final/`` is complete, never one whose ``config.json`` alone survived."""
    from safetensors import safe_open

    from msd_train.hub.folders import export_weight_files, read_config

    try:
        read_config(folder)
        for f in export_weight_files(folder):
            if f.suffix == ".safetensors":
                with safe_open(str(f), framework="pt"):
                    pass
    except Exception:  # whatever is missing or damaged, the export is not whole
        return False
    return True


def export_head(module, weights: dict[str, torch.Tensor], out: Path, meta: dict, token_counts=None) -> None:
    """The trained head alone into ``out`` (:func:`export_atomic`), as its own class loads it:
    a fresh ``type(module)`` (msd, msd3, ...) holding ``weights`` (float32) and the module's
    saved buffers (msd3's ``d2t``, ``t2d``), its config saying float32; ``meta`` (stage, step,
    command, config) is written beside it as ``training.json``."""
    head = type(module)(copy.deepcopy(module.config))
    buffers = {n: b.detach().cpu() for n, b in module.named_buffers() if n in head.state_dict()}
    head.load_state_dict({**buffers, **weights})
    head.config.dtype = "float32"  # what is stored
    export_atomic(head, out, {"training.json": json.dumps(meta, indent=1)}, token_counts=token_counts)


def export_atomic(model, out: Path, extra_files: dict[str, str] | None = None,
                  token_counts=None) -> None:
    """``save_pretrained`` into a temp folder, then rename over ``out``; files readable
    like any other output (safetensors creates its files private to the writer).
    ``token_counts``: the training data's assistant-token counts, saved beside the head."""
    def write(tmp: Path) -> None:
        with writing(out.parent / "checkpoints", tmp, f"the {out.name} export"):
            model.save_pretrained(tmp, safe_serialization=True)
            for name, text in (extra_files or {}).items():
                (tmp / name).write_text(text)
            if token_counts is not None:
                save_counts(tmp, token_counts)

    atomic_dir(out, write, locked=True)  # training holds its run_dir's lock (rundir.RunDirLock)


# ------------------------------------------------------------------ what a resume unpickles
def _not_loaded(ckpt: Path) -> str:
    return (f"A checkpoint this project wrote holds nothing else: if you did not put it there, do not trust "
            f"{ckpt.parent}. To resume from the checkpoint before it, move {ckpt} out of {ckpt.parent}; or start "
            f"the stage over with resume=false (the old outputs are moved aside, not deleted)")


class SafeLoads:
    """The engine's DeepSpeed checkpoint engine, its ``load`` through :func:`msd_train.trust.torch_load`.

    DeepSpeed reads its model and optimizer states with ``torch.load(weights_only=False)``,
    which runs whatever a pickle in them calls; :func:`install_safe_loads` puts this in its
    place, so a resume unpickles tensors, plain values and :data:`DEEPSPEED_TYPES` only.
    Writing and everything else is the wrapped engine's."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def load(self, path: str, map_location=None):
        path = Path(path)
        return torch_load(path, allowed=DEEPSPEED_TYPES, map_location=map_location,
                          fix=_not_loaded(path.parent.parent if path.parent.name == ENGINE_TAG else path.parent))


def install_safe_loads(engine) -> None:
    """Make every checkpoint ``engine`` loads go through :class:`SafeLoads`."""
    if not isinstance(engine.checkpoint_engine, SafeLoads):
        engine.checkpoint_engine = SafeLoads(engine.checkpoint_engine)


# ------------------------------------------------------------------ resuming at another world size
# DeepSpeed's own checkpoint splits ZeRO's optimizer state per process, so it loads only into the
# number of processes that wrote it. A draft head is small (one decoder layer): every checkpoint
# also keeps it whole, gathered from the partitions through DeepSpeed's public accessors
# (``safe_get_full_*``), and a launch with another number of processes loads that into its own
# partitions (``safe_set_full_*``). The data order needs nothing: the curriculum plans global
# batches in samples, and each rank takes its rows of the same global batch.


def _inner_optimizer(engine):
    """The torch optimizer holding the state (ZeRO and bf16 wrap it; without them it is the engine's)."""
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def _partitioned(p) -> bool:
    """Whether DeepSpeed keeps ``p``'s fp32 master and optimizer state apart from ``p`` (ZeRO, bf16)."""
    return hasattr(p, "ds_id") or hasattr(p, "_hp_mapping")


def _masters(engine) -> dict:
    """Module parameter -> the fp32 copy the optimizer steps, for wrappers that keep whole
    copies rather than ZeRO's partitions (DeepSpeed's fp16/bf16 optimizers without ZeRO); a
    parameter not listed is its own master."""
    opt = engine.optimizer
    return {lp: hp for low, high in zip(getattr(opt, "fp16_groups", None) or [], getattr(opt, "fp32_groups", None) or [])
            for lp, hp in zip(low, high)}


def portable_state(engine) -> dict:
    """The engine's training state, whole (every rank must call: ZeRO gathers each tensor)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    inner = _inner_optimizer(engine)
    module = engine.module
    masters = _masters(engine)
    stepped = len(inner.state) > 0  # AdamW creates its state at the first step
    weights, moments = {}, {k: {} for k in MOMENTS}
    for name, p in module.named_parameters():
        master = safe_get_full_fp32_param(p) if p.requires_grad else None
        weights[name] = (masters.get(p, p) if master is None else master).detach().to("cpu", torch.float32).clone()
        if not (p.requires_grad and stepped):
            continue
        for key in MOMENTS:
            v = safe_get_full_optimizer_state(p, key) if _partitioned(p) else inner.state[masters.get(p, p)][key]
            moments[key][name] = v.detach().to("cpu", torch.float32).clone()
    steps = {float(st["step"]) for st in inner.state.values() if "step" in st}
    return {
        "format": 1,
        "weights": weights,
        "buffers": {n: b.detach().cpu().clone() for n, b in module.named_buffers()},
        "moments": moments if stepped else None,
        "optimizer_step": max(steps) if steps else 0.0,
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups],
        "scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "engine": {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                   "skipped_steps": engine.skipped_steps},
    }


def save_portable(state: dict, folder: Path) -> None:
    torch.save(state, folder / PORTABLE_FILE)


def load_portable(engine, ckpt: Path) -> None:
    """Load ``ckpt``'s :data:`PORTABLE_FILE` into ``engine``, built for this launch's number of
    processes: weights (the module's and the fp32 masters), AdamW's moments and step count,
    the learning-rate schedule and the engine's counters. Every rank reads the whole file."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    state = torch_load(ckpt / PORTABLE_FILE, map_location="cpu", fix=_not_loaded(ckpt))
    inner = _inner_optimizer(engine)
    module = engine.module
    masters = _masters(engine)
    if state["moments"] is not None:
        # AdamW creates its state at the first step: create it as that step would, then link
        # DeepSpeed's per-parameter views into it (what it does itself after its first step).
        for group in inner.param_groups:
            for hp in group["params"]:
                inner.state[hp] = {"step": torch.tensor(state["optimizer_step"], dtype=torch.float32),
                                   **{k: torch.zeros_like(hp, memory_format=torch.preserve_format) for k in MOMENTS}}
        if hasattr(engine.optimizer, "_hp_optimizer_states_linked"):
            engine.optimizer._hp_optimizer_states_linked = False
            engine.optimizer._lazy_init_hp_params_optimizer_state()
    with torch.no_grad():
        for name, p in module.named_parameters():
            value = state["weights"][name]
            p.data.copy_(value.to(p.device, p.dtype))
            if not p.requires_grad:
                continue
            if _partitioned(p):
                safe_set_full_fp32_param(p, value.to(p.device))
            elif p in masters:
                masters[p].data.copy_(value.to(masters[p].device).view_as(masters[p]))
            for key in MOMENTS if state["moments"] is not None else ():
                moment = state["moments"][key][name].to(p.device)
                if _partitioned(p):
                    safe_set_full_optimizer_state(p, moment, key)
                else:
                    inner.state[masters.get(p, p)][key].copy_(moment.view_as(p))
        for name, b in module.named_buffers():
            if name in state["buffers"]:
                b.copy_(state["buffers"][name].to(b.device, b.dtype))
    for group, saved in zip(inner.param_groups, state["param_groups"]):
        group["lr"] = saved["lr"]
    if state["scheduler"] is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(state["scheduler"])
    for key, value in state["engine"].items():
        setattr(engine, key, value)
