"""Lossless speculative decoding of a multimodal target with an MSD draft head (batch 1).

One cycle, each phase one function below, all over device tensors::

    tree    = drafter.draft_block(...)        the head proposes a tree (or chain) of tokens
    logits  = verify(...)                     one target forward over the tree
    acc     = accept(tree, logits, ...)       greedy: ``accept_greedy`` on the device (the
                                              longest matching path), then ``read_acceptance``,
                                              the cycle's one device-to-host transfer
    commit(...)                               caches keep exactly the accepted path

``speculate`` is that loop and nothing else; ``decode`` runs it, under a ``PhaseTimer``
when ``DecodeConfig.timing`` asks for per-phase times.

Stop checks run on the host from that one transfer. Sampling acceptance
(``accept_sampling``) keeps its exact rule over the host: it reads the tree's tokens,
parents and validity (3 transfers), then one ``u < ratio`` and one residual-mass test per
sibling it tries, and the final draw (1), and the commit reads the accepted tokens and
whether the last node has children (2): at most 6 + 2 * (siblings tried) per cycle.

Plain decoding (the baseline) is ``decode_plain``: a one-token loop over the same static
cache, one transfer per token.

Ownership. A ``Workspace`` owns the caches' buffers and the steps captured over them (a
benchmark keeps one across prompts); the ``DecodeState`` of one generation owns the host
bookkeeping (tokens, the pending features) and the drafter, and hands the drafter what it
reads (``Pending``); the target cache owns the committed length m. Each forward is told
where to write (``cache.at(index)``), as gpt-fast's steps take ``input_pos``.

Indexing. The committed sequence is ``x_0 .. x_m``: the prompt then the new tokens. The
target's KV cache holds ``x_0 .. x_{m-1}`` at slots ``[0, m)``; the root of the next tree
is ``x_m``; tree nodes are written at ``[m, m + N)`` and the accepted path moved to
``[m, m + a + 1)``. Draft position ``t`` pairs the target feature ``h_t`` with the
embedding ``e_{t+1}`` and predicts ``h_{t+1}``; its position id is the target's position
of ``x_t``. The features the last verification produced wait in ``pending_hidden``, their
tokens (the root last) in ``pending_tokens``, on the device.
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from msd_train.decoding.cache import PositionCache, attention_width, key_mask
from msd_train.decoding.config import METHODS, DecodeConfig, build_drafter, use_draft_vocabulary
from msd_train.decoding.drafter import HeadDrafter, Pending, PromptPass, draft_chain, draft_tree
from msd_train.decoding.graphs import StepGraphs
from msd_train.decoding.sampling import logits_to_probs, sample
from msd_train.decoding.stopping import StopCriteria, find_stop
from msd_train.decoding.tree import Tree

__all__ = ["METHODS", "DecodeConfig", "draft_chain", "draft_tree"]

#: caches are sized in multiples of this many positions: prompts of similar length share
#: a capacity, hence the shapes of their captured steps
CAPACITY_STEP = 256


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
    drafter: HeadDrafter | None = None
    tokens: list[int] = field(default_factory=list)  # new tokens; tokens[-1] is the root x_m
    #: the target layers whose inputs the head reads (``DraftHead.feature_layers``); None: the
    #: last layer's post-norm output. ``pending_hidden`` holds those features.
    feature_layers: list[int] | None = None
    #: the fewest rows a target forward of this generation runs (``plain_rows``): a
    #: one-node verification is padded to it as the plain step is, so both round alike
    min_rows: int = 1

    @property
    def cache_len(self) -> int:
        """m, the committed length: the target cache's (its one owner)."""
        return self.target_cache.length

    def pending(self) -> Pending:
        """What the drafter reads next: the pending pairs and the root's index."""
        tokens = self.pending_tokens
        if tokens is None or tokens.shape[0] != self.pending_hidden.shape[0]:  # a state prepared by hand
            tokens = torch.as_tensor(self.tokens[-self.pending_hidden.shape[0]:], device=self.pending_hidden.device)
        return Pending(self.pending_hidden, tokens, self.cache_len)

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
    t_draft: float = 0.0  # seconds; 0 unless DecodeConfig.timing
    t_verify: float = 0.0
    t_accept: float = 0.0  # acceptance + cache bookkeeping + stop check


@dataclass
class Generation:
    tokens: list[int]
    text: str
    stop_reason: str  # eos | stop_string | max_new_tokens
    prompt_len: int
    t_prefill: float = 0.0  # seconds, target (and head) prefill and first token
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


