"""The one rule for paths a user writes in a config or on the command line, and how a Hub id is told from one."""

from __future__ import annotations

import os
import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent  # the project checkout
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")


def is_repo_id(name) -> bool:
    """Whether ``name`` is spelt like a Hub repository id (OWNER/NAME), the Hub's own rules
    (here, not in msd_train.hub: the up-front checks tell a Hub id from a path without the hub stack)."""
    name = str(name)
    return bool(_REPO_ID.match(name)) and ".." not in name and "--" not in name and not name.endswith((".git", "."))


def check_repo_id(repo_id, setting: str = "repo_id") -> None:
    """Refuse (ValueError naming ``setting`` and the rule) a ``repo_id`` the Hub would not take."""
    if not is_repo_id(repo_id):
        raise ValueError(f"{setting}={str(repo_id)!r} is not a Hub repository id: use USER/NAME (or ORG/NAME) of "
                         "letters, digits, '-', '_' and '.', e.g. repo_id=me/msd-llava15-7b")


def user_path(value: str | os.PathLike) -> Path:
    """A file setting as the user wrote it: ``~`` and ``~user`` expanded, relative paths
    left relative (to the launch directory). Every path setting (data files, image roots,
    ``draft=``, ``bench.path``, ``out=``, ``features.path``, ``run_dir``) goes through it,
    in the up-front checks (msd_train/validate.py) and in the readers alike, so a path
    that passes the check is the path that is read."""
    return Path(os.path.expanduser(os.fspath(value)))


def creatable_dir(value: str | os.PathLike, setting: str = "run_dir") -> Path:
    """``user_path(value)``, refused up front (ValueError naming ``setting``) when the folder
    cannot be made: a file stands where a parent folder must go, or the nearest existing
    parent is not writable. Hydra creates its output folder under ``run_dir`` before the
    run's own checks, so without this a bad ``run_dir`` surfaces as Hydra's traceback."""
    path = user_path(value)
    parent = path
    while not parent.exists():
        if parent.parent == parent:
            break
        parent = parent.parent
    if parent.exists() and not parent.is_dir():
        raise ValueError(f"{setting}={value}: {parent} is a file, so the folder {path} cannot be made; "
                         f"choose another {setting}=")
    if parent.is_dir() and not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{setting}={value}: cannot create folders in {parent} (no write permission); "
                         f"choose another {setting}=")
    return path


def portable_name(name_or_path: str, root: str | os.PathLike | None = None) -> str:
    """A target's name as a head's config records it, with no path of the machine that
    trained it: a Hub id as it is; a folder inside the project checkout (``root``) relative
    to it (``data/smollm2-llava``); any other local folder by its name alone (what
    ``hub.load.check_fits`` compares)."""
    if root is None:
        root = REPO_ROOT
    p = Path(name_or_path).expanduser()
    if not p.is_absolute() and not p.exists():
        return str(name_or_path)  # a Hub id (or a relative path, already portable)
    p = p.resolve()
    try:
        return p.relative_to(Path(root).resolve()).as_posix()
    except ValueError:
        return p.name


def experiments() -> list[str]:
    """The names ``experiment=`` takes: conf/experiment/NAME.yaml of this checkout."""
    return sorted(p.stem for p in (REPO_ROOT / "conf" / "experiment").glob("*.yaml"))
