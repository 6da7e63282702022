"""Argument types of the lab's programs: a count out of range is refused by argparse (its
usage line and the reason, exit 2) before any work starts, as the user commands refuse theirs.

    ap.add_argument("--steps", type=at_least(1), default=20)
    ap.add_argument("--ks", type=counts(words=("all",)), default="all,64,32,16")
"""

from __future__ import annotations

import argparse


def at_least(lo: int):
    """A whole number of at least ``lo``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"{value} must be at least {lo}")
        return value

    parse.__name__ = f"whole number >= {lo}"
    return parse


def counts(lo: int = 1, words: tuple[str, ...] = ()):
    """A comma-separated list of whole numbers of at least ``lo`` (or one of ``words``), not empty."""
    one = at_least(lo)

    def parse(text: str) -> list:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"{text!r}: give a comma-separated list, e.g. 1,2,4")
        return [t if t in words else one(t) for t in items]

    parse.__name__ = "list"
    return parse
