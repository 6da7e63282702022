"""The one rule for paths a user writes in a config or on the command line."""

from __future__ import annotations

import os
from pathlib import Path


def user_path(value: str | os.PathLike) -> Path:
    """A file setting as the user wrote it: ``~`` and ``~user`` expanded, relative paths
    left relative (to the launch directory). Every path setting (data files, image roots,
    ``draft=``, ``bench.path``, ``out=``, ``features.path``, ``run_dir``) goes through it,
    in the up-front checks (msd_train/validate.py) and in the readers alike, so a path
    that passes the check is the path that is read."""
    return Path(os.path.expanduser(os.fspath(value)))
