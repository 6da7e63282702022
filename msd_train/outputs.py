"""Output folders of the commands: never destroyed by surprise, one writer at a time.

Every command that writes a folder goes through :func:`check_output`: ``scripts/export.py``,
``scripts/import_reference.py``, ``eval.py`` and push staging through :func:`output_dir`,
``scripts/regenerate_data.py`` and ``scripts/generate_features.py`` (which resume in place)
directly:

- the folder is written under a new temporary name beside ``out`` and renamed into place
  when it is whole, so a crash, Ctrl-C or full disk leaves ``out`` as it was;
- an existing ``out`` is replaced only when it is empty or this kind of command made it
  (:func:`made_by` reads the record written beside it, ``.NAME.msd-output``); any other
  non-empty folder is refused, naming it, unless the user says ``overwrite=true``;
- a folder that holds a run (a ``run_dir``, a stage folder, checkpoints, a run's ``final/``
  or ``best/``), another command's data (a feature store, a regeneration folder), the
  command's own input, or the current folder is never replaced, ``overwrite=true`` or not
  (:func:`holds_run`, :func:`holds_data`); ``overwrite=true`` also searches the folder it
  would delete for them, a few levels deep;
- two writers of one ``out`` are refused like two training launches into one ``run_dir``:
  :class:`OwnerLock` (``.NAME.lock`` beside it, the owner's pid and host; a lock whose
  owner is gone is taken over with a warning); a writer that finished while this one ran
  (``out`` made after this process started, :func:`made_since_start`) is not replaced;
- what killed writers leave (the staging folder, ``.old-NAME-PID``) is removed at the next
  write of that ``out`` when the marker inside says a writer made it and that process is gone
  (:func:`clean_litter`, ``msd_train.leftovers``); a user's folder of those names is never
  touched, and one in the way of the staging folder is refused, naming it.

Light (no torch): the hub scripts and the evaluation import it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from msd_train.errors import ConfigError, disk_full
from msd_train.leftovers import MARKER, make_staging, move_aside, process_start, remove_if_left, unmark

log = logging.getLogger(__name__)

#: beside an output folder NAME: who made it (``.NAME.msd-output``) and who writes it now (``.NAME.lock``)
RECORD_SUFFIX = ".msd-output"
LOCK_SUFFIX = ".lock"


class OutputError(ConfigError):
    """An output folder this command may not write (the message names it and the way out)."""


class OutputBusy(OutputError):
    """Another live command is writing the same output folder."""


# ----------------------------------------------------------------------------- owner locks
def owner_alive(owner: dict) -> bool:
    start = process_start(owner["pid"])
    if start is None:
        return False
    recorded = owner.get("start_time")
    return start < 0 or not isinstance(recorded, (int, float)) or abs(start - float(recorded)) < 1.0


def read_owner(text: str) -> dict | None:
    """The owner a lock file names (a positive pid and a host), or None when it names none:
    empty (a process killed between creating and writing it), ``{}``, or not JSON."""
    try:
        owner = json.loads(text)
    except ValueError:
        return None
    ok = (isinstance(owner, dict) and isinstance(owner.get("pid"), int) and owner["pid"] > 0
          and isinstance(owner.get("host"), str) and owner["host"])
    return owner if ok else None


class OwnerLock:
    """A lock file naming its owner (pid, host, start time, command), made with O_EXCL.

    A lock that does not name a live owner on this host is stale and taken over with a
    warning: its pid is gone (or reused), or it names no owner at all. One naming another
    host is respected, since its process cannot be checked from here. Subclasses word the
    refusals (:meth:`busy`, :meth:`unwritable`)."""

    #: the setting the user names the locked folder under, in the refusals' advice
    setting = "out"

    def __init__(self, path: str | Path, what: str = "output"):
        self.path = Path(path)
        self.what = what
        self.held = False

    # the messages
    def busy(self, owner: dict) -> Exception:
        return OutputBusy(
            f"{self.what} is being written by another command: pid {owner['pid']} on {owner['host']}, started "
            f"{owner.get('started')} ({owner.get('command')}). Two writers of one folder would mix their files; "
            f"wait for it to end, stop it, or choose another out=. If that command is gone (its machine died), "
            f"delete {self.path}.")

    def unwritable(self, err: OSError) -> Exception:
        return OutputError(f"cannot write the lock {self.path} ({type(err).__name__}: {err.strerror or err}); "
                           f"{self.what} must be on a writable disk with free space: fix its permissions or "
                           f"free space, or choose another {self.setting}=")

    def acquire(self) -> None:
        try:
            self._acquire()
        except OSError as e:  # read-only or full file system, no permission
            raise self.unwritable(e) from e

    def _acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "start_time": process_start(os.getpid()),
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self._read_owner()
                if owner is False:
                    continue  # the owner just released it: try again
                if owner is not None and (owner["host"] != me["host"] or owner_alive(owner)):
                    raise self.busy(owner) from None
                if owner is None:
                    log.warning("lock %s names no owner (left half-written by a killed process); taking it over",
                                self.path)
                else:
                    log.warning("lock %s was left by pid %s on %s, which is gone; taking it over",
                                self.path, owner["pid"], owner["host"])
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return
        raise self.busy({"pid": "?", "host": "?", "command": "another process keeps creating it"})

    def _read_owner(self) -> dict | None | bool:
        """The owner the lock names; None when it names none; False when it is gone."""
        for attempt in range(2):
            try:
                owner = read_owner(self.path.read_text(errors="replace"))
            except FileNotFoundError:
                return False
            if owner is not None or attempt:
                return owner
            time.sleep(0.2)  # a process may be between creating the file and writing it: look again
        return None

    def release(self) -> None:
        if self.held:
            self.held = False
            try:
                owner = self._read_owner()
                if owner and owner["pid"] == os.getpid():
                    self.path.unlink()
            except OSError as e:  # the folder went away or read-only under us: the next one takes it over
                log.warning("could not remove the lock %s (%s)", self.path, e)

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# ----------------------------------------------------------------------------- what a folder holds
#: what a training run leaves in a folder: (the check, what that makes the folder)
RUN_MARKS = (
    (lambda p: (p / "checkpoints").is_dir(), "a stage folder (it holds checkpoints/)"),
    (lambda p: (p / "metrics.jsonl").is_file(), "a stage folder (it holds metrics.jsonl)"),
    (lambda p: any(c.name.startswith("step-") and c.is_dir() for c in p.iterdir()),
     "a checkpoints folder (it holds step-* checkpoints)"),
    (lambda p: (p / "recipe_state.json").is_file(), "a training checkpoint"),
    (lambda p: any(c.name.startswith("replaced-") and c.is_dir() for c in p.iterdir()),
     "a stage folder (it holds replaced-* runs)"),
    (lambda p: (p / ".lock").is_file() and any(c.name.startswith("stage") for c in p.iterdir()),
     "a run_dir"),
)


def feature_store(p: Path) -> bool:
    """A store of scripts/generate_features.py (msd_train/features/store.py's FORMAT in its manifest)."""
    try:
        return '"msd-train-features"' in (p / "manifest.json").read_text(errors="replace")[:4096]
    except OSError:
        return False


def regeneration_folder(p: Path) -> bool:
    """A folder of scripts/regenerate_data.py: its settings and its records (msd_train/data/regenerate.py)."""
    try:
        settings = (p / "settings.json").read_text(errors="replace")[:4096]
    except OSError:
        return False
    return '"max_new_tokens"' in settings or (p / "regenerated.jsonl").is_file() or any(p.glob("rank-*.jsonl"))


#: what the data commands leave in a folder
DATA_MARKS = (
    (feature_store, "a feature store (its manifest.json, written by scripts/generate_features.py)"),
    (regeneration_folder, "a regeneration folder (written by scripts/regenerate_data.py)"),
)


def _is(path: Path, marks) -> str | None:
    for check, what in marks:
        if check(path):
            return what
    return None


def _holds(path: str | Path, marks, outer: str) -> str | None:
    """What ``marks`` name ``path`` or a folder one level below it (then ``outer``, holding it), or None."""
    path = Path(path)
    if not path.is_dir():
        return None
    try:
        what = _is(path, marks)
        if what:
            return what
        for child in path.iterdir():
            if child.is_dir() and not child.is_symlink():
                what = _is(child, marks)
                if what:
                    return f"{outer} ({child.name}/ is {what})"
    except OSError:
        return None
    return None


def holds_run(path: str | Path) -> str | None:
    """Why ``path`` holds a training run (so no command may replace it), or None.

    A run is a ``run_dir`` (its ``.lock`` or ``stageN/`` folders), a stage folder (its
    ``checkpoints/``, ``metrics.jsonl``, ``replaced-*/``) or a checkpoints folder
    (``step-NNNNNN/``), at ``path`` or one level below it; a run's ``final/`` and ``best/``
    exports are part of it (training takes a complete ``final/`` as the finished stage)."""
    path = Path(path)
    if path.name in ("final", "best") and path.parent.is_dir():
        try:
            stage = _is(path.parent, RUN_MARKS)
        except OSError:
            stage = None
        if stage:
            return f"a run's {path.name}/ export (its parent is {stage}; training takes a complete final/ as the finished stage)"
    return _holds(path, RUN_MARKS, "a run")


def holds_data(path: str | Path) -> str | None:
    """Why ``path`` holds a feature store or regenerated conversations (at it or one level below), or None."""
    return _holds(path, DATA_MARKS, "a folder of your work")


#: a folder replaced with overwrite=true is searched this deep for a run or data before anything moves
DEEP_LEVELS, DEEP_FOLDERS = 4, 2000


def _holds_deep(out: Path) -> str | None:
    """What of a run or data lies anywhere below ``out`` (DEEP_LEVELS levels, DEEP_FOLDERS folders)."""
    seen = 0
    for root, dirs, _files in os.walk(out):
        depth = len(Path(root).relative_to(out).parts)
        seen += 1
        if seen > DEEP_FOLDERS:
            return f"a tree of more than {DEEP_FOLDERS} folders (too large to check that it holds no run or data)"
        try:
            what = _is(Path(root), RUN_MARKS) or _is(Path(root), DATA_MARKS)
        except OSError:
            what = None
        if what and depth:
            return f"a folder of your work ({Path(root).relative_to(out)}/ is {what})"
        if depth >= DEEP_LEVELS:
            dirs[:] = []
    return None


def record_path(out: Path) -> Path:
    return out.parent / f".{out.name}{RECORD_SUFFIX}"


def lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}{LOCK_SUFFIX}"


