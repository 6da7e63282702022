"""Captured forwards: the verify forward, the head's draft step and the plain one-token
step replayed from CUDA graphs.

Every step the decoder runs has a shape fixed by the decoding settings (the tree is padded
to ``total_tokens``, the frontier to ``top_k``; masks span the cache's whole capacity),
and everything that changes from one call to the next (tokens, positions, the additive
mask, the cache slots written) is an input tensor. So each step can be captured once per
shape and replayed: ``StepGraphs.run(key, fn, **inputs)`` copies the inputs into the
graph's static buffers, replays, and returns copies of the outputs (callers may keep them
across replays). The KV caches are written in place at ``write_index`` (a static input),
so they need no copy; a cache that grows gets new buffers, and the graphs are dropped
(``clear``).

Capture is CUDA only (``DecodeConfig.cuda_graphs``: "auto" = on for CUDA targets, off on
CPU). Without capture ``run`` just calls the step: the CPU path is the same code.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def resolve(setting, device: torch.device) -> bool:
    """``decoding.cuda_graphs`` (auto | true | false) for a target on ``device``."""
    if setting in ("auto", None):
        return device.type == "cuda"
    if isinstance(setting, str):
        if setting.lower() not in ("true", "false", "on", "off"):
            raise ValueError(f"decoding.cuda_graphs must be auto, true or false, got {setting!r}")
        setting = setting.lower() in ("true", "on")
    if setting and device.type != "cuda":
        raise ValueError(f"decoding.cuda_graphs=true needs a CUDA target, this one is on {device}; "
                         "use decoding.cuda_graphs=auto (off on CPU)")
    return bool(setting)


class _Captured:
    def __init__(self, fn: Callable, inputs: dict[str, torch.Tensor], pool):
        self.inputs = {k: v.clone() for k, v in inputs.items()}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: lazy inits (cuBLAS handles, workspaces) stay out of the graph
            for _ in range(2):
                fn(**self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = fn(**self.inputs)

    def __call__(self, inputs: dict[str, torch.Tensor]):
        for k, v in inputs.items():
            self.inputs[k].copy_(v)
        self.graph.replay()
        return tuple(o.clone() for o in self.outputs)


class StepGraphs:
    """The captured steps of one generation (one prompt's caches), keyed by step and shape."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.graphs: dict[tuple, _Captured] = {}
        self.pool = torch.cuda.graph_pool_handle() if enabled else None

    def run(self, name: str, fn: Callable, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``fn(**inputs)`` -> tuple of tensors, replayed from a graph when capture is on.
        The key is the step's name and its inputs' shapes: one capture per shape."""
        if not self.enabled:
            return fn(**inputs)
        key = (name, *((k, tuple(v.shape)) for k, v in sorted(inputs.items())))
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = _Captured(fn, inputs, self.pool)
        return graph(inputs)

    def clear(self) -> None:
        self.graphs.clear()
