"""GPU boxes often lack deepspeed, hydra, wandb and datasets: the decoder side must not need them.

Checked statically: no module reachable at import time from msd_train.decoding,
msd_train.evaluation or msd_train.hub imports those packages at module level (imports
inside functions are fine: they run only when that feature is used).
"""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "msd_train"
TRAINING_ONLY = {"deepspeed", "hydra", "wandb", "datasets", "omegaconf"}


def _module_file(name: str) -> Path | None:
    rel = Path(*name.split(".")[1:])
    for cand in (PKG / rel.with_suffix(".py"), PKG / rel / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _top_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:  # module level only (also inside top-level if/try blocks)
        stack = [node]
        while stack:
            n = stack.pop()
            if isinstance(n, ast.Import):
                names.update(a.name for a in n.names)
            elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                names.add(n.module)
                names.update(f"{n.module}.{a.name}" for a in n.names)
            elif isinstance(n, (ast.If, ast.Try)):
                stack.extend(n.body + getattr(n, "orelse", []) + getattr(n, "finalbody", []))
    return names


def _reachable(roots: list[str]) -> dict[str, set[str]]:
    seen, todo, external = set(), list(roots), {}
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        path = _module_file(mod)
        if path is None:
            continue
        # importing a.b.c runs a/__init__ and a/b/__init__ first
        parts = mod.split(".")
        todo.extend(".".join(parts[:i]) for i in range(2, len(parts)))
        for name in _top_level_imports(path):
            if name.startswith("msd_train"):
                todo.append(name)
            else:
                external.setdefault(name.split(".")[0], set()).add(mod)
    return external


def test_decoder_side_needs_no_training_stack():
    external = _reachable(["msd_train.decoding", "msd_train.evaluation", "msd_train.hub",
                           "msd_train.targets", "msd_train.draft"])
    bad = {k: sorted(v) for k, v in external.items() if k in TRAINING_ONLY}
    assert not bad, f"training-only packages imported at module level: {bad}"