def made_by(out: Path) -> str | None:
    """The kind of command that made ``out`` (from the record beside it), or None."""
    try:
        record = json.loads(record_path(out).read_text())
        return record.get("kind") if isinstance(record, dict) else None
    except (OSError, ValueError):
        return None


def made_since_start(out: Path) -> dict | None:
    """The record of ``out`` when another process made it after this one started (a writer
    that ran beside this one and finished first), else None."""
    try:
        record = json.loads(record_path(out).read_text())
    except (OSError, ValueError):
        return None
    started = process_start(os.getpid())
    made = record.get("made_at") if isinstance(record, dict) else None
    if not isinstance(made, (int, float)) or started is None or started < 0 or record.get("pid") == os.getpid():
        return None
    return record if made >= started else None


def _inside(a: Path, b: Path) -> bool:
    """Whether ``a`` is ``b`` or inside it."""
    try:
        a.resolve().relative_to(b.resolve())
        return True
    except ValueError:
        return False


def folder_path(out: str | Path) -> Path:
    """An output folder as a path with a name of its own: ``~`` expanded, and one written with
    ``.`` or ``..`` in it (``out=DIR/sub/..``) as the folder it names (staging, lock and record
    files go beside a folder by its name)."""
    out = Path(out).expanduser()
    if any(part in (".", "..") for part in Path(os.fspath(out)).parts) or out.name in ("", ".", ".."):
        out = Path(os.path.realpath(out))
    return out


