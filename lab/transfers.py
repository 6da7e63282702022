"""Count the device-to-host reads a piece of decoding code makes (CPU or CUDA alike).

A read is any operation whose result the host must wait for: ``.item()``, ``.tolist()``,
``bool()``/``int()``/``float()`` of a tensor (``if t:``, ``range(t)``, ``x[t]`` with a
0-d index), ``.cpu()``/``.numpy()``, ``nonzero`` and masked (boolean) indexing, whose
output size depends on the data. Counted with a ``TorchFunctionMode``, so the count is
deterministic and device-independent: on a CPU it says how many syncs the same code
would make on a GPU.

``uploads`` lists the tensors built from host data (``torch.tensor``, ``torch.as_tensor``):
on a GPU each is a pageable host-to-device copy, which synchronises the stream too.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_SCALAR = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero",
           "masked_select", "argwhere", "unique"}


def _is_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class HostReads(TorchFunctionMode):
    """``with HostReads() as reads: ...`` then ``reads.count`` and ``reads.names``."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []
        self.uploads: list[str] = []

    @property
    def count(self) -> int:
        return len(self.names)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _SCALAR:
            self.names.append(name)
        elif name in ("tensor", "as_tensor"):
            self.uploads.append(name)
        elif name in ("__getitem__", "__setitem__") and len(args) > 1 and _is_bool_index(args[1]):
            self.names.append(f"{name}[bool]")
        elif name == "to" and any(_is_cpu(a) for a in list(args[1:]) + list(kwargs.values())) \
                and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu":
            self.names.append("to(cpu)")
        return func(*args, **kwargs)


def _is_cpu(x) -> bool:
    return (isinstance(x, str) and x.startswith("cpu")) or (isinstance(x, torch.device) and x.type == "cpu")
