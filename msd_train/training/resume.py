"""Where a launch of a stage starts, and what a resumed launch continues: the one resume path.

:func:`resume_point` reads the stage's checkpoints once, before anything heavy loads, and
returns a :class:`ResumePoint`: the newest checkpoint that passes the cheap checks (its
recipe state, and the older ones to fall back on), else the exported head of
``stage.init_from``, else a fresh head. ``training.run`` (the entry point) calls it and
hands the point to ``TrainRecipe``, which builds from it and, once the engine is built,
loads the checkpoint with :func:`load`; the recipe calls it itself when made without one.
What the newest checkpoint cannot continue is a :class:`ResumeRefused`, naming it and
how to go on:

- another number of processes or ZeRO stage whose state does not carry over
  (``rundir.world_size_refusal``); one that does continues with the checkpoint's global
  batch (``train.grad_accum`` recomputed, logged and recorded);
- settings the checkpoint cannot take, and training data edited in place (below);
- (at load) a checkpoint trained on another target than this launch's, or one holding a file
  that is more than tensors and plain values (``msd_train.trust``: nothing in it runs, and
  no older checkpoint is tried in its place).

The settings that shaped a stage's checkpoints, compared. A launch records the settings
that shape training (the learning-rate schedule and optimizer, the head, the data it reads,
the curriculum, the loss, the seed, the steps) in ``stageN/settings.json`` before its
first checkpoint. A relaunch that would resume from a checkpoint compares its own settings
with that record, before anything loads:

- a change the checkpoint cannot take is refused, naming each key (checkpoint's value, this
  launch's) and how to go on: the checkpoint's values, or ``resume=false`` (the old outputs
  are moved aside). Without this, ``train.lr=1e-2`` was silently overridden by the learning
  rate stored in the optimizer state while ``final/training.json`` recorded 0.01;
- a change that does apply from the resumed step on (``train.max_steps``: the run continues
  to the new step count and the cosine schedule ends there; ``train.grad_clip``) is applied
  and recorded: one log line per key, and, once a checkpoint has loaded (:func:`record_applied`:
  a launch refused before that records nothing), a ``history`` entry in ``settings.json`` (step,
  key, old and new value), so no record claims a setting the steps before did not have.

The record also holds each training data file's size, modification time and digest
(``data_files``): a relaunch whose data file was edited in place (same path, other content)
is refused naming the file, whatever its size and time say (``cp -p``, ``rsync -t`` and
``tar`` restore them); the digest is the one the data cache computes at this launch, so a
file that was merely touched (or copied back) still resumes.

Stages written before this record existed fall back to the configuration in their
``best/`` or ``final/`` export's ``training.json``; with neither, the launch's settings
are recorded as they are, with a warning.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from msd_train.runtime import atomic_write_text
from msd_train.training import checkpoint as ckpt
from msd_train.training import rundir
from msd_train.trust import UnsafeFileError

log = logging.getLogger(__name__)


class ResumeRefused(RuntimeError):
    """This launch cannot continue what its stage holds: settings, data, a target or a layout of
    processes the checkpoint cannot take, or no checkpoint that loads (the message names each
    one and how to go on)."""


@dataclass
class ResumePoint:
    """Where a launch of a stage starts (:func:`resume_point`)."""

    stage_dir: Path
    #: complete checkpoints that pass ``checkpoint.check_checkpoint``, newest first ([]: none to resume)
    candidates: list[Path]
    #: the newest one's recipe state (``recipe_state.json``; {} without one)
    state: dict
    #: this launch's number of processes and ZeRO stage, which the checkpoint is loaded into
    world: int
    zero_stage: int
    #: resuming a checkpoint of another number of processes: the grad_accum that keeps its global batch
    grad_accum: int | None = None
    #: nothing to resume: the exported head the stage starts from (``stage.init_from``; None: a fresh head)
    init_from: Path | None = None
    #: what this launch changes against the checkpoint (key -> {checkpoint, now}) and its settings:
    #: recorded in ``settings.json`` by :func:`record_applied` once a checkpoint has loaded
    changed: dict = field(default_factory=dict)
    settings: dict | None = None

    @property
    def checkpoint(self) -> Path | None:
        return self.candidates[0] if self.candidates else None

    @property
    def step(self) -> int:
        return int(self.state.get("step", 0))


def resume_point(cfg, rank: int, world: int) -> ResumePoint:
    """Read the stage's checkpoints once and say where this launch starts, or raise
    :class:`ResumeRefused` (module docstring). Rank 0 logs the checkpoints skipped as
    damaged, records the settings and what is applied in ``settings.json``, and starts
    ``metrics.jsonl`` over when there is nothing to resume."""
    stage_dir = rundir.stage_dir(cfg)
    main = rank == 0
    micro_batch_size = int(cfg.train.micro_batch_size)
    candidates = [] if ckpt.resume_disabled(cfg) else \
        ckpt.loadable_checkpoints(stage_dir / "checkpoints", log_skipped=main)
    point = ResumePoint(stage_dir, candidates, ckpt.read_state(candidates[0]) if candidates else {}, world,
                        ckpt.zero_stage(cfg))
    if candidates:
        refusal = rundir.world_size_refusal(candidates[0], point.state, world, micro_batch_size, point.zero_stage)
        if refusal:
            raise ResumeRefused(refusal)
    # what the checkpoint was trained with vs this launch: a change it cannot take is refused
    # (naming each key), one it can is applied, and recorded once a checkpoint has loaded
    check_resume(cfg, stage_dir, point.checkpoint, point.state.get("step"), write=main, pending=point)
    if not candidates:
        if main:  # killed before its first checkpoint: what it logged is not part of the run that starts now
            rundir.truncate_metrics(stage_dir / "metrics.jsonl", 0)
        point.init_from = Path(cfg.stage.init_from) if cfg.stage.init_from else None
        return point
    saved = point.state.get("world_size")
    if saved is not None and int(saved) != world:
        point.grad_accum = rundir.resumed_grad_accum(point.state, world, micro_batch_size)
        was_micro, was_accum = point.state.get("micro_batch_size"), point.state.get("grad_accum")
        if was_accum is None and was_micro is not None:
            was_accum = int(point.state["global_batch"]) // (int(saved) * int(was_micro))
        if main:
            log.warning("resume: %s was written by %s process(es), this launch has %d: train.grad_accum=%d (was %s) "
                        "keeps its global batch of %d", point.checkpoint, saved, world, point.grad_accum,
                        cfg.train.grad_accum, int(point.state["global_batch"]))
        # a checkpoint from before it kept its micro-batch size and grad_accum: None (not known)
        point.changed["world_size"] = {"checkpoint": int(saved), "now": world}
        if was_micro != micro_batch_size:
            point.changed["train.micro_batch_size"] = {"checkpoint": was_micro, "now": micro_batch_size}
        if was_accum != point.grad_accum:
            point.changed["train.grad_accum"] = {"checkpoint": was_accum, "now": point.grad_accum}
    return point


def record_applied(point: ResumePoint, step: int, main: bool) -> None:
    """Record in ``settings.json`` what this launch changed against the checkpoint it resumed
    (``point.changed``), now that it is applied: once a checkpoint of ``step`` has loaded, so a
    launch refused before that records nothing."""
    if main and point.changed:
        record_change(point.stage_dir, step, point.changed, point.settings)
    point.changed = {}


def load(point: ResumePoint, engine, group, identity: dict) -> tuple[Path, dict]:
    """Load the newest of ``point``'s checkpoints that loads into ``engine`` (built for this
    launch: DeepSpeed's per-process state when the checkpoint was written by this layout of
    processes, its portable state otherwise); every rank takes part. Returns that checkpoint
    and its recipe state. One that cannot be loaded is skipped with the reason (a rank's
    failure moves every rank to the next one); one trained on another target than
    ``identity`` (``targets.identity.target_identity``) is refused."""
    for cand in point.candidates:
        state = ckpt.read_state(cand)
        portable = rundir.needs_portable(state, point.world, point.zero_stage)
        if portable and not (cand / ckpt.PORTABLE_FILE).is_file():
            log.warning("rank %d: skipping checkpoint %s: written by %s process(es) (ZeRO stage %s) without %s, "
                        "it cannot be loaded by %d (stage %d)", group.rank, cand, state.get("world_size"),
                        state.get("zero_stage"), ckpt.PORTABLE_FILE, point.world, point.zero_stage)
            continue
        if state.get("target") is not None:
            diffs = rundir.identity_differences(state["target"], identity)
            if diffs:
                raise ResumeRefused(
                    f"{cand} was trained on another target than this launch's ({'; '.join(diffs)}). Resume with "
                    f"the checkpoint's target, or start this stage over with resume=false (the old outputs "
                    f"are moved aside).")
        failed, unsafe = False, None
        try:
            if portable:
                ckpt.load_portable(engine, cand)
            else:
                engine.load_checkpoint(str(cand), tag=ckpt.ENGINE_TAG, load_optimizer_states=True,
                                       load_lr_scheduler_states=True)
        except UnsafeFileError as e:  # not damage: a file someone put there; nothing older is tried
            unsafe = e
        except Exception as e:  # a torch zip error, a missing rank's file, DeepSpeed's assertions
            log.warning("rank %d: skipping checkpoint %s: it does not load (%s: %s)", group.rank, cand,
                        type(e).__name__, e)
            failed = True
        if group.any(unsafe is not None):
            raise ResumeRefused(str(unsafe) if unsafe is not None else
                                f"another process refused a file of {cand} as unsafe (its message names it)")
        # Every rank must resume from the same step: one rank's failure moves all to the next one.
        if group.any(failed):
            continue
        if group.main:
            log.info("resuming from %s%s", cand, f" (written by {state['world_size']} process(es), ZeRO stage "
                                                 f"{state.get('zero_stage')})" if portable else "")
        return cand, state
    raise ResumeRefused(
        f"no checkpoint in {point.stage_dir / 'checkpoints'} loads (reasons above); move the folder aside to start "
        f"over, or set resume=false (which moves it aside for you)")


# ----------------------------------------------------------------------------- the settings record
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
    content differs now: one line each. By their digest (read once per launch, shared with the
    data cache): a same-size edit whose mtime was restored is a change too."""
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
        sha1 = file_digest(path) if st.st_size == was.get("size") else None
        if sha1 is not None and (sha1 == was.get("sha1") or was.get("sha1") is None):
            continue  # the same content (touched or copied back), or a record without digests
        changed.append(f"{path} (was {was.get('size')} bytes, sha1 {str(was.get('sha1'))[:12]}, modified "
                       f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(was.get('mtime_ns', 0) / 1e9))}; now "
                       f"{st.st_size} bytes, sha1 {(sha1 or file_digest(path))[:12]}, modified "
                       f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(st.st_mtime))})")
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


def check_resume(cfg, stage_dir: Path, checkpoint: Path | None, step: int | None, write: bool,
                 pending: ResumePoint | None = None) -> list[str]:
    """Compare this launch's settings with those ``checkpoint`` (the newest loadable one, or
    None) was trained with; raise ``ResumeRefused`` on a change the resume cannot take.
    ``write`` (rank 0): record the settings (a fresh stage) or the applied changes, at once or,
    with ``pending``, in that point for :func:`record_applied` once a checkpoint has loaded.
    Returns the lines saying what is applied."""
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
    changed = {k: {"checkpoint": old, "now": new} for k, (old, new) in applied.items()}
    if pending is not None:
        pending.changed.update(changed)
        pending.settings = current if applied else None
    elif applied and write:
        record_change(stage_dir, step, changed, current)
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