def check_output(out: str | Path, kind: str, overwrite: bool | None = False, sources: Iterable = (),
                 recognise=None, setting: str = "out") -> Path:
    """Refuse an ``out`` this ``kind`` of command may not write; returns it as a Path.

    ``overwrite``: the user's ``overwrite=``; None for a command that has no such option
    (its refusals then offer none). ``sources``: what the command reads (never replaced, nor
    a folder holding them). ``recognise(folder) -> bool``: a folder of this kind (made before
    records existed, or one the command resumes). ``setting``: the name the user gave the
    folder under."""
    out = folder_path(out)
    name = f"{setting}={out}"
    never = "" if overwrite is None else ", not even with overwrite=true"
    if out.exists() and not out.is_dir():
        raise OutputError(f"{name} is a file; give a folder to write into (a new or empty one)")
    if _inside(Path.cwd(), out):
        here = "the current folder" if out.resolve() == Path.cwd().resolve() else "a folder holding the current one"
        raise OutputError(f"{name} is {here}: replacing it would pull the working folder from under this command; "
                          f"give a folder of its own, e.g. {setting}=./{Path(kind).stem}-out"
                          + (" (not even with overwrite=true)" if never else ""))
    for src in sources:
        if src is None or str(src) == "":
            continue
        src = Path(str(src)).expanduser()
        if src.exists() and _inside(src, out):
            raise OutputError(f"{name} holds this command's input {src}: writing it would replace what is "
                              f"being read; choose another {setting}= (never this folder{never})")
    run = holds_run(out)
    if run:
        raise OutputError(f"{name} is {run}: a command never replaces a training run{never}; choose another "
                          f"{setting}= (e.g. a new folder beside it)")
    maker = made_by(out) if out.is_dir() else None
    own = maker == kind or (out.is_dir() and maker is None and recognise is not None and recognise(out))
    data = None if own else holds_data(out)
    if data:
        raise OutputError(f"{name} is {data}: {kind} never writes into another command's data{never}; choose "
                          f"another {setting}= (e.g. a new folder beside it)")
    if out.is_dir() and any(out.iterdir()) and not own:
        if not overwrite:
            why = f"it was made by {maker}" if maker else "this command did not make it"
            raise OutputError(f"{name} is a folder that is not empty and {why}; {kind} writes a folder of its "
                              f"own, so choose a new {setting}= folder"
                              + ("" if overwrite is None else
                                 ", or replace it with overwrite=true (what is in it is then deleted)"))
        deep = _holds_deep(out)
        if deep:
            raise OutputError(f"{name} is {deep}: overwrite=true would delete it; choose another {setting}= "
                              f"(or move what you keep out of it first)")
    return out


