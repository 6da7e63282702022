"""The head formats this project writes and reads, in one registry.

A format is a `HeadFormat`: its name (`format=` of scripts/export.py), the head
architectures its folders can hold, how to write one, optionally how to load one, and how
to recognise one from its config.json. `hub.folders.detect_layout`, `hub.load.load_head`
and scripts/export.py ask the registry; none of them branches on format names.

The formats are registered in `msd_train/hub/__init__.py`, in the order they are listed
(and tried by `detect`), one `register(...)` call each, so importing any `msd_train.hub`
module fills the registry. This module imports nothing of the formats themselves: the
modules that implement them import it, never the other way round.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from msd_train.formatting import with_article


@dataclass(frozen=True)
class HeadFormat:
    """One folder layout for heads.

    name:     ``format=`` of scripts/export.py, and what ``detect_layout`` returns.
    heads:    the head architectures (``DraftHead.architecture``) its folders hold; None:
              every registered head (``draft.HEADS``, a head registered later included).
    write:    ``(head_or_checkpoint, out, **options) -> summary dict``; a checkpoint is a
              folder or Hub id of any format ``load_head`` opens.
    detect:   ``(config.json as a dict) -> bool``: whether a folder is in this format.
    describe: what such a folder's config.json says, for the error on a folder of no format.
    options:  the keyword options ``write`` takes (keys of conf/hub/export.yaml).
    load:     ``(folder, target=None, source=None) -> head`` (``target`` a loaded
              ``msd_train.targets.Target`` or None, ``source`` the name the user gave), or
              None for a format that is written only.
    """

    name: str
    heads: tuple[str, ...] | None
    write: Callable[..., dict]
    detect: Callable[[dict], bool]
    describe: str
    options: tuple[str, ...] = ()
    load: Callable | None = None

    def export(self, head_or_checkpoint, out, **options) -> dict:
        """Write ``head_or_checkpoint`` to ``out`` in this format; returns the writer's summary
        (``out``, ``files``, ``warnings``, ...) with ``format`` set."""
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise ValueError(f"format={self.name} takes no {', '.join(f'{k}=' for k in unknown)} "
                             f"(it takes {', '.join(f'{k}=' for k in self.options) or 'no options'})")
        return {"format": self.name, **self.write(head_or_checkpoint, out, **options)}

    def holds(self, architecture: str) -> bool:
        return self.heads is None or architecture in self.heads

    def check_holds(self, head, where) -> None:
        """Refuse a head this format cannot hold, naming the formats that can."""
        if not self.holds(head.architecture):
            others = [f.name for f in FORMATS.values() if f.holds(head.architecture)]
            held = " and ".join(filter(None, (", ".join(self.heads[:-1]), self.heads[-1])))
            raise ValueError(f"format={self.name} holds {held} heads; {where} is "
                             f"{with_article(head.architecture)} head (use {' or '.join(f'format={n}' for n in others)})")


#: name -> format, in registration order
FORMATS: dict[str, HeadFormat] = {}


def register(fmt: HeadFormat) -> HeadFormat:
    """Add ``fmt`` to the registry (a second format of the same name is refused)."""
    if fmt.name in FORMATS:
        raise ValueError(f"a head format named {fmt.name!r} is already registered")
    FORMATS[fmt.name] = fmt
    return fmt


def names() -> list[str]:
    return list(FORMATS)


def get(name: str) -> HeadFormat:
    if name not in FORMATS:
        raise ValueError(f"format={name}: no such head format; use one of {', '.join(FORMATS)}")
    return FORMATS[name]


def detect(config: dict) -> HeadFormat | None:
    """The format a folder with this config.json is in, or None."""
    return next((f for f in FORMATS.values() if f.detect(config)), None)
