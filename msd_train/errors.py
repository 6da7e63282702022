"""The user-facing error convention, a leaf module (the config glue and every check import it).

A user's mistake is a ``ConfigError`` (or another kind the entry point names) printed as
one paragraph, ``error: <message>``, with exit code 1; ``MSD_DEBUG=1`` re-raises it with
its traceback instead.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager


class ConfigError(ValueError):
    """A mistake in the command line or config; the message names the key and the fix."""


def debug() -> bool:
    return os.environ.get("MSD_DEBUG", "").lower() not in ("", "0", "false", "no")


@contextmanager
def user_errors(*kinds: type[BaseException]) -> Iterator[None]:
    """Print ``ConfigError`` (and ``kinds``) as ``error: <message>`` on stderr and exit 1;
    with ``MSD_DEBUG=1`` let them through with their traceback."""
    try:
        yield
    except (ConfigError, *kinds) as e:
        if debug():
            raise
        print(f"error: {e}\n(set MSD_DEBUG=1 for the traceback)", file=sys.stderr, flush=True)
        sys.exit(1)
