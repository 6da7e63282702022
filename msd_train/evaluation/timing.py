"""Timing the decoder from outside: the loop is the decoder's, the clock is evaluation's.

``generate`` and ``decode`` call an ``observe(phase)`` callable at each phase boundary
(``"prefill"`` once the prompt is read, then per cycle ``"cycle"``, ``"draft"``,
``"verify"``, ``"accept"``; ``msd_train.decoding.speculative``). A ``PhaseTimer`` is such
a callable: it marks time there without synchronising (CUDA events on a GPU, read once at
the end; ``perf_counter`` on a CPU), and afterwards writes the seconds into the
generation it observed (``Generation.t_prefill``, ``t_total``, ``t_capture`` and each
cycle's ``t_draft``, ``t_verify``, ``t_accept``). Graph capture is not decoding: the
seconds the workspace's graphs spent capturing inside a phase (or the generation) are
taken off it and reported as ``t_capture``.
"""

from __future__ import annotations

import time

import torch

from msd_train.decoding import DecodeConfig, DecodeState, Generation, Workspace, decode, generate
from msd_train.decoding.graphs import StepGraphs
from msd_train.targets import Encoded, TargetProtocol


class Clock:
    """Time marks without synchronising: CUDA events on a GPU (read once, at the end),
    ``perf_counter`` on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> int:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())
        return len(self.marks) - 1

    def seconds(self, a: int, b: int) -> float:
        """Seconds between two marks (on CUDA, waits for the later one to complete)."""
        if self.cuda:
            self.marks[b].synchronize()
            return self.marks[a].elapsed_time(self.marks[b]) / 1000
        return self.marks[b] - self.marks[a]


class PhaseTimer:
    """An observer of one generation: ``timer("start")`` before it, ``observe=timer`` to the
    decoder, ``timer("end")`` after it, then ``timer.write(generation)``."""

    def __init__(self, device: torch.device, graphs: StepGraphs):
        self.clock, self.graphs = Clock(device), graphs
        self.events: dict[str, tuple[int, float]] = {}  # "start", "prefill", "end": (mark, capture seconds)
        self.cycles: list[dict[str, tuple[int, float]]] = []  # per cycle: "cycle", "draft", "verify", "accept"

    def __call__(self, phase: str) -> None:
        mark = (self.clock.mark(), self.graphs.capture_s)
        if phase == "cycle":
            self.cycles.append({})
        if phase in ("cycle", "draft", "verify", "accept"):
            self.cycles[-1][phase] = mark
        else:
            self.events[phase] = mark

    def _seconds(self, a: tuple[int, float], b: tuple[int, float]) -> float:
        """Seconds from mark a to mark b, less the graph capture between them."""
        return self.clock.seconds(a[0], b[0]) - (b[1] - a[1])

    def write(self, out: Generation) -> Generation:
        """The observed seconds into ``out`` (read now: no synchronisation during the loop)."""
        start, end = self.events["start"], self.events["end"]
        out.t_capture = end[1] - start[1]
        out.t_total = self._seconds(start, end)
        if "prefill" in self.events:
            out.t_prefill = self.clock.seconds(start[0], self.events["prefill"][0])
        for c, marks in zip(out.cycles, self.cycles):
            c.t_draft = self._seconds(marks["cycle"], marks["draft"])
            c.t_verify = self._seconds(marks["draft"], marks["verify"])
            c.t_accept = self.clock.seconds(marks["verify"][0], marks["accept"][0])
        return out


def timed_generate(target: TargetProtocol, draft, prompt: Encoded, config: DecodeConfig,
                   generator: torch.Generator | None = None, captions: list[str] | None = None,
                   workspace: Workspace | None = None) -> Generation:
    """``generate``, with its prefill, total, capture and per-phase seconds."""
    workspace = workspace if workspace is not None else Workspace()
    timer = PhaseTimer(target.device, workspace.graphs)
    timer("start")
    out = generate(target, draft, prompt, config, generator, captions, workspace, observe=timer)
    timer("end")
    return timer.write(out)


def timed_decode(target: TargetProtocol, state: DecodeState, config: DecodeConfig,
                 generator: torch.Generator | None = None) -> Generation:
    """``decode`` of a prefilled state, with its total, capture and per-phase seconds."""
    timer = PhaseTimer(target.device, state.workspace.graphs)
    timer("start")
    out = decode(target, state, config, generator, observe=timer)
    timer("end")
    return timer.write(out)
