"""Captured forwards: the verify forward, the head's draft step and the plain one-token
step replayed from CUDA graphs.

Every step the decoder runs has a shape fixed by the decoding settings (the tree is padded
to ``total_tokens``, the frontier to ``top_k``; masks span the cache's whole capacity),
and everything that changes from one call to the next (tokens, positions, the additive
mask, the cache slots written) is an input tensor. So each step can be captured once per
shape and replayed: ``StepGraphs.run(name, fn, **inputs)`` copies the inputs into the
graph's static buffers, replays, and returns copies of the outputs (callers may keep them
across replays). The KV caches are written in place at the slots given as an input, so
they need no copy; the graphs hold the caches' buffers, so they live as long as those
(a benchmark keeps both across prompts: ``speculative.Workspace``) and are dropped when a
cache is reallocated (``clear``).

A step whose capture or first replay fails runs eagerly from then on, after one warning
(the step, its shapes, the error): graphs are an optimisation, never a reason for a run
to stop.

Backend: ``CudaCapture`` (CUDA graphs; ``DecodeConfig.cuda_graphs``: "auto" = on for CUDA
targets, off on CPU). A backend is any callable ``(fn, inputs) -> (static outputs, replay)``
with a ``device_type`` and a ``synchronize``: the tests give ``lab.capture.TracedCapture``,
a CPU emulation that freezes each step as CUDA capture does, so that the same bookkeeping
runs in CI. Without capture ``run`` just calls the step: the eager path is the same code.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


def resolve(setting, device: torch.device, backend_device: str = "cuda") -> bool:
    """``decoding.cuda_graphs`` (auto | true | false) for a target on ``device``, captured by a
    backend that runs on ``backend_device``."""
    if setting in ("auto", None):
        return device.type == backend_device
    if isinstance(setting, str):
        if setting.lower() not in ("true", "false", "on", "off"):
            raise ValueError(f"decoding.cuda_graphs must be auto, true or false, got {setting!r}")
        setting = setting.lower() in ("true", "on")
    if setting and device.type != backend_device:
        raise ValueError(f"decoding.cuda_graphs=true needs a CUDA target, this one is on {device}; "
                         "use decoding.cuda_graphs=auto (off on CPU)")
    return bool(setting)


class CudaCapture:
    """Capture with CUDA graphs, all of them in one memory pool."""

    device_type = "cuda"

    def __init__(self):
        self.pool = None

    def __call__(self, fn: Callable, inputs: dict[str, torch.Tensor]) -> tuple[tuple, Callable]:
        """Capture ``fn(**inputs)``; returns its static outputs and the replay."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: lazy inits (cuBLAS handles, workspaces) stay out of the graph
            for _ in range(2):
                fn(**inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = fn(**inputs)
        return outputs, graph.replay

    @staticmethod
    def synchronize() -> None:
        torch.cuda.synchronize()


class _Captured:
    """One captured step: static input buffers, the backend's static outputs and replay."""

    def __init__(self, capture, fn: Callable, inputs: dict[str, torch.Tensor]):
        self.inputs = {k: v.clone() for k, v in inputs.items()}
        self.outputs, self.replay = capture(fn, self.inputs)

    def __call__(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        for k, v in inputs.items():
            self.inputs[k].copy_(v)
        self.replay()
        return tuple(o.clone() for o in self.outputs)


class StepGraphs:
    """The captured steps over one set of caches, keyed by step and shape. Off until
    ``configure`` turns capture on; ``backend`` is ``CudaCapture`` unless a test gives
    another (``lab.capture.TracedCapture``)."""

    def __init__(self, backend=None):
        self.backend = backend if backend is not None else CudaCapture()
        self.enabled = False
        self.graphs: dict[tuple, _Captured] = {}
        self.eager: set[str] = set()  # steps whose capture failed: they run eagerly
        self.captures = 0  # graphs captured so far (a reused graph is not counted again)
        self.capture_s = 0.0  # seconds spent capturing (warm-ups and first replays included)

    def configure(self, setting, device: torch.device) -> None:
        """Capture on or off as ``decoding.cuda_graphs`` asks for a target on ``device``."""
        self.enabled = resolve(setting, device, self.backend.device_type)

    def fresh(self) -> StepGraphs:
        """Empty graphs with the same backend kind and setting (for other caches)."""
        out = StepGraphs(type(self.backend)())
        out.enabled = self.enabled
        return out

    def run(self, name: str, fn: Callable, **inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``fn(**inputs)`` -> tuple of tensors, replayed from a graph when capture is on.
        The key is the step's name and its inputs' shapes: one capture per shape."""
        if not self.enabled or name in self.eager:
            return fn(**inputs)
        key = (name, *((k, tuple(v.shape)) for k, v in sorted(inputs.items())))
        graph = self.graphs.get(key)
        if graph is not None:
            return graph(inputs)
        start = time.perf_counter()
        try:
            graph = _Captured(self.backend, fn, inputs)
            out = graph(inputs)  # the first replay: an error here is a capture error too
            self.backend.synchronize()
        except Exception as e:  # noqa: BLE001 - any failure of an optimisation falls back to the exact path
            self.capture_s += time.perf_counter() - start
            self.eager.add(name)
            shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in sorted(inputs.items()))
            log.warning("decoding.cuda_graphs: capturing the %s step (%s) failed (%s: %s); that step runs "
                        "eagerly from now on, with the same output (decoding.cuda_graphs=false turns capture off)",
                        name, shapes, type(e).__name__, e)
            return fn(**inputs)
        self.capture_s += time.perf_counter() - start
        self.graphs[key] = graph
        self.captures += 1
        return out

    def clear(self) -> None:
        self.graphs.clear()
