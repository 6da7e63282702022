"""What the hub scripts (scripts/export.py, import_reference.py, push_to_hub.py) share.

They are Hydra entry points like train.py and eval.py, over `conf/hub/<name>.yaml`. Those
configs sit in a folder of their own because their `target=` takes a target path or Hub
id as well as a `conf/target/` name: with `conf/` as the config path, Hydra would read
`target=...` as choosing from the `target/` group and refuse a path. Under `conf/hub/`
there is no such group, so `target` is a plain key and `resolve_target` looks the name up.

Outside the hub package on purpose: importing msd_train.hub loads torch and transformers
(seconds), and the scripts check their arguments with what is here before that.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from msd_train.config import CONF_DIR
from msd_train.errors import PushError


def user_error_kinds() -> tuple[type[BaseException], ...]:
    """What the hub scripts print as one paragraph and exit 1 on (``validate.user_errors``,
    ``MSD_DEBUG=1``: the traceback): a missing file, a refused value (an argument, a repo
    id, a head that cannot be used or does not fit: IncompleteHeadError is a ValueError)
    and a push the Hub did not take."""
    return FileNotFoundError, ValueError, PushError


def require_arguments(cfg: DictConfig, script: str) -> None:
    """Refuse, in one line naming every required (`???`) argument left out, rather than
    Hydra's error on the first one the script happens to read."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ValueError(f"{script}: missing required argument(s): {' '.join(f'{k}=...' for k in missing)} "
                          f"(see conf/hub/{script}.yaml)")


def experiment_defaults(cfg: DictConfig, script: str) -> dict | None:
    """``experiment=NAME`` (``conf/experiment/NAME.yaml``, composed as train.py does, with the
    ``recipe.work=`` given): ``checkpoint=`` when left out is the head its recipe ends with
    (``recipe.head``), and export.py's ``out=`` its ``recipe.exports``/FORMAT. Returns what the
    checks read (``validate.hub_experiment``): the experiment's ``recipe`` block (resolved: name,
    target, work, head, exports), its ``run_dir`` and the ``checkpoint``; None without one."""
    name = cfg.get("experiment")
    if not name:
        return None
    from msd_train.config import compose_experiment, recipe_export

    work = OmegaConf.select(cfg, "recipe.work")
    quoted = str(work).replace("'", "\\'")
    composed = compose_experiment(str(name), [f"recipe.work='{quoted}'"] if work else [])
    recipe = {k: OmegaConf.select(composed, f"recipe.{k}") for k in ("name", "target", "work", "head", "exports")}
    if OmegaConf.is_missing(cfg, "checkpoint"):
        cfg.checkpoint = recipe["head"]
    if script == "export" and OmegaConf.is_missing(cfg, "out"):
        cfg.out = recipe_export(recipe["exports"], cfg.format)
    return {"recipe": recipe, "run_dir": OmegaConf.select(composed, "run_dir"), "checkpoint": cfg.checkpoint}


def target_info(value: str | None):
    """`target=` of the hub scripts as the ``TargetInfo`` the hub functions take (None without one)."""
    from msd_train.hub import TargetInfo

    name_or_path, _ = resolve_target(value)
    return TargetInfo.from_files(name_or_path) if name_or_path else None


def resolve_target(value: str | None) -> tuple[str | None, str | None]:
    """`target=`: a `conf/target/<name>.yaml` (its name_or_path and adapter), or else a
    target path / Hub id as given. Returns (name_or_path, adapter)."""
    if value is None:
        return None, None
    path = CONF_DIR / "target" / f"{value}.yaml"
    if path.is_file():
        target = OmegaConf.load(path)
        return str(target.name_or_path), target.get("adapter")
    return str(value), None