class Clock:
    """Time marks without synchronising: CUDA events on a GPU (read once, at the end),
    ``perf_counter`` on a CPU. ``enabled=False`` makes every mark free."""

    def __init__(self, device: torch.device, enabled: bool = True):
        self.cuda = device.type == "cuda"
        self.enabled = enabled
        self.marks: list = []

    def mark(self) -> int:
        if not self.enabled:
            return -1
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())
        return len(self.marks) - 1

    def seconds(self, a: int, b: int) -> float:
        """Seconds between two marks (on CUDA, waits for the later one to complete)."""
        if a < 0 or b < 0:
            return 0.0
        if self.cuda:
            self.marks[b].synchronize()
            return self.marks[a].elapsed_time(self.marks[b]) / 1000
        return self.marks[b] - self.marks[a]


# ----- prefill --------------------------------------------------------------------------


@torch.inference_mode()
def prefill_target(target, prompt, capacity: int | None = None, workspace: Workspace | None = None,
                   feature_layers: list[int] | None = None) -> tuple[DecodeState, PromptPass]:
    """The target's forward over the prompt (images included), copied into the workspace's
    static cache (a new workspace when none is given) of at least ``capacity`` slots.
    Returns the state and the prompt pass a drafter's prefill reads; ``feature_layers``:
    the head's (``DraftHead.feature_layers``), kept for every verification."""
    device = target.device
    ids = prompt.input_ids.to(device)[None]
    pixel = {k: v.to(device) for k, v in (prompt.pixel or {}).items()}
    embeds, extras = target.prompt_inputs(ids, pixel)  # extras: what a family adds (Qwen3-VL's deepstack)
    pos, deltas = target.position_ids(ids, None, pixel)
    hidden, cache, feats = _run_target(target, embeds, pos, None, None, feature_layers, extras)
    length = ids.shape[1]
    workspace = workspace if workspace is not None else Workspace()
    state = DecodeState(
        workspace, workspace.load("target", cache, capacity or length + 128), prompt_len=length,
        rope_deltas=deltas, next_logits=target.lm_head(hidden[0, -1]), pending_hidden=feats[0, -1:],
        feature_layers=feature_layers,
    )
    return state, PromptPass(ids, embeds, hidden, pos, ids == target.image_token_id, prompt.pixel or {}, deltas,
                             None if feature_layers is None else feats)


@torch.inference_mode()
def prefill(target, draft, prompt, capacity: int | None = None, drafter: HeadDrafter | None = None,
            workspace: Workspace | None = None) -> DecodeState:
    """Target forward over the prompt and the drafter's prefill (a ``HeadDrafter`` over
    ``draft`` unless a ``drafter`` is given; none when both are None), their caches in
    ``workspace``'s buffers (a new workspace when none is given)."""
    state_drafter = drafter if drafter is not None else (HeadDrafter(draft) if draft is not None else None)
    layers = state_drafter.draft.feature_layers if state_drafter is not None else None
    state, p = prefill_target(target, prompt, capacity, workspace, layers)
    state.drafter = state_drafter
    if state.drafter is not None:
        state.drafter.prefill(target, p, state.workspace, state.target_cache.capacity)
    return state


def _run_target(target, embeds, pos, mask, cache, feature_layers, extras=None):
    """(post-norm hidden, cache, the head's features) of a cached target forward."""
    if feature_layers is None:  # the last layer's output is the head's feature
        hidden, cache = target.run_language_model(embeds, pos, mask, cache, use_cache=True, extras=extras)
        return hidden, cache, hidden
    return target.run_for_head(embeds, pos, mask, cache, use_cache=True, layers=feature_layers, extras=extras)


# ----- verification ---------------------------------------------------------------------


@torch.inference_mode()
def verify(target, state: DecodeState, tree: Tree) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over all tree nodes, written at cache slots ``[m, m + N)``: each
    sees the cached prefix and its ancestors, at position (root position + depth).
    Returns logits (N, V) and the head's features (N, H or k*H); ``commit`` keeps the path."""
    m, n = state.cache_len, len(tree)
    cache = state.target_cache
    seen = (torch.ones(n, n, dtype=torch.bool, device=target.device).tril() if tree.is_chain
            else tree.ancestor_mask())
    pick, seen = pad_rows(seen, state.min_rows)  # a lone root (a chain cut to no draft) runs as a plain step does
    rows = len(pick)
    embeds = target.embed_tokens(tree.tokens[pick])[None]
    pos = target.continue_positions(m, 1, state.rope_deltas) + tree.depths[pick]
    width = attention_width(state.workspace.graphs.enabled, cache.capacity, m + rows)
    mask = key_mask(m, width, seen, target.dtype)
    logits, feats = state.workspace.graphs.run(
        "verify", _target_step(target, cache, state.feature_layers), embeds=embeds, pos=pos, mask=mask,
        write_index=torch.arange(m, m + rows, device=target.device))
    return (logits, feats) if rows == n else (logits[:n], feats[:n])