def staging_path(out: Path) -> Path:
    """Where ``out`` is written before it is renamed into place (the same name on every
    rank of a launch; the lock keeps other commands out)."""
    return out.parent / f".tmp-{out.name}"


@contextlib.contextmanager
def output_dir(out: str | Path, kind: str, overwrite: bool = False, sources: Iterable = (),
               keep_partial: bool = False, recognise=None, lock: bool = True) -> Iterator[Path]:
    """Write a command's output folder whole or not at all.

    Yields an empty staging folder beside ``out``; when the body returns it is renamed to
    ``out`` (over an older one this command may replace, see :func:`check_output`). When
    the body fails the staging folder is removed and ``out`` left as it was, except with
    ``keep_partial`` (eval's report of the turns measured before a Ctrl-C), where what was
    written is moved into place when there is any. A full disk is an :class:`OutputError`
    saying so. ``lock=False``: the caller holds the lock (ranks of one launch)."""
    out = check_output(out, kind, overwrite, sources, recognise)
    owner = OwnerLock(lock_path(out), f"out={out}") if lock else None
    if owner is not None:
        owner.acquire()
    tmp = staging_path(out)
    try:
        rival = made_since_start(out) if owner is not None else None
        if rival is not None:
            raise OutputBusy(f"out={out} was written by another command while this one ran: pid {rival.get('pid')} "
                             f"on {rival.get('host')}, finished {rival.get('made')} ({rival.get('command')}). Two "
                             f"writers of one folder: this one would replace that one's; nothing was written. Look at "
                             f"what is there, then run this command again to replace it, or choose another out=")
        try:
            clean_litter(out)  # what killed writers of out left (each folder's marker says so)
            make_staging(tmp, out, locked=True)  # this command, or its caller, holds out's lock
        except OSError as e:
            raise OutputError(f"out={out} cannot be written ({e.strerror or e}); choose a folder you can "
                              f"write to") from e
        try:
            yield tmp
        except BaseException as err:
            if keep_partial and tmp.is_dir() and any(p.name != MARKER for p in tmp.iterdir()) \
                    and not disk_full(err, out.parent):
                _into_place(tmp, out, kind)
            else:
                shutil.rmtree(tmp, ignore_errors=True)
            if disk_full(err, out.parent):
                raise OutputError(f"the disk is full: writing {out} failed ({_free(out)} free); the partial "
                                  f"folder was removed and out= left as it was. Free space on that disk (or "
                                  f"choose out= on another one) and run the same command again") from err
            raise
        if not tmp.is_dir():
            raise OutputError(f"{kind} wrote nothing into {out}")
        try:
            _into_place(tmp, out, kind)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if disk_full(e, out.parent):
                raise OutputError(f"the disk is full: finishing {out} failed ({_free(out)} free); out= was left as "
                                  f"it was. Free space and run the same command again") from e
            raise
    finally:
        if owner is not None:
            owner.release()


