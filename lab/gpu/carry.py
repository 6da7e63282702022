"""What a GPU session's device call carries, and sending only what its commands read.

A device call sends the checkout (tracked and untracked-not-ignored files) and the carried
wheels (``.whl/``). This project keeps that to 48 MiB, so that results committed later never
stop a GPU session. The session's commands read a small part of the tree: the programs they
run and what those import (the whole ``msd_train`` package and ``conf/`` once the product is
imported: heads and Hydra configs are chosen by name), the tiny target, and the root files.
``prepare`` makes the checkout a git sparse checkout of exactly those files: the rest (the
SmolLM2 heads, ``benchmarks/``, ``tests/``, ``docs/``) leaves the working tree but stays in
git, and ``restore`` brings it back. Files with uncommitted changes are never removed (git
keeps them, and they travel), nor are untracked ones.

    python -m lab.gpu.session prepare   # before the device call
    python -m lab.gpu.session check     # what the call will carry (tree + wheels): fails above 48 MiB
    python -m lab.gpu.session restore   # after it: the whole checkout again
"""

from __future__ import annotations

import ast
import contextlib
import io
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MIB = 2 ** 20
LIMIT_MIB = 48          # tree + wheels, this project's ceiling (a device call itself takes 64)
PACK_MIB = 5.8          # `pack --no-wandb`: 12 wheels, as measured; the full pack (with wandb) is 26.3
#: parts whose commands the sparse checkout serves: both calls (setup runs pip on the wheels only)
PARTS = ("readme", "decode", "train", "decode_13b", "decode_qwen2vl", "train_mb")
#: what a part's commands read besides code and conf/: the README journey trains and evaluates on
#: the tiny target and its data; the 7B-shaped folder borrows the tiny target's tokenizer
DATA = {"readme": ("data/tiny-llava", "data/tiny"), "train": ("data/tiny-llava",),
        "train_mb": ("data/tiny-llava",)}
#: the command a device call runs: the session program itself
SESSION_ENTRY = "lab/gpu/session.py"
MARKER = "info/msd-gpu-session"   # under the worktree's git dir: the sparse checkout is the session's


# ----------------------------------------------------------------------------- the list


def session_commands(parts: tuple[str, ...] = PARTS) -> list[list[str]]:
    """Every command the parts run, from their own runners in dry mode (nothing runs)."""
    from lab.gpu import session as gs

    commands: list[list[str]] = []
    with tempfile.TemporaryDirectory() as work, contextlib.redirect_stdout(io.StringIO()):
        ctx = gs.Context(gs.Settings(), True, Path(work), Path(work), ROOT / ".whl", LIMIT_MIB, commands=commands)
        for part in parts:
            (Path(work) / part).mkdir()
            gs.RUNNERS[part](ctx)
    return commands


def entry_file(cmd: list[str], root: Path = ROOT) -> str | None:
    """The repository file a command runs (``python -m lab.x``, ``python x.py``, ``deepspeed x.py``)."""
    prog, args = Path(cmd[0]).name, cmd[1:]
    if prog.startswith("python") and args[:1] == ["-m"] and len(args) > 1:
        return module_file(args[1], root)
    if prog.startswith(("python", "deepspeed")):
        script = next((a for a in args if a.endswith(".py")), None)
        return script if script and (root / script).is_file() else None
    return None


def module_file(name: str, root: Path = ROOT) -> str | None:
    base = name.replace(".", "/")
    for rel in (f"{base}.py", f"{base}/__init__.py"):
        if (root / rel).is_file():
            return rel
    return None


def _imported(rel: str, root: Path) -> set[str]:
    """Module names a file imports, anywhere in it (a function's lazy import too)."""
    tree = ast.parse((root / rel).read_text(), rel)
    package = rel[:-len("/__init__.py")] if rel.endswith("/__init__.py") else rel.rpartition("/")[0]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split("/")[: len(package.split("/")) - node.level + 1] if package else []
                base = ".".join([*parts, *([base] if base else [])])
            names.add(base)
            names |= {f"{base}.{a.name}" for a in node.names}  # `from pkg import module`
    return {n for n in names if n}


def code_closure(entries: list[str], root: Path = ROOT) -> set[str]:
    """The entries and every repository module they import, with their packages' __init__.py."""
    seen: set[str] = set()
    todo = list(entries)
    while todo:
        rel = todo.pop()
        if rel in seen:
            continue
        seen.add(rel)
        parts = rel.split("/")[:-1]
        todo += [f"{'/'.join(parts[:k])}/__init__.py" for k in range(1, len(parts) + 1)
                 if (root / "/".join(parts[:k]) / "__init__.py").is_file()]  # `python -m a.b.c` imports a, a.b
        for name in _imported(rel, root):
            parts = name.split(".")
            for k in range(1, len(parts) + 1):  # the module and each package above it
                found = module_file(".".join(parts[:k]), root)
                if found and found not in seen:
                    todo.append(found)
    return seen


