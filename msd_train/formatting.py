"""Numbers as text, shared by the evaluation report and the model card.

A leaf on purpose: it imports nothing from msd_train, so `evaluation` and `hub` can both
use it without importing each other (tests/contracts/test_layering.py checks for import circles).
"""

from __future__ import annotations


def fmt(v, digits: int = 3) -> str:
    """A metric for a Markdown table: '-' for missing, yes/no, fixed decimals, short lists."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(fmt(x, 2) for x in v) + "]"
    return str(v)


def with_article(name: str) -> str:
    """``name`` after "a" or "an" as it is read aloud: an msd, an eagle3, a dflash (a head
    architecture or any lower-case name spelt or said letter by letter)."""
    return f"{'an' if name[:1].lower() in 'aefhilmnorsx' else 'a'} {name}"
