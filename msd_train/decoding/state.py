"""The decoder's state: what one generation carries from cycle to cycle, what a benchmark
keeps from prompt to prompt, and what a generation reports.

Ownership. A ``Workspace`` owns the caches' buffers and the steps captured over them (a
benchmark keeps one across prompts); the ``DecodeState`` of one generation owns the host
bookkeeping (tokens, the pending features) and the drafter, and hands the drafter what it
reads (``Pending``); the target cache owns the committed length m.

Indexing. The committed sequence is ``x_0 .. x_m``: the prompt then the new tokens. The
target's KV cache holds ``x_0 .. x_{m-1}`` at slots ``[0, m)``; the root of the next tree
is ``x_m``. The features the last verification produced wait in ``pending_hidden``, their
tokens (the root last) in ``pending_tokens``, on the device.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from msd_train.decoding.cache import PositionCache
from msd_train.decoding.drafter import Drafter, Pending
from msd_train.decoding.graphs import StepGraphs


class Workspace:
    """What decoding keeps from one prompt to the next: the caches' fixed-capacity buffers
    (``"target"``, ``"head"``) and the steps captured over them. A benchmark gives every
    ``generate`` the same workspace, so each step is captured once per shape for the whole
    run (gpt-fast's ``setup_caches`` once, then the same compiled step for every prompt);
    buffers are reallocated, and the graphs dropped, only when a prompt needs more
    positions than they have (doubling, so that happens a few times at most)."""

    def __init__(self, graphs: StepGraphs | None = None):
        self.graphs = graphs if graphs is not None else StepGraphs()
        self.caches: dict[str, PositionCache] = {}

    def load(self, name: str, cache, capacity: int) -> PositionCache:
        """``cache`` (a prefill's ``DynamicCache``) copied into the buffers kept as ``name``,
        of at least ``capacity`` positions."""
        kept = self.caches.get(name)
        if kept is not None and kept.capacity >= capacity and kept.load(cache):
            return kept
        if kept is not None:  # the graphs hold the old buffers
            self.graphs.clear()
            capacity = max(capacity, 2 * kept.capacity)
        self.caches[name] = PositionCache.from_cache(cache, capacity)
        return self.caches[name]

    def reserve(self, slots: dict[str, int]) -> None:
        """Make room for ``slots[name]`` entries in each cache named (host arithmetic, no device read)."""
        grew = False
        for name, n in slots.items():
            grew |= self.caches[name].grow(n)
        if grew:
            self.graphs.clear()

    def clone(self) -> Workspace:
        """Copies of the caches, and no graphs yet (graphs write into their own workspace's caches)."""
        out = Workspace(self.graphs.fresh())
        out.caches = {name: cache.clone() for name, cache in self.caches.items()}
        return out


@dataclass
class DecodeState:
    """Everything carried from one cycle to the next. The state owns the drafter; the
    caches' buffers and the captured steps belong to the workspace."""

    workspace: Workspace
    target_cache: PositionCache  # x_0 .. x_{m-1} at [0, m): the workspace's "target" buffers
    prompt_len: int
    rope_deltas: torch.Tensor | None  # M-RoPE: text position minus token index
    next_logits: torch.Tensor  # (V,) target logits after the prompt (the first new token)
    pending_hidden: torch.Tensor  # (n, H) target features h_{m-n} .. h_{m-1} not yet fed to the head
    #: (n,) on the device: the tokens x_{m-n+1} .. x_m paired with ``pending_hidden`` (the root
    #: last). Kept on the device so that no cycle copies host tokens back (a pageable
    #: host-to-device copy synchronises the stream); None: read from ``tokens``
    pending_tokens: torch.Tensor | None = None
    drafter: Drafter | None = None
    tokens: list[int] = field(default_factory=list)  # new tokens; tokens[-1] is the root x_m
    #: the target layers whose inputs the head reads (``DraftHead.feature_layers``); None: the
    #: last layer's post-norm output. ``pending_hidden`` holds those features.
    feature_layers: list[int] | None = None
    #: the fewest rows a target forward of this generation runs (``plain_rows``): a
    #: one-node verification is padded to it as the plain step is, so both round alike
    min_rows: int = 1
    #: the last verification's accepted path (tree nodes, root first) and the target's logits
    #: (N, V) after each of its tree's nodes; None before the first
    verified: tuple[list[int], torch.Tensor] | None = None

    @property
    def cache_len(self) -> int:
        """m, the committed length: the target cache's (its one owner)."""
        return self.target_cache.length

    def pending(self) -> Pending:
        """What the drafter reads next: the pending pairs, the root's index and what the last
        verification said."""
        tokens = self.pending_tokens
        if tokens is None or tokens.shape[0] != self.pending_hidden.shape[0]:  # a state prepared by hand
            tokens = torch.as_tensor(self.tokens[-self.pending_hidden.shape[0]:], device=self.pending_hidden.device)
        return Pending(self.pending_hidden, tokens, self.cache_len, self.verified)

    def clone(self) -> DecodeState:
        """An independent copy (caches included), e.g. to decode one prompt many times."""
        out = copy.copy(self)
        out.workspace = self.workspace.clone()
        out.target_cache = out.workspace.caches["target"]
        out.drafter = self.drafter.clone(out.workspace) if self.drafter is not None else None
        out.tokens = list(self.tokens)
        return out

    def reserve(self, slots: int) -> None:
        """Make room for ``slots`` more cache entries (host arithmetic, no device read)."""
        need = {"target": self.cache_len + slots}
        if self.drafter is not None:
            need["head"] = self.drafter.cache.length + slots
        self.workspace.reserve(need)


@dataclass
class CycleStats:
    accepted: int  # draft tokens accepted (before any stop truncation)
    tried: int  # draft positions tested: accepted, plus one if the deepest accepted node had children
    committed: int  # tokens this cycle added to the output (after stop truncation)
    tree_size: int  # nodes verified, root included
    #: seconds, written by an observer that times the loop (``msd_train.evaluation.timing``); 0 otherwise
    t_draft: float = 0.0
    t_verify: float = 0.0
    t_accept: float = 0.0  # acceptance + cache bookkeeping + stop check


@dataclass
class Generation:
    tokens: list[int]
    text: str
    stop_reason: str  # eos | stop_string | max_new_tokens
    prompt_len: int
    #: seconds, written by an observer that times the generation (``msd_train.evaluation.timing``); 0 otherwise
    t_prefill: float = 0.0  # target (and head) prefill, up to the target's logits for the first token
    t_total: float = 0.0  # seconds, everything from the prompt to the last token, graph capture excluded
    t_capture: float = 0.0  # seconds spent capturing graphs (once per shape; 0 when all were reused)
    cycles: list[CycleStats] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Tokens per verification forward, bonus included, before stop truncation."""
        if not self.cycles:
            return 1.0
        return sum(c.accepted + 1 for c in self.cycles) / len(self.cycles)

    @property
    def target_forwards(self) -> int:
        return 1 + len(self.cycles)  # prefill + verifications