def _free(where: Path) -> str:
    try:
        return f"{shutil.disk_usage(where if where.exists() else where.parent).free / 2**20:.0f} MiB"
    except OSError:
        return "unknown space"


def _into_place(tmp: Path, out: Path, kind: str) -> None:
    """Rename ``tmp`` to ``out``; an older ``out`` is moved aside first and removed after."""
    from msd_train.runtime import make_readable  # torch: only once there is something to place

    unmark(tmp)
    make_readable(tmp)
    old = move_aside(out) if out.exists() or out.is_symlink() else None
    os.replace(tmp, out)
    record = {"kind": kind, "command": " ".join(sys.argv), "made": time.strftime("%Y-%m-%d %H:%M:%S"),
              "made_at": time.time(), "pid": os.getpid(), "host": socket.gethostname()}
    try:
        record_path(out).write_text(json.dumps(record) + "\n")
    except OSError as e:  # the folder is whole; without the record a rerun needs overwrite=true
        log.warning("could not record who made %s (%s)", out, e)
    if old is not None:
        _remove(old)


def _remove(path: Path) -> None:
    """Delete a folder of ours, or a link (never what the link points to)."""
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)


def clean_litter(out: Path) -> None:
    """Remove what killed writers of ``out`` left beside it: its staging folder and moved-aside
    ``.old-NAME-*`` folders whose marker says a writer made them and that process is gone
    (``msd_train.leftovers``); any other folder of those names is left as it is."""
    remove_if_left(staging_path(out), locked=True)  # the caller holds out's lock
    for old in out.parent.glob(f".old-{out.name}-*"):
        remove_if_left(old, locked=True)


def relocate(value, tmp: Path, out: Path):
    """``value`` (a writer's summary: strings, lists, dicts) with the staging path replaced by ``out``."""
    if isinstance(value, str):
        return value.replace(str(tmp), str(out))
    if isinstance(value, Path):
        return Path(str(value).replace(str(tmp), str(out)))
    if isinstance(value, dict):
        return {k: relocate(v, tmp, out) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(relocate(v, tmp, out) for v in value)
    return value


class FolderLock(OwnerLock):
    """One writer at a time of a folder a command fills and resumes in place (a feature store,
    a regeneration folder): ``.NAME.lock`` beside it, as :class:`OwnerLock`; ``setting``:
    the name the user gave the folder under."""

    def __init__(self, folder: str | Path, setting: str):
        folder = folder_path(folder)
        super().__init__(lock_path(folder), f"{setting}={folder}")
        self.setting = setting

    def busy(self, owner: dict) -> Exception:
        return OutputBusy(
            f"{self.what} is being written by another command: pid {owner['pid']} on {owner['host']}, started "
            f"{owner.get('started')} ({owner.get('command')}). Two writers would do the same work twice and mix "
            f"their files; wait for it to end (launching the same command then resumes what it left), stop it, or "
            f"choose another {self.setting}=. If that command is gone (its machine died), delete {self.path}.")

