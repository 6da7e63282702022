"""What a Python file imports, read from its source (the layering and one-lab contracts)."""

from __future__ import annotations

import ast
from pathlib import Path


def imported_names(path: Path) -> set[str]:
    """Every module a file imports, anywhere in it: import statements (absolute) and
    importlib.import_module / __import__ of a constant name."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__"):
                names.add(node.args[0].value)
    return names
