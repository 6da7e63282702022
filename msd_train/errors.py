"""The user-facing error convention, a leaf module (the config glue and every check import it).

A user's mistake is a ``ConfigError`` (or another kind the entry point names) printed as
one paragraph, ``error: <message>``, with exit code 1; ``MSD_DEBUG=1`` re-raises it with
its traceback instead.

Every entry point runs under :func:`user_errors`, which also turns the failure classes any
command can meet into that one paragraph, naming the file, the cause and the fix
(:func:`describe`): a full disk, a path that does not exist, a target or head name that is
neither a folder nor a Hub id, a busy port; and Ctrl-C into one line saying what was kept
(exit 130). Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager


class ConfigError(ValueError):
    """A mistake in the command line or config; the message names the key and the fix."""


class PushError(RuntimeError):
    """The Hub did not take an upload (no network, offline mode, refused token or repo);
    the message says why, with the token scrubbed, and what to do."""


def debug() -> bool:
    return os.environ.get("MSD_DEBUG", "").lower() not in ("", "0", "false", "no")


def _chain(err: BaseException) -> Iterator[BaseException]:
    seen = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


#: how a full disk reads where it is not an OSError(ENOSPC): safetensors' writer raises its own
#: SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, ... })"),
#: Arrow (the datasets cache) an OSError with no errno and the system's words in its message
FULL_DISK_WORDS = ("StorageFull", "QuotaExceeded", "No space left on device", "Disk quota exceeded")


def disk_full(err: BaseException, where=None) -> BaseException | None:
    """The exception in ``err``'s chain that says the disk is full, or None. ``where``: the
    folder being written; a failed write there (torch.save words a full disk its own way,
    differently between versions) counts when that disk has under 64 MiB free."""
    for e in _chain(err):
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return e
        if (not isinstance(e, OSError) or e.errno is None) and any(w in str(e) for w in FULL_DISK_WORDS):
            return e  # safetensors' error; Arrow's OSError carries no errno, only the words
    if where is not None and isinstance(err, (OSError, RuntimeError)):  # a failed write, not Ctrl-C or a bug
        import shutil

        try:
            if shutil.disk_usage(where).free < 64 << 20:
                return err
        except OSError:
            pass
    return None


def unpickling_reason(err: BaseException) -> str:
    """The one line of reason in ``torch.load(weights_only=True)``'s refusal, which wraps it in
    paragraphs of advice (among them to load with ``weights_only=False``, which this project
    never does)."""
    text = " ".join(str(err).split())
    if "WeightsUnpickler error: " in text:
        reason = text.split("WeightsUnpickler error: ", 1)[1]
        return reason.split(" Please use `torch.serialization")[0].split(" Check the documentation")[0].strip()
    paras = [" ".join(p.split()) for p in str(err).split("\n\n") if p.strip()]
    reason = next((p for p in paras[1:] if not p.startswith(("Check the documentation", "Please file an issue"))),
                  paras[0] if paras else "")
    return reason or type(err).__name__


def describe(err: BaseException, kept: str | None = None) -> str | None:
    """One paragraph for a failure every command can meet (the file, the cause, the fix), or
    None when ``err`` is none of them (a bug: its traceback is shown). ``kept``: what the
    command keeps when it stops half-way (said for a full disk)."""
    full = disk_full(err)
    if full is not None:
        where = getattr(full, "filename", None) or "a file"
        cause = getattr(full, "strerror", None) or str(full).strip().splitlines()[0][:200]
        return (f"the disk is full: writing {where} failed ({cause}). "
                f"{kept or 'What was being written was not finished'}; free space on that disk (or point the "
                f"output at another one) and run the same command again")
    for e in _chain(err):
        text = str(e)
        if (isinstance(e, OSError) and e.errno == errno.EADDRINUSE) or "EADDRINUSE" in text \
                or "address already in use" in text.lower():
            port = os.environ.get("MASTER_PORT")
            return (f"the port {port or 'asked for'} is already in use ({text.strip().splitlines()[0][:200]}): "
                    f"another job (a training or evaluation launch) listens on it. Give the launcher another one "
                    f"(deepspeed --master_port N, torchrun --master_port N, or MASTER_PORT=N), or leave it out: "
                    f"`python train.py` picks a free one")
    for e in _chain(err):
        name = type(e).__name__
        if name in ("HFValidationError", "RepositoryNotFoundError", "GatedRepoError", "LocalEntryNotFoundError"):
            return (f"{str(e).strip().splitlines()[0][:300]}: a model path that is not a local folder is read as a "
                    f"Hugging Face Hub id, and this one cannot be used as either. Give an existing folder "
                    f"(config.json + weights), or a Hub id OWNER/NAME that exists (online, or in the local cache)")
        if isinstance(e, FileNotFoundError):
            where = e.filename or str(e)
            return (f"{where}: no such file or folder ({e.strerror or 'not found'}); check the path, or make it "
                    f"first (a target folder with its build script, a head with train.py or scripts/export.py)")
        if isinstance(e, IsADirectoryError):
            return f"{e.filename}: a folder where a file was expected; give the file's path"
        if isinstance(e, NotADirectoryError):
            return f"{e.filename}: a file where a folder was expected; give a folder's path"
        if isinstance(e, PermissionError):
            return f"{e.filename}: permission denied; make it readable/writable for you, or choose another path"
    return None


@contextmanager
def user_errors(*kinds: type[BaseException], kept: str | None = None) -> Iterator[None]:
    """Print ``ConfigError`` (and ``kinds``, and what :func:`describe` knows) as
    ``error: <message>`` on stderr and exit 1; with ``MSD_DEBUG=1`` let them through with
    their traceback. Ctrl-C prints ``interrupted: <kept>`` and exits 130 (``kept``: what the
    command keeps when stopped; by default that its output is left as it was)."""
    try:
        yield
    except (ConfigError, *kinds) as e:
        if debug():
            raise
        _say(str(e))
    except KeyboardInterrupt:
        if debug():
            raise
        print(f"interrupted: {kept or 'nothing half-written is left; what was there before is as it was'}",
              file=sys.stderr, flush=True)
        sys.exit(130)
    except Exception as e:
        message = describe(e, kept)
        if message is None or debug():
            raise
        _say(message)


def _say(message: str) -> None:
    print(f"error: {message}\n(set MSD_DEBUG=1 for the traceback)", file=sys.stderr, flush=True)
    sys.exit(1)


def run_main(main, *kinds: type[BaseException], kept: str | None = None):
    """``main()`` under :func:`user_errors`: what a script's ``if __name__ == "__main__"`` runs."""
    with user_errors(*kinds, kept=kept):
        return main()
