"""What the hub scripts (scripts/export.py, import_reference.py, push_to_hub.py) share.

They are Hydra entry points like train.py and eval.py, over `conf/hub/<name>.yaml`. Those
configs sit in a folder of their own because their `target=` takes a target path or Hub
id as well as a `conf/target/` name: with `conf/` as the config path, Hydra would read
`target=...` as choosing from the `target/` group and refuse a path. Under `conf/hub/`
there is no such group, so `target` is a plain key and `resolve_target` looks the name up.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from omegaconf import DictConfig, OmegaConf

from msd_train.config import CONF_DIR
from msd_train.validate import ConfigError, user_errors


@contextmanager
def script_errors() -> Iterator[None]:
    """``validate.user_errors`` for the hub scripts: a head that cannot be used, a missing
    file, a refused value (a repo id, a head that does not fit the target) and a push the
    Hub did not take are one paragraph and exit 1 (``MSD_DEBUG=1``: the traceback)."""
    from msd_train.hub.push import PushError  # inside: `--help` does not wait for torch

    with user_errors(FileNotFoundError, ValueError, PushError):  # ValueError: IncompleteHeadError too
        yield


def require_arguments(cfg: DictConfig, script: str) -> None:
    """Refuse, in one line naming every required (`???`) argument left out, rather than
    Hydra's error on the first one the script happens to read."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"{script}: missing required argument(s): {' '.join(f'{k}=...' for k in missing)} "
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
