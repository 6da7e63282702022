"""What a resumed launch continues: the settings that shaped a stage's checkpoints, compared.

A launch records the settings that shape training (the learning-rate schedule and optimizer,
the head, the data it reads, the curriculum, the loss, the seed, the steps) in
``stageN/settings.json`` before its first checkpoint. A relaunch that would resume from a
checkpoint compares its own settings with that record, before anything loads:

- a change the checkpoint cannot take is refused, naming each key (checkpoint's value, this
  launch's) and how to go on: the checkpoint's values, or ``resume=false`` (the old outputs
  are moved aside). Without this, ``train.lr=1e-2`` was silently overridden by the learning
  rate stored in the optimizer state while ``final/training.json`` recorded 0.01;
- a change that does apply from the resumed step on (``train.max_steps``: the run continues
  to the new step count and the cosine schedule ends there; ``train.grad_clip``) is applied
  and recorded: one log line per key, and a ``history`` entry in ``settings.json`` (step,
  key, old and new value), so no record claims a setting the steps before did not have.

The record also holds each training data file's size, modification time and digest
(``data_files``): a relaunch whose data file was edited in place (same path, other content)
is refused naming the file. Size and time are compared first; only when they differ is the
file read again, so a file that was merely touched (or copied back) still resumes.

Stages written before this record existed fall back to the configuration in their
``best/`` or ``final/`` export's ``training.json``; with neither, the launch's settings
are recorded as they are, with a warning.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from msd_train.runtime import atomic_write_text

log = logging.getLogger(__name__)

RECORD = "settings.json"

#: settings a resume cannot take: the optimizer state restores the learning rate, betas and
#: weight decay; the schedule's shape, the head, the data, the curriculum, the loss and the noise
#: would change under steps already taken. (group or key, why)
REFUSED = (
    ("seed", "the data order and the noise follow it"),
    ("train.bucket_window", "the data order follows it"),
    ("train.lr", "the optimizer state in the checkpoint restores its learning rate"),
    ("train.betas", "the optimizer state in the checkpoint restores them"),
    ("train.weight_decay", "the optimizer state in the checkpoint restores it"),
    ("train.warmup_steps", "the learning-rate schedule's shape"),
    ("train.min_lr_ratio", "the learning-rate schedule's shape"),
    ("train.noise", "the loss the steps so far were taken on"),
    ("train.noise_scale", "the loss the steps so far were taken on"),
    ("train.w_feat", "the loss the steps so far were taken on"),
    ("train.w_tok", "the loss the steps so far were taken on"),
    ("train.objective", "the loss the steps so far were taken on"),
    ("train.rollout_steps", "the loss the steps so far were taken on"),
    ("train.rollout_weight", "the loss the steps so far were taken on"),
    ("train.precision", "the optimizer state's precision"),
    ("data.max_length", "the conversations the steps so far were taken on"),
    ("stage.splits", "the data the steps so far were taken on"),
    ("stage.init_from", "the head the stage started from"),
    ("stage.curriculum", "the curriculum the steps so far followed"),
    ("draft", "the head the checkpoint holds"),
)
#: settings applied from the resumed step on, each with what applying it means
APPLIED = {
    "train.max_steps": "training continues to step {new} (was {old}); the learning-rate schedule's cosine now "
                       "ends at step {new}, so the rate from step {step} on follows the new horizon",
    "train.grad_clip": "gradients are clipped at {new} from step {step} on (was {old})",
}
#: the data splits whose files shape training (the held-out ones only measure it)
TRAIN_SPLITS = ("text", "multimodal")


def _get(cfg: dict, key: str):
    node = cfg
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _flat(prefix: str, value, out: dict) -> None:
    if isinstance(value, dict):
        for k, v in sorted(value.items()):
            _flat(f"{prefix}.{k}", v, out)
    else:
        out[prefix] = value


def _path(p) -> str | None:
    if p is None or str(p) == "":
        return None
    from msd_train.paths import user_path

    return str(user_path(str(p)).resolve())


def settings(cfg) -> dict:
    """The settings that shape a stage's training, flat (``key -> value``), from a config
    (DictConfig or plain dict); paths resolved, so ``run_dir`` given another way compares equal."""
    if not isinstance(cfg, dict):
        from omegaconf import OmegaConf

        cfg = OmegaConf.to_container(cfg, resolve=True)
    out: dict = {}
    for key, _ in REFUSED:
        value = _get(cfg, key)
        if key == "stage.init_from":
            value = _path(value)
        _flat(key, value, out)
    for key in APPLIED:
        out[key] = _get(cfg, key)
    splits = _get(cfg, "stage.splits")
    for split in TRAIN_SPLITS:
        if splits is not None and split not in splits:
            continue
        sources = _get(cfg, f"data.{split}") or []
        out[f"data.{split}"] = [[_path(s.get("path")), _path(s.get("image_root"))] if isinstance(s, dict) else s
                                for s in sources]
    return out


def data_files(current: dict) -> dict[str, dict]:
    """Size, modification time (ns) and sha1 of each training data file ``settings()`` names
    (folders and Hub names are passed over: only files are fingerprinted)."""
    from msd_train.data.dataset import file_digest

    out = {}
    for split in TRAIN_SPLITS:
        for source in current.get(f"data.{split}") or []:
            path = source[0] if isinstance(source, list) else None
            if not path or path in out or not Path(path).is_file():
                continue
            st = Path(path).stat()
            out[path] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha1": file_digest(path)}
    return out


def changed_data_files(saved: dict, current: dict) -> list[str]:
    """The files of ``saved`` (from :func:`data_files`) that ``current`` names too and whose
    content differs now: one line each. Size and time first; the digest only when they differ."""
    from msd_train.data.dataset import file_digest

    changed = []
    for path, was in sorted(saved.items()):
        if not any(isinstance(s, list) and s and s[0] == path
                   for split in TRAIN_SPLITS for s in current.get(f"data.{split}") or []):
            continue  # a file this launch does not read: a path change, refused by the settings
        try:
            st = Path(path).stat()
        except OSError:
            continue  # gone: the data loading names it
        if st.st_size == was.get("size") and st.st_mtime_ns == was.get("mtime_ns"):
            continue
        if st.st_size == was.get("size") and file_digest(path) == was.get("sha1"):
            continue  # touched or copied back: the same content
        changed.append(f"{path} (was {was.get('size')} bytes, modified "
                       f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(was.get('mtime_ns', 0) / 1e9))}; now "
                       f"{st.st_size} bytes, modified {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(st.st_mtime))})")
    return changed


def _why(key: str) -> str:
    for prefix, why in REFUSED:
        if key == prefix or key.startswith(prefix + "."):
            return why
    return "the data the steps so far were taken on"


def recorded(stage_dir: Path) -> dict | None:
    """The settings a stage's checkpoints were trained with: its record, else the config of
    its ``best/`` or ``final/`` export (stages from before the record); None when unknown."""
    try:
        return json.loads((stage_dir / RECORD).read_text())["settings"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    for name in ("best", "final"):
        try:
            config = json.loads((stage_dir / name / "training.json").read_text())["config"]
            return settings(config)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return None


def differences(saved: dict, current: dict) -> tuple[list[str], dict[str, tuple]]:
    """(refused: one line per key, applied: key -> (old, new))."""
    refused, applied = [], {}
    for key in sorted(set(saved) & set(current)):  # a key one side lacks: an option older or newer than the run
        old, new = saved[key], current[key]
        if old == new or (isinstance(old, (int, float)) and isinstance(new, (int, float))
                          and not isinstance(old, bool) and float(old) == float(new)):
            continue
        if key in APPLIED:
            applied[key] = (old, new)
        else:
            refused.append(f"{key}: checkpoint {old!r}, this launch {new!r} ({_why(key)})")
    return refused, applied


def check_resume(cfg, stage_dir: Path, checkpoint: Path | None, step: int | None, write: bool) -> list[str]:
    """Compare this launch's settings with those ``checkpoint`` (the newest loadable one, or
    None) was trained with; raise ``ResumeRefused`` on a change the resume cannot take.
    ``write`` (rank 0): record the settings (a fresh stage) or the applied changes. Returns the
    lines saying what was applied."""
    current = settings(cfg)
    path = stage_dir / RECORD
    if checkpoint is None:  # nothing to resume: this launch's settings are the stage's
        if write:
            _write(path, {"settings": current, "history": [], "data_files": data_files(current)})
        return []
    saved = recorded(stage_dir)
    if saved is None:
        log.warning("%s has no record of the settings its checkpoints were trained with (a run from before "
                    "%s existed); resuming with this launch's, which are recorded now", stage_dir, RECORD)
        if write:
            _write(path, {"settings": current, "history": [], "data_files": data_files(current)})
        return []
    refused, applied = differences(saved, current)
    record = _read(path)
    if isinstance(record.get("data_files"), dict):
        edited = changed_data_files(record["data_files"], current)
        if edited:
            raise ResumeRefused(
                f"this launch would resume {checkpoint} (step {step}), but its training data changed since the stage "
                f"began: {'; '.join(edited)}. The steps so far were taken on the old content and the data order "
                f"indexes its samples, so continuing would repeat or skip conversations. Restore the file (the "
                f"same content resumes), or start this stage over with resume=false (the old outputs are moved "
                f"aside, not deleted), or use another run_dir.")
    elif write and path.exists():  # a record from before the fingerprints: they start now
        record["data_files"] = data_files(current)
        _write(path, record)
    if refused:
        raise ResumeRefused(
            f"this launch would resume {checkpoint} (step {step}) with other settings than its checkpoints were "
            f"trained with: {'; '.join(refused)}. A resume cannot take them, and the run's records would name "
            f"settings its steps did not have. Relaunch with the checkpoint's values (drop those overrides), or "
            f"start this stage over with resume=false (the old outputs are moved aside, not deleted), or use "
            f"another run_dir.")
    lines = [f"{key}={new}: " + APPLIED[key].format(old=old, new=new, step=step) for key, (old, new) in applied.items()]
    if applied and write:
        record_change(stage_dir, step, {k: {"checkpoint": old, "now": new} for k, (old, new) in applied.items()},
                      current)
    for line in lines:
        log.warning("resume: %s", line)
    return lines


def record_change(stage_dir: Path, step: int | None, changed: dict, current: dict | None = None) -> None:
    """Append a ``history`` entry (step, time, ``changed``: key -> {checkpoint, now}) to the
    stage's record; ``current``: this launch's settings, recorded as the stage's from now on."""
    path = stage_dir / RECORD
    record = _read(path)
    history = record.get("history") if isinstance(record.get("history"), list) else []
    history.append({"step": step, "when": time.strftime("%Y-%m-%d %H:%M:%S"), "changed": changed})
    record["history"] = history
    if current is not None:
        record["settings"] = current
    _write(path, record)


def _read(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _write(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(record, indent=1) + "\n")


class ResumeRefused(RuntimeError):
    """A relaunch changes settings its checkpoint cannot take (the message names each one)."""
