"""Text conversations of the tiny target: Python's standard library, described by itself.

What an object does (the first sentence of its docstring), which module or class it
belongs to, what its parameters are (from ``inspect.signature``), single- and multi-turn,
in ShareGPT format. Material present on any machine, collected in a sorted order, hence
deterministic for a Python version.
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
import warnings

STDLIB_MODULES = """
abc argparse array ast base64 bisect builtins calendar cmath cmd codecs collections
colorsys configparser contextlib copy csv dataclasses datetime decimal difflib dis
email.utils enum filecmp fnmatch fractions ftplib functools getopt gettext glob graphlib
gzip hashlib heapq hmac html html.parser http.client http.cookies imaplib inspect io
ipaddress itertools json keyword linecache locale logging lzma mailbox math mimetypes
netrc numbers operator optparse pathlib pickle platform plistlib poplib pprint queue
quopri random re reprlib sched secrets selectors shelve shlex shutil smtplib socket
sqlite3 stat statistics string struct subprocess sysconfig tarfile tempfile textwrap
threading time timeit tokenize traceback types typing unittest urllib.parse
urllib.request uuid warnings wave weakref xml.dom.minidom xml.etree.ElementTree zipfile
zlib zoneinfo asyncio concurrent.futures multiprocessing doctest pdb profile pstats
trace tomllib
""".split()


def _first_sentence(doc: str) -> str | None:
    para = doc.strip().split("\n\n")[0]
    para = " ".join(line.strip() for line in para.splitlines())
    m = re.match(r"(.+?[.!?])(\s+[A-Z(`]|$)", para)
    if not m:
        return None
    s = m.group(1)
    words = s.split()
    if "->" in s or not s[0].isupper() or not s.isascii() or not 4 <= len(words) <= 40:
        return None
    return s


def _params(obj) -> list[str] | None:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    names = []
    for p in sig.parameters.values():
        if p.name in ("self", "cls") and not names:
            continue
        if p.kind is p.VAR_POSITIONAL:
            names.append("*" + p.name)
        elif p.kind is p.VAR_KEYWORD:
            names.append("**" + p.name)
        else:
            names.append(p.name)
    return names


def collect_stdlib() -> list[dict]:
    """Public functions, classes and methods of a fixed list of stdlib modules that have
    a usable one-sentence docstring. Sorted, hence deterministic for a Python version."""
    warnings.filterwarnings("ignore")
    out: dict[str, dict] = {}
    for mod_name in dict.fromkeys(STDLIB_MODULES):
        try:
            mod = importlib.import_module(mod_name)
        except Exception:  # pragma: no cover - a module missing on this platform
            continue
        short = mod_name.split(".")[-1]
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_"):
                continue
            if mod_name != "builtins" and getattr(obj, "__module__", None) not in (
                mod_name,
                "_" + short,
            ):
                continue
            if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
                continue
            items = [(f"{mod_name}.{name}", obj, None)]
            if inspect.isclass(obj):
                for mname, mobj in sorted(vars(obj).items()):
                    if mname.startswith("_"):
                        continue
                    if callable(mobj) or isinstance(mobj, (classmethod, staticmethod)):
                        items.append((f"{mod_name}.{name}.{mname}", getattr(obj, mname, mobj), name))
            for qual, o, cls in items:
                doc = o.__dict__.get("__doc__") if inspect.isclass(o) else o.__doc__
                if not isinstance(doc, str):
                    continue
                sentence = _first_sentence(inspect.cleandoc(doc))
                if sentence is None:
                    continue
                out[qual] = {
                    "qual": qual,
                    "module": mod_name,
                    "cls": cls,
                    "name": qual.rsplit(".", 1)[-1],
                    "kind": "class" if inspect.isclass(o) else ("method" if cls else "function"),
                    "doc": sentence,
                    "params": _params(o),
                }
    return [out[k] for k in sorted(out)]


ASK_DOES = [
    "What does `{q}` do?",
    "Explain `{q}` in one sentence.",
    "What is `{q}` for?",
    "Describe `{q}` briefly.",
]
ASK_WHERE = ["Which module is `{q}` in?", "Where is `{q}` defined?"]
ASK_PARAMS = ["What are the parameters of `{q}`?", "Which arguments does `{q}` take?"]
FOLLOW_WHERE = ["Which module is it in?", "Where is it defined?"]
FOLLOW_PARAMS = ["What are its parameters?", "And which arguments does it take?"]
FOLLOW_DOES = ["What does it do?", "And what is it for?"]
FOLLOW_REPEAT = ["Can you repeat that?", "Say that again, please."]


def join_words(words: list[str]) -> str:
    """["a", "b", "c"] -> "a, b and c"."""
    if len(words) == 1:
        return words[0]
    return ", ".join(words[:-1]) + " and " + words[-1]


def answer_where(o: dict) -> str:
    if o["cls"]:
        return f"`{o['name']}` is a method of the `{o['cls']}` class in the `{o['module']}` module."
    what = "class" if o["kind"] == "class" else "function"
    return f"`{o['name']}` is a {what} in the `{o['module']}` module."


def answer_params(o: dict) -> str:
    ps = o["params"]
    if not ps:
        return f"`{o['qual']}` takes no parameters."
    if len(ps) == 1:
        return f"`{o['qual']}` takes one parameter, `{ps[0]}`."
    return f"`{o['qual']}` takes the parameters " + join_words([f"`{p}`" for p in ps]) + "."


def text_conversation(o: dict, rng: random.Random) -> list[tuple[str, str]]:
    """One conversation about a stdlib object, as (question, answer) turns."""
    q = o["qual"]
    has_params = o["params"] is not None
    kinds = ["does", "does", "where", "params", "does+where", "does+where+params",
             "params+does", "does+repeat"]
    if not has_params:
        kinds = [k for k in kinds if "params" not in k]
    kind = rng.choice(kinds)
    turns: list[tuple[str, str]] = []
    for j, step in enumerate(kind.split("+")):
        if step == "does":
            ask = rng.choice(ASK_DOES if j == 0 else FOLLOW_DOES)
            turns.append((ask.format(q=q), o["doc"]))
        elif step == "where":
            ask = rng.choice(ASK_WHERE if j == 0 else FOLLOW_WHERE)
            turns.append((ask.format(q=q), answer_where(o)))
        elif step == "params":
            ask = rng.choice(ASK_PARAMS if j == 0 else FOLLOW_PARAMS)
            turns.append((ask.format(q=q), answer_params(o)))
        elif step == "repeat":
            turns.append((rng.choice(FOLLOW_REPEAT), turns[-1][1]))
    return turns


def sharegpt_conversation(turns: list[tuple[str, str]]) -> list[dict]:
    """(question, answer) turns as ShareGPT `conversations`."""
    conv = []
    for question, answer in turns:
        conv.append({"from": "human", "value": question})
        conv.append({"from": "gpt", "value": answer})
    return conv
