"""How msd_train's modules depend on each other, checked statically (ast, nothing imported).

* GPU boxes often lack deepspeed, hydra, wandb and datasets: no module reachable at import
  time from msd_train.decoding, msd_train.evaluation or msd_train.hub imports those
  packages at module level (imports inside functions are fine: they run only when that
  feature is used).
* No import circles: neither between modules nor between the packages of msd_train
  (dependencies point one way, as docs/architecture.md draws them), and no arrow back up:
  each package imports only packages of a lower layer (``LAYERS``).
* The product never imports the lab: nothing in msd_train imports ``lab`` (the builders,
  instruments and bench programs beside it), at module level or inside a function.
* vLLM stays in msd_train/serving.
"""

import ast
from pathlib import Path

from builders.imports import imported_names

PKG = Path(__file__).resolve().parents[2] / "msd_train"
TRAINING_ONLY = {"deepspeed", "hydra", "wandb", "datasets", "omegaconf"}


def _module_file(name: str) -> Path | None:
    if name == "msd_train":  # ``from msd_train import module``
        return PKG / "__init__.py"
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


# --- import circles -----------------------------------------------------------------------


def _all_modules() -> dict[str, Path]:
    mods = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _import_graph() -> dict[str, set[str]]:
    """module -> the msd_train modules it imports, anywhere in the file.

    Imports inside functions are edges too: deferring an import hides a circle from Python
    at import time, not from a reader, and both circles found so far (report <->
    ensemble, hub <-> evaluation) ran through function-level imports. Importing `a.b.c`
    also runs `a/__init__` and `a/b/__init__`, but those implied edges are left out: a
    package's `__init__` re-exports its own modules, so every module would form a
    "circle" with its package.
    """
    mods = _all_modules()
    graph = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from .x import y
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                # `from pkg import name` imports the module pkg.name when there is one
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names)
        graph[mod] = {t for t in targets if t in mods and t != mod}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_no_import_circles_between_modules():
    circles = _circles(_import_graph())
    assert not circles, f"import circles among msd_train modules: {circles}; move what both sides need into a leaf module"


def _package_graph() -> dict[str, set[str]]:
    def package(mod):
        return ".".join(mod.split(".")[:2])

    graph = {}
    for mod, deps in _import_graph().items():
        graph.setdefault(package(mod), set()).update(package(d) for d in deps if package(d) != package(mod))
    return graph


def test_packages_depend_one_way():
    graph = _package_graph()
    assert not _circles(graph), f"packages of msd_train that import each other: {_circles(graph)}"


def test_circle_finder_sees_function_level_imports(tmp_path, monkeypatch):
    """The checker itself: two modules importing each other inside functions are a circle."""
    pkg = tmp_path / "msd_train"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("from msd_train.a.x import f\n")
    (pkg / "a" / "x.py").write_text("def f():\n    from msd_train.a.y import g\n")
    (pkg / "a" / "y.py").write_text("def g():\n    from msd_train.a import x\n")
    (pkg / "b.py").write_text("from . import a\n")
    monkeypatch.setitem(globals(), "PKG", pkg)
    graph = _import_graph()
    assert graph["msd_train.b"] == {"msd_train.a"}
    assert _circles(graph) == [["msd_train.a.x", "msd_train.a.y"]]


# --- layers -------------------------------------------------------------------------------

#: the packages (and top-level modules) of msd_train, lowest first; a module imports (at
#: module level or inside a function) only from lower layers, never sideways or up. The
#: decoder sits below the hub and the entry points' checks (``validate``): the bounds it
#: needs are in ``checks``, at the bottom.
LAYERS = [
    {"msd_train.errors", "msd_train.paths", "msd_train.hf_compat", "msd_train.formatting"},
    {"msd_train.leftovers"},
    {"msd_train.runtime"},
    {"msd_train.config", "msd_train.outputs", "msd_train.checks", "msd_train.trust"},
    {"msd_train.targets"},
    {"msd_train.draft"},
    {"msd_train.decoding"},
    {"msd_train.data"},
    {"msd_train.features", "msd_train.hub"},
    {"msd_train.hub_cli"},
    {"msd_train.validate"},
    {"msd_train.training", "msd_train.evaluation"},
    {"msd_train.serving"},
]


def test_every_package_imports_only_from_lower_layers():
    def package(mod):
        return ".".join(mod.split(".")[:2])

    layer = {name: i for i, names in enumerate(LAYERS) for name in names}
    graph = _import_graph()
    unplaced = sorted({package(m) for m in graph} - set(layer) - {"msd_train"})
    assert not unplaced, f"packages with no layer in test_layering.LAYERS: {unplaced}; place them"
    upward = sorted(f"{mod} -> {dep}" for mod, deps in graph.items() for dep in deps
                    if package(mod) in layer and package(dep) in layer and package(mod) != package(dep)
                    and layer[package(dep)] >= layer[package(mod)])
    assert not upward, f"imports that do not point down the layers: {upward}"


# --- the product and the lab ------------------------------------------------------------------


def test_the_product_never_imports_the_lab():
    importers = sorted(mod for mod, path in _all_modules().items()
                       if any(n == "lab" or n.startswith("lab.") for n in imported_names(path)))
    assert not importers, f"msd_train modules that import the lab package: {importers}"


def test_the_lab_check_sees_function_level_and_dynamic_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\ndef f():\n    from lab.targets import random\n"
                 "def g():\n    importlib.import_module('lab.transfers')\n")
    assert {"lab.targets", "lab.transfers", "os"} <= imported_names(f)


def test_only_the_serving_package_knows_vllm():
    """vLLM is optional: no module outside msd_train/serving imports msd_train.serving or
    vllm, and inside it only the modules vLLM itself loads import vllm at module level."""
    graph = _import_graph()
    users = sorted(m for m, deps in graph.items()
                   if not m.startswith("msd_train.serving") and any(d.startswith("msd_train.serving") for d in deps))
    assert users == []
    at_top = sorted(m for m, path in _all_modules().items()
                    if any(n.split(".")[0] == "vllm" for n in _top_level_imports(path)))
    assert at_top == ["msd_train.serving.vllm_models"]