def pad_rows(seen: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A block of n nodes (``seen``: (n, n), which nodes each one attends to) widened to at
    least ``rows`` forward rows (``plain_rows``): ``pick``, the node each row computes (the
    last node repeated), and the widened ``seen``, each repeat seeing only itself. Repeats
    are written at the free slots after the block and never read: they only make the
    target's products multi-row, so that row 0 rounds as a row of a verification does."""
    n = seen.shape[0]
    pick = torch.arange(max(n, rows), device=seen.device).clamp(max=n - 1)
    if len(pick) == n:
        return pick, seen
    return pick, torch.block_diag(seen, torch.eye(len(pick) - n, dtype=torch.bool, device=seen.device))


def _target_step(target, cache: PositionCache, feature_layers: list[int] | None = None):
    """The target forward as a function of tensors only (what a captured graph replays):
    logits (T, V) and the head's features (T, H or k*H) of T tokens written at ``write_index``."""
    def step(embeds, pos, mask, write_index):
        hidden, _, feats = _run_target(target, embeds, pos, mask, cache.at(write_index, mask.shape[-1]),
                                       feature_layers)
        return target.lm_head(hidden[0]), feats[0]

    return step


# ----- acceptance -----------------------------------------------------------------------


@dataclass
class Acceptance:
    """A cycle's outcome, on the host."""

    path: list[int]  # accepted nodes, root first
    tokens: list[int]  # the accepted draft tokens, then the bonus token
    tried: int  # draft positions tested
    nodes: torch.Tensor  # (D + 1,) device: the path's nodes, padded (commit moves these)
    device_tokens: torch.Tensor  # (len(tokens),) device: the same tokens, for the next block


def accept_greedy(tree: Tree, logits: torch.Tensor) -> torch.Tensor:
    """On the device: the longest root-to-node path whose every token is the target's
    argmax after its parent; the target's argmax after that path is the bonus token.

    A node is acceptable when it and all its ancestors match; siblings hold distinct
    tokens, so at most one node per depth is acceptable and the deepest one ends the
    path. Returns one packet ``[bonus, has_children, path nodes (D+1, -1 padded),
    path tokens (D+1)]`` for ``read_acceptance``.
    """
    best = logits.argmax(-1)  # the target's token after each node
    match = tree.tokens == best[tree.parents.clamp_min(0)]
    if tree.valid is not None:
        match &= tree.valid
    match[0] = True  # the root is committed already
    paths = tree.paths()  # padding (-1) below a node's depth reads the root's match: True
    ok = match[paths.clamp_min(0)].all(-1)
    leaf = torch.where(ok, tree.depths, -1).argmax()
    nodes = paths[leaf]
    has_children = tree.has_children(leaf)
    tokens = tree.tokens[nodes.clamp_min(0)]
    return torch.cat([best[leaf].view(1), has_children.long().view(1), nodes, tokens])


def read_acceptance(tree: Tree, packet: torch.Tensor) -> Acceptance:
    """The one device-to-host transfer of a greedy cycle."""
    values = packet.tolist()
    d = (len(values) - 2) // 2
    nodes, tokens = values[2 : 2 + d], values[2 + d :]
    a = sum(x >= 0 for x in nodes) - 1
    on_device = torch.cat([packet[2 + d + 1 : 2 + d + 1 + a], packet[:1]])  # accepted tokens, bonus
    return Acceptance(nodes[: a + 1], tokens[1 : a + 1] + [values[0]], a + values[1], packet[2 : 2 + d], on_device)


def accept_sampling(tree: Tree, target_probs: torch.Tensor,
                    generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Recursive rejection sampling over siblings; the output is distributed exactly as
    the (warped) target.

    At a node with target distribution p, try its children x in order: accept x with
    probability min(1, p(x)/q(x)), else p <- norm(max(p - q, 0)) and try the next one;
    if none is accepted the bonus is drawn from what remains of p. q is the distribution
    x was sampled from, or a point mass on x for deterministic (top-k) proposals, which
    makes the rule "accept x w.p. p(x), else remove x from p": lossless for any tree
    the head builds, however its shape was chosen.
    """
    tokens, kids = tree.tokens.tolist(), tree.children()
    path = [0]
    while True:
        p = target_probs[path[-1]].float()
        accepted = None
        for c in kids[path[-1]]:
            x = tokens[c]
            if tree.draft_probs is None:
                ratio = p[x]
                residual = p.clone()
                residual[x] = 0
            else:
                q = tree.draft_probs[c].float()
                ratio = p[x] / q[x]
                residual = (p - q).clamp_min(0)
            u = torch.rand((), generator=generator, device=p.device)
            if bool(u < ratio):
                accepted = c
                break
            mass = residual.sum()
            # mass is 0 only when p == q, where x is always accepted; guard round-off
            p = residual / mass if bool(mass > 0) else p
        if accepted is None:
            return path, int(sample(p, generator))
        path.append(accepted)


def path_acceptance(tree: Tree, path: list[int], bonus: int) -> Acceptance:
    """The ``Acceptance`` of a path decided on the host (sampling's; a benchmark's forced one)."""
    d = tree.depth_bound
    tokens = tree.tokens[path[1:]].tolist() + [bonus]
    tried = len(path) - 1 + int(bool(tree.has_children(path[-1])))
    device = tree.tokens.device
    nodes = torch.as_tensor(path + [-1] * (d + 1 - len(path)), device=device)
    return Acceptance(path, tokens, tried, nodes, torch.as_tensor(tokens, device=device))


def accept(tree: Tree, logits: torch.Tensor, sampling, generator: torch.Generator | None = None) -> Acceptance:
    """The acceptance rule of a cycle, over the target's ``logits`` (N, V) after each tree
    node: greedy (``accept_greedy`` on the device, then its one host read) or, when
    sampling, recursive rejection sampling (``accept_sampling``) over the warped target."""
    if sampling.greedy:
        return read_acceptance(tree, accept_greedy(tree, logits))
    path, bonus = accept_sampling(tree, logits_to_probs(logits, sampling), generator)
    return path_acceptance(tree, path, bonus)


# ----- cache update ---------------------------------------------------------------------


@torch.inference_mode()
def commit(state: DecodeState, acc: Acceptance, hidden: torch.Tensor) -> list[int]:
    """Commit the accepted path and the bonus token.

    The target cache keeps the root and the accepted nodes, moved into place by one
    gather (fixed shape: the padded path); their features become the head's pending
    inputs. The head's cache holds only committed positions (tree entries lie beyond its
    length and are overwritten). Returns the new tokens."""
    nodes = acc.nodes.clamp_min(0)  # padding moves the root again, past the new length
    state.target_cache.keep(state.cache_len, nodes)
    n = len(acc.path)
    state.target_cache.length += n
    state.tokens.extend(acc.tokens)
    state.pending_hidden = hidden[nodes[:n]]
    state.pending_tokens = acc.device_tokens
    return acc.tokens


# ----- the loops ------------------------------------------------------------------------


def _next_token(logits: torch.Tensor, sampling, generator) -> torch.Tensor:
    """(1,) on the device: the argmax, or a draw from the warped distribution."""
    if sampling.greedy:
        return logits.argmax(-1).view(1)
    return sample(logits_to_probs(logits, sampling), generator).view(1)


def _first_token(state: DecodeState, sampling, generator) -> None:
    """The token after the prompt: one host read, and the device copy kept for drafting."""
    token = _next_token(state.next_logits, sampling, generator)
    state.tokens.append(int(token))
    state.pending_tokens = token


def _criteria(target, config: DecodeConfig) -> StopCriteria:
    eos = target.eos_token_ids if config.eos_token_ids is None else config.eos_token_ids
    return StopCriteria(config.max_new_tokens, tuple(eos), config.stop_strings)


def plain_rows(setting: str | int, target) -> int:
    """Rows of the plain step's target forward: 1, or 2 so that its products round as
    verification's do. ``auto``: 2 for a bf16/fp16 target on a CPU, where oneDNN rounds a
    one-row product differently from a row of a multi-row one (any two or more rows round
    alike: benchmarks/real_lm/results/matmul_rows.json) and two rows cost what one does; else 1
    (fp32's rounding almost never flips a greedy choice, and MKL's two-row product costs
    twice a one-row one)."""
    if setting != "auto":
        return int(setting)
    reduced = target.dtype in (torch.bfloat16, torch.float16)
    return 2 if reduced and target.device.type == "cpu" else 1


@torch.inference_mode()
def decode_plain(target, state: DecodeState, config: DecodeConfig, generator: torch.Generator | None = None
) -> Generation:
    """Plain decoding: one token per target forward over the same static cache, one
    transfer (the token) per step."""
    criteria, tokenizer = _criteria(target, config), getattr(target, "tokenizer", None)
    sampling = config.sampling
    _first_token(state, sampling, generator)
    stop = find_stop(state.tokens, 0, criteria, tokenizer)
    cycles = []
    state.min_rows = plain_rows(config.plain_rows, target)
    # the step is a one-node block: row 0 computes it, any further row repeats it (pad_rows)
    pick, seen = pad_rows(torch.ones(1, 1, dtype=torch.bool, device=target.device), state.min_rows)
    rows, depths = len(pick), torch.zeros(len(pick), dtype=torch.long, device=target.device)
    graphs = state.workspace.graphs
    graphs.configure(config.cuda_graphs, target.device)
    while stop is None:
        state.reserve(rows + 1)
        cache, m = state.target_cache, state.cache_len
        logits, _ = graphs.run(
            "plain", _target_step(target, cache), embeds=target.embed_tokens(state.pending_tokens[pick])[None],
            pos=target.continue_positions(m, 1, state.rope_deltas) + depths,
            mask=key_mask(m, attention_width(graphs.enabled, cache.capacity, m + rows), seen, target.dtype),
            write_index=torch.arange(m, m + rows, device=target.device))
        cache.length = m + 1
        state.pending_tokens = _next_token(logits[0], sampling, generator)
        state.tokens.append(int(state.pending_tokens))  # the step's one host read
        stop = find_stop(state.tokens, len(state.tokens) - 1, criteria, tokenizer)
        cycles.append(CycleStats(0, 0, 1, 1))
    del state.tokens[stop[0]:]
    text = tokenizer.decode(state.tokens, skip_special_tokens=True) if tokenizer is not None else ""
    return Generation(list(state.tokens), text, stop[1], state.prompt_len, cycles=cycles)


@torch.inference_mode()
def decode(target, state: DecodeState, config: DecodeConfig, generator: torch.Generator | None = None) -> Generation:
    """Generate from a prefilled state until EOS, a stop string or ``max_new_tokens`` (the
    state's drafter drafts; ``method="ar"`` is plain decoding). With ``config.timing`` the
    cycle's phases run under a ``PhaseTimer``, which writes their times into the cycles."""
    if config.method == "ar":
        return decode_plain(target, state, config, generator)
    if state.drafter is None:
        raise ValueError(f"decoding.method={config.method} needs a draft head")
    state.min_rows = plain_rows(config.plain_rows, target)
    state.workspace.graphs.configure(config.cuda_graphs, target.device)
    if not config.timing:
        return speculate(target, state, config, generator)
    timer = PhaseTimer(target.device, state.workspace.graphs)
    out = speculate(target, state, config, generator, timer.phases)
    timer.write(out.cycles)
    return out


def speculate(target, state: DecodeState, config: DecodeConfig, generator: torch.Generator | None = None,
              phases: Phases | None = None) -> Generation:
    """The speculative loop, each cycle: draft a block, verify it in one target forward,
    accept (and commit) the longest path the target agrees with, until a stop."""
    phases = phases if phases is not None else PHASES
    criteria, tokenizer = _criteria(target, config), getattr(target, "tokenizer", None)
    _first_token(state, config.sampling, generator)
    stop = find_stop(state.tokens, 0, criteria, tokenizer)
    cycles = []
    while stop is None:
        state.reserve(config.block_size)
        tree = phases.draft(target, state, config, generator)
        logits, hidden = phases.verify(target, state, tree)
        acc, committed, stop = phases.accept_and_commit(target, state, tree, logits, hidden, config, generator,
                                                        criteria, tokenizer)
        cycles.append(CycleStats(len(acc.path) - 1, acc.tried, committed, len(tree)))
    text = tokenizer.decode(state.tokens, skip_special_tokens=True) if tokenizer is not None else ""
    return Generation(list(state.tokens), text, stop[1], state.prompt_len, cycles=cycles)


def accept_and_commit(target, state: DecodeState, tree: Tree, logits: torch.Tensor, hidden: torch.Tensor,
                      config: DecodeConfig, generator, criteria: StopCriteria, tokenizer
                      ) -> tuple[Acceptance, int, tuple | None]:
    """A verified tree's outcome: ``accept``, what the drafter records of it, ``commit``,
    and the stop check (the committed tokens cut at a stop). Returns the acceptance, the
    tokens committed and the stop (None: go on)."""
    drafter = state.drafter
    acc = accept(tree, logits, config.sampling, generator)
    drafter.record_verified(acc.path, logits, functools.partial(drafter.draft.logits, target=target))
    before = len(state.tokens)
    commit(state, acc, hidden)
    stop = find_stop(state.tokens, before, criteria, tokenizer)
    if stop is not None:
        del state.tokens[stop[0]:]
    return acc, len(state.tokens) - before, stop


def draft(target, state: DecodeState, config: DecodeConfig, generator=None) -> Tree:
    """The state's drafter proposes a block over what the last verification left."""
    return state.drafter.draft_block(target, state.pending(), config, generator)


@dataclass(frozen=True)
class Phases:
    """The phases of a cycle as ``speculate`` calls them; a ``PhaseTimer`` wraps each."""

    draft: Callable = draft
    verify: Callable = verify
    accept_and_commit: Callable = accept_and_commit


PHASES = Phases()


class PhaseTimer:
    """Times a cycle's phases around ``speculate`` without synchronising per phase (a
    ``Clock``: CUDA events read once at the end, ``perf_counter`` on a CPU). Graph capture
    inside a phase is not the phase's time: the seconds the workspace's graphs spent
    capturing in it are taken off."""

    def __init__(self, device: torch.device, graphs: StepGraphs):
        self.clock, self.graphs = Clock(device), graphs
        self.marks: list[list] = []  # per cycle: [mark before draft, after draft, after verify, after acceptance]
        self.captures: list[list[float]] = []  # per cycle: capture seconds in draft, in verify

        def draft(*args):
            self.marks.append([self.clock.mark()])
            before = self.graphs.capture_s
            out = PHASES.draft(*args)
            self.marks[-1].append(self.clock.mark())
            self.captures.append([self.graphs.capture_s - before])
            return out

        def verify_(*args):
            before = self.graphs.capture_s
            out = PHASES.verify(*args)
            self.marks[-1].append(self.clock.mark())
            self.captures[-1].append(self.graphs.capture_s - before)
            return out

        def accept_and_commit_(*args):
            out = PHASES.accept_and_commit(*args)
            self.marks[-1].append(self.clock.mark())
            return out

        self.phases = Phases(draft, verify_, accept_and_commit_)

    def write(self, cycles: list[CycleStats]) -> None:
        """Each cycle's phase times, read now (no sync per phase during the loop)."""
        for c, (t0, t1, t2, t3), (cd, cv) in zip(cycles, self.marks, self.captures):
            c.t_draft, c.t_verify = self.clock.seconds(t0, t1) - cd, self.clock.seconds(t1, t2) - cv
            c.t_accept = self.clock.seconds(t2, t3)


def generate(target, draft, prompt, config: DecodeConfig, generator: torch.Generator | None = None,
             captions: list[str] | None = None, workspace: Workspace | None = None) -> Generation:
    """Prefill ``prompt`` (an ``Encoded`` from ``target.encode_prompt``) and decode.

    ``config.method = "ar"`` is plain decoding of the target (the head is ignored).
    ``captions`` (one per image of the prompt) are for drafters that read them.
    Caches are sized for the whole generation up front, in ``workspace``'s buffers: pass
    the same workspace for every prompt of a benchmark and each step is captured once
    (``Generation.t_capture``: the seconds this call spent capturing, not in ``t_total``).
    """
    workspace = workspace if workspace is not None else Workspace()
    captured = workspace.graphs.capture_s
    clock = Clock(target.device)
    t0 = clock.mark()
    need = len(prompt.input_ids) + config.max_new_tokens + 2 * config.block_size
    capacity = -(-need // CAPACITY_STEP) * CAPACITY_STEP  # a few capacities, so a few shapes to capture
    if config.method != "ar":
        use_draft_vocabulary(draft, target, config.draft_vocab)
    state = prefill(target, None, prompt, capacity, drafter=build_drafter(draft, config, captions),
                    workspace=workspace)
    t1 = clock.mark()
    out = decode(target, state, config, generator)
    t2 = clock.mark()
    out.t_capture = workspace.graphs.capture_s - captured
    out.t_prefill, out.t_total = clock.seconds(t0, t1), clock.seconds(t0, t2) - out.t_capture
    return out
