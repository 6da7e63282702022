"""Stale build locks in the torch extensions cache, found before DeepSpeed builds its ops.

DeepSpeed compiles its communication op (and others) on first use with
``torch.utils.cpp_extension.load``, which guards each build folder
(``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions/<python>_<device>/<op>/``) with an
empty file named ``lock``: the builder creates it, keeps it open while it compiles and
removes it when done; everyone else waits, silently, for as long as it exists. A launch
killed mid-build leaves it behind, and every later launch then waits forever.

The file names no owner, so staleness is decided from what can be observed:

- a process on this host has the file open: a build is running; leave it alone;
- nothing on this host has it open and nothing in the build folder changed for
  ``STALE_AFTER`` seconds: its builder is gone; remove it (a compiler writes objects and
  ninja's log as it goes, and no build of these ops takes that long);
- nothing on this host has it open and the cache is on a local disk (no other machine can
  reach it): its builder is gone; remove it at once;
- nothing on this host has it open, the cache is on a network file system (or where it lies
  cannot be told) and the folder changed recently: maybe another machine that shares the
  cache is building; wait for that (saying which file it is) until it goes away or turns stale.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

LOCK_NAME = "lock"  # torch.utils.cpp_extension's FileBaton in each build folder
STALE_AFTER = 300.0


def extensions_root() -> Path:
    """Where torch builds extensions: ``TORCH_EXTENSIONS_DIR``, else its default root."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def _held_here(lock: Path) -> bool | None:
    """Whether a process on this host has ``lock`` open (None: psutil cannot tell)."""
    try:
        import psutil
    except ImportError:
        return None
    target = os.path.realpath(lock)
    for p in psutil.process_iter():
        try:
            if any(f.path == target for f in p.open_files()):
                return True
        except psutil.Error:  # gone meanwhile, or another user's process
            continue
    return False


#: file systems other machines may mount too: a build lock there may be another host's
SHARED_FS = {"nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs", "fuse.sshfs",
             "fuse.glusterfs", "fuse.ceph", "fuse.gcsfuse", "fuse.s3fs", "fuse.juicefs", "9p", "afs", "orangefs"}


def on_shared_disk(path: Path) -> bool:
    """Whether ``path`` lies on a file system other machines may share (True when it cannot be told)."""
    try:
        mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return True
    real, best, fstype = os.path.realpath(path), "", None
    for m in mounts:
        if len(m) < 3:
            continue
        point = m[1].replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
            best, fstype = point, m[2]
    return fstype is None or fstype in SHARED_FS


def _last_activity(lock: Path) -> float:
    """The newest modification time in the lock's build folder (the lock's own included)."""
    times = [lock.stat().st_mtime]
    for f in lock.parent.iterdir():
        try:
            times.append(f.stat().st_mtime)
        except OSError:
            continue
    return max(times)


def clear_stale_build_locks(root: Path | None = None, poll: float = 1.0) -> list[Path]:
    """Remove the build locks under ``root`` whose builder is gone (see the module doc);
    returns those removed. Waits, with a warning naming the file, while a lock may belong to
    a build on another machine."""
    root = extensions_root() if root is None else Path(root)
    if not root.is_dir():
        return []
    removed, told = [], set()
    for lock in sorted({*root.glob(f"*/{LOCK_NAME}"), *root.glob(f"*/*/{LOCK_NAME}")}):
        while True:
            try:
                idle = time.time() - _last_activity(lock)
            except FileNotFoundError:
                break  # the build it guarded finished
            if _held_here(lock) is not False:
                break  # a live build on this host (torch waits for it), or no way to tell
            local = not on_shared_disk(lock)
            if idle >= STALE_AFTER or local:
                try:
                    lock.unlink()
                except FileNotFoundError:
                    break
                why = ("the cache is on a local disk, which no other machine builds in" if local else
                       f"nothing was built in {lock.parent} for {idle:.0f} s")
                log.warning("removed the stale build lock %s: no process holds it and %s (a launch was killed while "
                            "DeepSpeed compiled an op; it is built again now)", lock, why)
                removed.append(lock)
                break
            if lock not in told:
                told.add(lock)
                log.warning("waiting for the build lock %s: no process on this host holds it, so either another "
                            "machine sharing this cache is compiling that op or a killed launch left it; it is taken "
                            "as stale after %.0f s without activity. If no other machine uses this cache, delete "
                            "it to go on now.", lock, STALE_AFTER)
            time.sleep(poll)
    return removed