def tracked(paths: list[str], root: Path = ROOT) -> list[str]:
    if not paths:
        return []
    out = subprocess.run(["git", "ls-files", "-z", "--", *paths], cwd=root, capture_output=True, text=True, check=True)
    return [f for f in out.stdout.split("\0") if f]


def session_paths(parts: tuple[str, ...] = PARTS, root: Path = ROOT) -> list[str]:
    """The files and folders a session's commands read, derived from the commands themselves:
    their programs and the repository modules those import; all of ``msd_train/`` and ``conf/``
    once the product is imported; the data its parts read (``DATA``). Besides these, the root
    files and every .gitignore travel (``ROOT_PATTERNS``: what is ignored stays ignored)."""
    entries = [SESSION_ENTRY] + [e for cmd in session_commands(parts) if (e := entry_file(cmd, root))]
    code = code_closure(sorted(set(entries)), root)
    folders = ["msd_train", "conf"] if any(f.startswith("msd_train/") for f in code) else []
    folders += sorted({d for p in parts for d in DATA.get(p, ())})
    return sorted(folders + [f for f in code if not any(f.startswith(d + "/") for d in folders)])


#: sparse-checkout patterns for the root files and every .gitignore
ROOT_PATTERNS = ("/*", "!/*/", ".gitignore")


def session_files(parts: tuple[str, ...] = PARTS, root: Path = ROOT) -> list[str]:
    """The tracked files the session's sparse checkout holds."""
    every = [f for f in _git(root, "ls-files", "-z").stdout.split("\0") if f]
    extra = {f for f in every if "/" not in f or f.rsplit("/", 1)[-1] == ".gitignore"}
    return sorted(set(tracked(session_paths(parts, root), root)) | extra)


def size_of(files: list[str], root: Path = ROOT) -> int:
    return sum((root / f).stat().st_size for f in files if (root / f).is_file())


# ----------------------------------------------------------------------------- the sparse checkout


def _git(root: Path, *args: str, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, input=stdin, check=check)


def _marker(root: Path) -> Path:
    path = Path(_git(root, "rev-parse", "--git-path", MARKER).stdout.strip())
    return path if path.is_absolute() else root / path


def sparse_on(root: Path) -> bool:
    return _git(root, "config", "--bool", "core.sparseCheckout", check=False).stdout.strip() == "true"


def _pattern(path: str) -> str:
    """A gitignore-style pattern matching exactly this one path."""
    special = "\\*?[!# "
    return "/" + "".join("\\" + c if c in special else c for c in path)


def prepare(root: Path = ROOT, paths: list[str] | None = None) -> int:
    """Leave only the session's files in the working tree (a git sparse checkout)."""
    marker = _marker(root)
    if sparse_on(root) and not marker.is_file():
        print(f"error: {root} is already a sparse checkout that the GPU session did not set; "
              "`git sparse-checkout disable` it first (or run the session from another checkout)")
        return 1
    paths = session_paths(root=root) if paths is None else paths
    patterns = [*ROOT_PATTERNS, *(_pattern(p) + ("/" if (root / p).is_dir() else "") for p in paths)]
    done = _git(root, "sparse-checkout", "set", "--no-cone", "--stdin", check=False,
                stdin="".join(p + "\n" for p in patterns))
    if done.returncode != 0:
        print(f"error: git sparse-checkout set failed: {done.stderr.strip()}")
        return 1
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("".join(p + "\n" for p in patterns))
    if done.stderr.strip():
        print(done.stderr.strip())  # git names files it kept for their uncommitted changes
    files = [f for f in _git(root, "ls-files", "-z").stdout.split("\0") if f and (root / f).is_file()]
    print(f"sparse checkout: the GPU session's {len(files)} files, {size_of(files, root) / MIB:.1f} MiB; "
          "the rest is in git (python -m lab.gpu.session restore brings it back)")
    return 0


def restore(root: Path = ROOT) -> int:
    """The whole checkout again, if ``prepare`` made it sparse."""
    marker = _marker(root)
    if not marker.is_file():
        print("nothing to restore: the GPU session has not made this checkout sparse")
        return 0
    done = _git(root, "sparse-checkout", "disable", check=False)
    if done.returncode != 0:
        print(f"error: git sparse-checkout disable failed: {done.stderr.strip()}")
        return 1
    marker.unlink()
    print("the whole checkout is back")
    return 0


def carry_lines(tree: int, root: Path = ROOT) -> list[str]:
    """What travels now, and what ``prepare`` would leave, when it has not run."""
    if _marker(root).is_file():
        return [f"working tree: the GPU session's sparse checkout, {tree / MIB:.1f} MiB "
                "(python -m lab.gpu.session restore after the call)"]
    planned = size_of(session_files(root=root), root)
    return [f"working tree: the whole checkout, {tree / MIB:.1f} MiB; `python -m lab.gpu.session prepare` "
            f"leaves the session's files only: {planned / MIB:.1f} MiB"]
