"""What a killed writer leaves beside its output, and the one rule for removing it.

A command writes an output folder ``OUT`` into a staging folder beside it (``.tmp-OUT``) and
renames it into place, moving an older ``OUT`` aside first (``.old-OUT-PID``) and deleting it
after. A command killed in between leaves one of those behind. Each is made with a marker
inside (:data:`MARKER`: the writer's pid, its start time, host and command), taken out just
before a staging folder is renamed into place. A later writer removes a leftover only when
its marker says a writer made it and that process is gone (:func:`gone_writer`); a folder
without the marker, whatever its name, is a user's and is never touched: a staging folder of
that kind in the way is refused, naming it (:class:`InTheWay`).

Light (no torch): ``outputs`` and ``runtime`` use it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import sys
from pathlib import Path

from msd_train.errors import ConfigError

log = logging.getLogger(__name__)

#: inside a staging or moved-aside folder: who made it
MARKER = ".msd-leftover.json"


class InTheWay(ConfigError):
    """A folder with a writer's staging name that this writer may not remove (the message says why)."""


def process_start(pid: int) -> float | None:
    """Start time of ``pid`` (None when no such process; -1.0 when it cannot be read): a pid
    reused by another process after the owner died has another start time."""
    if pid <= 0:  # os.kill(-1, 0) would ask about every process
        return None
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:  # psutil.NoSuchProcess, AccessDenied, or psutil missing
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return -1.0
        return -1.0


def mark(folder: Path) -> None:
    """Say inside ``folder`` (just made by this process) that this process made it."""
    me = {"pid": os.getpid(), "start_time": process_start(os.getpid()), "host": socket.gethostname(),
          "command": " ".join(sys.argv)}
    (folder / MARKER).write_text(json.dumps(me) + "\n")


def unmark(folder: Path) -> None:
    """Take the marker out of a staging folder about to become an output."""
    (folder / MARKER).unlink(missing_ok=True)


def marker(folder: Path) -> dict | None:
    """The writer ``folder``'s marker names (pid and host at least), or None without one."""
    try:
        made = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(made, dict) and isinstance(made.get("pid"), int) and isinstance(made.get("host"), str)
    return made if ok else None


def gone_writer(folder: Path, locked: bool = False) -> dict | None:
    """``folder``'s marker when a writer made it and that process is gone (its pid is free or
    now another process's), else None: only then may the folder be removed. A writer on
    another host cannot be asked: its folder counts as gone only when the caller holds the
    lock its writers take (``locked``: a run's, an output's), so none of them can be live."""
    if folder.is_symlink() or not folder.is_dir():
        return None
    made = marker(folder)
    if made is None:
        return None
    if made["host"] != socket.gethostname():
        return made if locked else None
    start = process_start(made["pid"])
    recorded = made.get("start_time")
    if start is None:
        return made
    if start >= 0 and isinstance(recorded, (int, float)) and recorded > 0 and abs(start - recorded) >= 1.0:
        return made  # the pid was reused
    return None


def remove_if_left(folder: Path, locked: bool = False) -> bool:
    """Remove ``folder`` when :func:`gone_writer` says a killed writer left it (logged)."""
    made = gone_writer(folder, locked)
    if made is None:
        return False
    log.warning("removing %s, left by a killed command (pid %s on %s: %s)", folder, made["pid"], made["host"],
                made.get("command"))
    shutil.rmtree(folder, ignore_errors=True)
    return True


def make_staging(tmp: Path, out: Path, locked: bool = False) -> None:
    """Make the staging folder ``tmp`` for ``out``, marked; a killed writer's leftover of that
    name is removed first (``locked``: see :func:`gone_writer`), anything else there is
    :class:`InTheWay`."""
    if (tmp.exists() or tmp.is_symlink()) and not remove_if_left(tmp, locked):
        made = marker(tmp) if tmp.is_dir() and not tmp.is_symlink() else None
        why = (f"it is being written by pid {made['pid']} on {made['host']} ({made.get('command')})"
               if made else "it is not a leftover of this project's commands (it holds no "
                            f"{MARKER}), so it is not deleted")
        raise InTheWay(f"{tmp} is in the way: {out} is written into a folder of that name beside it and renamed "
                       f"into place, and {why}. Move or rename {tmp} (or wait for that command to end), then run "
                       f"the command again")
    tmp.mkdir(parents=True)
    mark(tmp)


def move_aside(out: Path) -> Path:
    """Rename ``out`` to a free ``.old-OUT-PID[-N]`` beside it, marked as this writer's, and return that."""
    base = out.parent / f".old-{out.name}-{os.getpid()}"
    old, n = base, 0
    while old.exists() or old.is_symlink():
        n += 1
        old = base.with_name(f"{base.name}-{n}")
    os.replace(out, old)
    if old.is_dir() and not old.is_symlink():
        try:
            mark(old)
        except OSError:  # unmarked, it is left for the user rather than removed by a later writer
            pass
    return old
