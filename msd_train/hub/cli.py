"""What the hub scripts (scripts/export.py, import_reference.py, push_to_hub.py) share.

They are Hydra entry points like train.py and eval.py, over `conf/hub/<name>.yaml`. Those
configs sit in a folder of their own because their `target=` takes a target path or Hub
id as well as a `conf/target/` name: with `conf/` as the config path, Hydra would read
`target=...` as choosing from the `target/` group and refuse a path. Under `conf/hub/`
there is no such group, so `target` is a plain key and `resolve_target` looks the name up.
"""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from msd_train.config import CONF_DIR


def user_error_kinds() -> tuple[type[BaseException], ...]:
    """What the hub scripts print as one paragraph and exit 1 on (``validate.user_errors``,
    ``MSD_DEBUG=1``: the traceback): a missing file, a refused value (an argument, a repo
    id, a head that cannot be used or does not fit: IncompleteHeadError is a ValueError)
    and a push the Hub did not take."""
    from msd_train.hub.push import PushError  # inside: `--help` does not wait for torch

    return FileNotFoundError, ValueError, PushError


def require_arguments(cfg: DictConfig, script: str) -> None:
    """Refuse, in one line naming every required (`???`) argument left out, rather than
    Hydra's error on the first one the script happens to read."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ValueError(f"{script}: missing required argument(s): {' '.join(f'{k}=...' for k in missing)} "
                          f"(see conf/hub/{script}.yaml)")


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
