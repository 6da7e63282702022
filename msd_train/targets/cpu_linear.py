"""fp32 linear layers for decoding on a CPU: oneDNN with each weight packed once.

PyTorch's fp32 CPU linear (MKL) costs about k times one row's for k rows and rounds a row
differently with the row count, so a speculative verification of 2 tokens costs ~2 plain
steps and its rows need not equal the plain step's. oneDNN's linear over a weight packed
once into its blocked layout reads the weight once for a few rows (1-3 rows cost what one
does on a memory-bound model) and computes each row the same whatever the row count
(bit-identical rows: ``benchmarks/real_lm/results/cpu_linear.json``, made by
``lab/bench/cpu_linear.py``). The pack is inference-only: the wrapper falls back to
``torch.nn.functional.linear`` wherever autograd is recording.

    n = pack_linears(model)      # every fp32 nn.Linear of ``model`` on the CPU, in place
"""

from __future__ import annotations

import torch
from torch import nn


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's packed linear (CPU builds of PyTorch do)."""
    ops = getattr(torch.ops, "mkldnn", None)
    return bool(torch.backends.mkldnn.is_available() and ops is not None
                and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose forward runs oneDNN over a packed copy of its weight. The
    original ``weight`` and ``bias`` stay (heads and checks read ``lm_head.weight``), so
    the layer holds its weight twice."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        with torch.no_grad():
            self._packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad) or x.dtype != torch.float32:
            return nn.functional.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, self.in_features).contiguous()
        bias = None if self.bias is None else self.bias.detach()
        out = torch.ops.mkldnn._linear_pointwise(flat, self._packed, bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, onednn"


def pack_linears(model: nn.Module) -> int:
    """Replace every fp32 ``nn.Linear`` of ``model`` that lives on the CPU by a
    ``PackedLinear``, in place; the number replaced (0 where oneDNN is not available)."""
    if not onednn_available():
        return 0
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear and child.weight.device.type == "cpu" and child.weight.dtype == torch.float32]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    return len(swaps)
