"""Results and releases without the paths of the machine that made them: each named folder is
written by its placeholder (``WORK``, ``OUT``), the checkout's files relative to it, and what is
left is found (``machine_paths``) so a copy can be refused instead of committed."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: where a path word starts: a string's start, or after a space, '=', ',', a quote, '(' or '`'
_WORD_START = r"""(?:^|(?<=[\s=,'"(`]))"""
#: an absolute path as a word of a string
_ABSOLUTE = re.compile(_WORD_START + r"/(?:[A-Za-z0-9_.+-]+/)*[A-Za-z0-9_.+-]+")
#: paths every Linux machine has (a device, the kernel's files): not where one machine kept anything
_SYSTEM = ("/dev/", "/proc/", "/sys/")


def portable(value, folders: dict[str | Path, str], checkout: str | Path = ROOT):
    """``value`` with every folder of ``folders`` (as given and resolved) written by its placeholder
    and ``checkout/`` dropped, in every string of nested lists and dicts; the longest folder first,
    so ``OUT`` inside ``WORK`` stays ``OUT``."""
    pairs = {str(Path(checkout)).rstrip("/") + "/": "", str(Path(checkout).resolve()).rstrip("/") + "/": ""}
    for folder, name in folders.items():
        for form in (str(folder), str(Path(folder).resolve())):
            pairs[form.rstrip("/")] = name
    # a folder is replaced where it ends a path word ("WORK2" is not WORK's), the longest first
    pattern = re.compile("|".join(re.escape(old) + ("" if old.endswith("/") else r"(?![A-Za-z0-9_.+-])")
                                  for old in sorted(pairs, key=len, reverse=True)))

    def rewrite(v):
        if isinstance(v, str):
            return pattern.sub(lambda m: pairs[m.group(0)], v)
        if isinstance(v, list):
            return [rewrite(x) for x in v]
        if isinstance(v, dict):
            return {k: rewrite(x) for k, x in v.items()}
        return v

    return rewrite(value)


def machine_paths(value, where: str = "") -> list[str]:
    """Every absolute path left in the strings of ``value`` (a word starting with '/'), with where it
    sits (``~/...`` is a user's own default, and ``/dev/``, ``/proc/``, ``/sys/`` every machine's)."""
    if isinstance(value, str):
        return [f"{where}: {m}" for m in _ABSOLUTE.findall(value) if not m.startswith(_SYSTEM)]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in machine_paths(v, f"{where}[{i}]")]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in machine_paths(v, f"{where}.{k}" if where else k)]
    return []


_TMP = re.compile(_WORD_START + "/tmp/")


def main(argv: list[str] | None = None) -> None:
    """Rewrite committed result files in place: ``--folder PATH=NAME`` pairs, ``--tmp`` writes any
    ``/tmp/`` as ``TMP/``; without ``--write`` only lists what is left."""
    import argparse

    p = argparse.ArgumentParser(description="Result files without this machine's paths",
                                epilog="python -m lab.portable benchmarks/x/*.json --folder /work/scale=WORK --tmp --write")
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--folder", action="append", default=[], metavar="PATH=NAME", help="a folder and its placeholder")
    p.add_argument("--tmp", action="store_true", help="write /tmp/ as TMP/ (scratch folders of a finished run)")
    p.add_argument("--write", action="store_true", help="rewrite the files (default: list the paths left)")
    a = p.parse_args(argv)
    folders = dict(f.split("=", 1) for f in a.folder)
    left = 0
    for f in a.files:
        text = f.read_text()
        new = portable(text, folders)
        new = _TMP.sub("TMP/", new) if a.tmp else new
        if a.write and new != text:
            f.write_text(new)
        for path in machine_paths(new):
            print(f"{f}:{path.lstrip(': ')}")
            left += 1
    if left:
        raise SystemExit(f"lab.portable: {left} paths of a machine left")


if __name__ == "__main__":
    main()
