"""A CPU stand-in for CUDA graph capture, for the decoder's tests: a backend of
``msd_train.decoding.graphs.StepGraphs`` (``StepGraphs(TracedCapture())``)."""

from __future__ import annotations

from collections.abc import Callable

import torch


class TracedCapture:
    """A CPU stand-in for CUDA graph capture (tests): the step is traced once into a graph
    of tensor operations (``make_fx`` over real tensors) and every replay runs that graph
    on the static input buffers, writing the static outputs.

    What a CUDA graph freezes is frozen here too: every Python value the step computed
    while it was captured (a number read from a tensor, a host-side length, a branch taken
    on a shape or a flag) is a constant of the trace, and a replay reads only the static
    inputs and the tensors the step closed over (caches, weights). So a step that would
    replay wrongly from a CUDA graph replays wrongly here, and the decoder's exactness
    tests catch it. ``captures`` counts the traces."""

    device_type = "cpu"

    def __init__(self):
        self.captures = 0

    def __call__(self, fn: Callable, inputs: dict[str, torch.Tensor]) -> tuple[tuple, Callable]:
        from torch.fx.experimental.proxy_tensor import make_fx

        names, static = list(inputs), list(inputs.values())
        traced = make_fx(lambda *args: fn(**dict(zip(names, args))))(*static)  # runs fn once: the warm-up
        self.captures += 1
        # like CUDA capture's outputs: buffers that hold nothing meaningful until a replay
        outputs = tuple(torch.full_like(o, float("nan")) if o.is_floating_point() else torch.empty_like(o)
                        for o in traced(*static))

        def replay():
            for out, value in zip(outputs, traced(*static)):
                out.copy_(value)

        return outputs, replay

    @staticmethod
    def synchronize() -> None:
        pass
