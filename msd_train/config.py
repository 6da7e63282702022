"""Hydra/OmegaConf glue shared by the entry points."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from omegaconf import OmegaConf

from msd_train.errors import user_errors
from msd_train.paths import REPO_ROOT, creatable_dir, experiments, user_path

CONF_DIR = REPO_ROOT / "conf"

# ${msd_root:} is the project checkout, so the embedded default's paths work from any cwd.
if not OmegaConf.has_resolver("msd_root"):
    OmegaConf.register_new_resolver("msd_root", lambda: str(REPO_ROOT))
# ${user_path:X}: X with ~ expanded (msd_train/paths.py), for paths Hydra itself creates
if not OmegaConf.has_resolver("user_path"):
    OmegaConf.register_new_resolver("user_path", lambda p: str(user_path(p)))


#: run_dir -> (the nearest of ``run_dir/hydra`` and its parents that existed, the names in
#: ``run_dir/hydra``) before Hydra made its output folder there: what a refused launch removes
_BEFORE_HYDRA: dict[str, tuple[Path, set[str]]] = {}


def _run_dir_path(value) -> str:
    # Hydra resolves this while creating its output folder, before the run's own checks and
    # outside their error handling: a run_dir that cannot be made is reported (exit 1) here.
    with user_errors(ValueError):
        path = creatable_dir(value)
    if str(path) not in _BEFORE_HYDRA:
        existing = path / "hydra"
        while not existing.exists() and existing.parent != existing:
            existing = existing.parent
        try:
            names = set(os.listdir(path / "hydra"))
        except OSError:
            names = set()
        _BEFORE_HYDRA[str(path)] = (existing, names)
    return str(path)


def remove_hydra_output() -> None:
    """Remove the output folder Hydra made for this launch under ``run_dir/hydra/`` (its log
    only), and the folders above it that this launch made: a launch refused by its checks
    leaves nothing in a folder it refused (a feature store, a regeneration folder)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        out = Path(HydraConfig.get().runtime.output_dir)
    except Exception:  # not under Hydra (a test calling the entry point's function)
        return
    for run_dir, (existing, names) in _BEFORE_HYDRA.items():
        hydra = Path(run_dir) / "hydra"
        if out.parent != hydra or out.name in names or not out.is_dir():
            continue
        if any(p.is_dir() or p.suffix != ".log" for p in out.iterdir()):
            return  # more than Hydra's log: not only this launch's
        shutil.rmtree(out, ignore_errors=True)
        for folder in (hydra, *hydra.parents):
            if folder == existing:
                break
            try:
                folder.rmdir()  # only when empty
            except OSError:
                break
        return


# ${run_dir_path:X}: the same, refused with a one-line reason when the folder cannot be made
if not OmegaConf.has_resolver("run_dir_path"):
    OmegaConf.register_new_resolver("run_dir_path", _run_dir_path)


def _recipe_stage(*, _root_):
    """The experiment's settings for this launch's stage (``stage=N``); stage 1's for the commands
    that have no stage (the feature store, the splits), which read only what all stages share."""
    stage = OmegaConf.select(_root_, "stage.id", default=1)
    stages = OmegaConf.select(_root_, "recipe.stages", default=None)
    if stages is None or stages.get(str(stage)) is None:
        from msd_train.errors import ConfigError

        name = OmegaConf.select(_root_, "recipe.name", default="this experiment")
        have = ", ".join(f"stage={k}" for k, v in (stages or {}).items() if v is not None)
        with user_errors():
            raise ConfigError(f"experiment={name} has no stage {stage} (recipe.stages): launch one of {have}")
    return stages[str(stage)]


# ${recipe_stage:}: conf/experiment/NAME.yaml's recipe.stages entry for the stage being launched
if not OmegaConf.has_resolver("recipe_stage"):
    OmegaConf.register_new_resolver("recipe_stage", _recipe_stage)


def recipe_export(exports, fmt: str) -> str:
    """Where ``scripts/export.py experiment=NAME format=FMT`` writes: the experiment's
    ``recipe.exports``/FMT."""
    return f"{exports}/{fmt}"


def _recipe_export(fmt, *, _root_):
    exports = OmegaConf.select(_root_, "recipe.exports", default=None)
    return None if exports is None else recipe_export(exports, fmt)


# ${recipe_export:FMT}: the experiment's export in format FMT (null without an experiment)
if not OmegaConf.has_resolver("recipe_export"):
    OmegaConf.register_new_resolver("recipe_export", _recipe_export)


def compose_experiment(name: str, overrides=()):
    """``conf/experiment/NAME.yaml`` as ``train.py experiment=NAME`` composes it (with
    ``overrides``, e.g. ``recipe.work=DIR``), for the commands whose own config cannot hold
    an experiment (the hub scripts: their ``target`` is a plain key). Read what it needs
    with ``OmegaConf.select`` (``recipe.head``, ``recipe.target``, ``run_dir``): the
    ``${hydra:...}`` values are not resolvable here. An unknown name is a ConfigError
    listing those that exist."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from msd_train.errors import ConfigError

    known = experiments()
    if name not in known:
        raise ConfigError(f"experiment={name}: no such experiment (conf/experiment/); choose one of {', '.join(known)}")
    # Hydra composes once per process: the running command's composition is set aside and restored
    gh = GlobalHydra.instance()
    running = gh.hydra if gh.is_initialized() else None
    gh.clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            return compose(config_name="config", overrides=[f"experiment={name}", *overrides])
    finally:
        if running is not None:
            GlobalHydra.instance().initialize(running)


def strip_launcher_args(argv: list[str] | None = None) -> None:
    """Turn launcher arguments into something Hydra accepts (in place).

    The ``deepspeed`` launcher appends ``--local_rank=N`` (older torch launchers
    ``--local-rank N``); Hydra rejects both. The rank is already in the ``LOCAL_RANK``
    environment variable, so the argument is dropped here.
    """
    import os

    argv = sys.argv if argv is None else argv
    out = [argv[0]]
    skip = False
    for arg in argv[1:]:
        if skip:
            skip = False
            continue
        if arg.startswith(("--local_rank=", "--local-rank=")):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])
            continue
        if arg in ("--local_rank", "--local-rank"):
            skip = True
            continue
        # `stage=1` selects the config group file stage/1.yaml, but Hydra's override
        # parser reads 1 as an int and refuses it for a group; quote it as a string.
        if arg.startswith("stage=") and arg[6:].isdigit():
            arg = f"stage='{arg[6:]}'"
        out.append(arg)
    argv[:] = out


#: the data.* lists of conversations a stage (``stage.splits``) or a feature store reads
SPLITS = ("text", "multimodal", "heldout_text", "heldout_multimodal")


def stage_splits(cfg) -> tuple[str, ...]:
    """The data splits the configured stage reads (``stage.splits``); all without a stage."""
    if "stage" not in cfg:
        return SPLITS
    names = tuple(cfg.stage.splits)
    unknown = [n for n in names if n not in SPLITS]
    if unknown:
        raise ValueError(f"stage.splits={list(names)}: unknown {unknown}; choose from {list(SPLITS)} "
                         f"(conf/stage/*.yaml)")
    return names
