"""Lossless speculative decoding of a multimodal target with an MSD draft head (batch 1).

One cycle, each phase one function, all over device tensors::

    tree    = draft(...)                      the drafter proposes a tree (or chain) of tokens
    logits  = verify(...)                     one target forward over the tree
    acc     = accept(tree, logits, ...)       the acceptance rule (``acceptance.py``): greedy,
                                              on the device with one host read, or sampling
    commit(...)                               the caches keep exactly the accepted path

``speculate`` is that loop and nothing else; ``generate`` is ``prefill`` then ``decode``.
Whoever times the loop (the evaluation runner: ``msd_train.evaluation.timing``) passes an
``observe`` callable that the loop calls at each phase boundary; the decoder keeps no times.

Stop checks run on the host from the cycle's one transfer. Under sampling the acceptance
reads more (``acceptance.py``), and the commit reads the accepted tokens and whether the
last node has children (2).

Plain decoding (the baseline) is ``decode_plain``: a one-token loop over the same static
cache, one transfer per token.

Each forward is told where to write (``cache.at(index)``), as gpt-fast's steps take
``input_pos``. Indexing (``state.py``): tree nodes are written at ``[m, m + N)`` and the
accepted path moved to ``[m, m + a + 1)``. Draft position ``t`` pairs the target feature
``h_t`` with the embedding ``e_{t+1}`` and predicts ``h_{t+1}``; its position id is the
target's position of ``x_t``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from msd_train.decoding.acceptance import Acceptance, accept
from msd_train.decoding.build import build_drafter
from msd_train.decoding.cache import PositionCache, attention_width, key_mask
from msd_train.decoding.config import DecodeConfig
from msd_train.decoding.drafter import Drafter, PromptPass
from msd_train.decoding.sampling import logits_to_probs, sample
from msd_train.decoding.state import CycleStats, DecodeState, Generation, Workspace
from msd_train.decoding.stopping import StopCriteria, find_stop
from msd_train.decoding.tree import Tree
from msd_train.targets import Encoded, TargetProtocol

#: caches are sized in multiples of this many positions: prompts of similar length share
#: a capacity, hence the shapes of their captured steps
CAPACITY_STEP = 256

#: what ``generate`` and ``speculate`` call with each phase's name as it ends (see ``speculate``)
Observer = Callable[[str], None]


def _unobserved(phase: str) -> None:
    """The observer when nobody observes the loop."""


# ----- prefill --------------------------------------------------------------------------


@torch.inference_mode()
def prefill(target: TargetProtocol, drafter: Drafter | None, prompt: Encoded, capacity: int | None = None,
            workspace: Workspace | None = None) -> DecodeState:
    """The target's forward over the prompt (images included), copied into the workspace's
    static cache (a new workspace when none is given) of at least ``capacity`` slots, then
    the drafter's prefill over the same pass (``drafter`` None: plain decoding). The
    target's features are those the drafter's head reads (``DraftHead.feature_layers``),
    kept for every verification."""
    feature_layers = drafter.draft.feature_layers if drafter is not None else None
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
        drafter=drafter, feature_layers=feature_layers,
    )
    if drafter is not None:
        prompt_pass = PromptPass(ids, embeds, hidden, pos, ids == target.image_token_id, prompt.pixel or {}, deltas,
                                 None if feature_layers is None else feats)
        drafter.prefill(target, prompt_pass, workspace, state.target_cache.capacity)
    return state


def _run_target(target: TargetProtocol, embeds, pos, mask, cache, feature_layers, extras=None):
    """(post-norm hidden, cache, the head's features) of a cached target forward."""
    if feature_layers is None:  # the last layer's output is the head's feature
        hidden, cache = target.run_language_model(embeds, pos, mask, cache, use_cache=True, extras=extras)
        return hidden, cache, hidden
    return target.run_for_head(embeds, pos, mask, cache, use_cache=True, layers=feature_layers, extras=extras)


# ----- verification ---------------------------------------------------------------------


@torch.inference_mode()
def verify(target: TargetProtocol, state: DecodeState, tree: Tree) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over all tree nodes, written at cache slots ``[m, m + N)``: each
    sees the cached prefix and its ancestors (``key_mask`` over ``Tree.ancestor_mask``), at
    position (root position + depth).
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


def _target_step(target: TargetProtocol, cache: PositionCache, feature_layers: list[int] | None = None):
    """The target forward as a function of tensors only (what a captured graph replays):
    logits (T, V) and the head's features (T, H or k*H) of T tokens written at ``write_index``."""
    def step(embeds, pos, mask, write_index):
        hidden, _, feats = _run_target(target, embeds, pos, mask, cache.at(write_index, mask.shape[-1]),
                                       feature_layers)
        return target.lm_head(hidden[0]), feats[0]

    return step


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


def _criteria(target: TargetProtocol, config: DecodeConfig) -> StopCriteria:
    eos = target.eos_token_ids if config.eos_token_ids is None else config.eos_token_ids
    return StopCriteria(config.max_new_tokens, tuple(eos), config.stop_strings)


def plain_rows(setting: str | int, target: TargetProtocol) -> int:
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
def decode_plain(target: TargetProtocol, state: DecodeState, config: DecodeConfig, generator: torch.Generator | None = None
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
def decode(target: TargetProtocol, state: DecodeState, config: DecodeConfig, generator: torch.Generator | None = None,
           observe: Observer | None = None) -> Generation:
    """Generate from a prefilled state until EOS, a stop string or ``max_new_tokens`` (the
    state's drafter drafts; ``method="ar"`` is plain decoding). ``observe``: see ``speculate``."""
    if config.method == "ar":
        return decode_plain(target, state, config, generator)
    if state.drafter is None:
        raise ValueError(f"decoding.method={config.method} needs a draft head")
    state.min_rows = plain_rows(config.plain_rows, target)
    state.workspace.graphs.configure(config.cuda_graphs, target.device)
    return speculate(target, state, config, generator, observe)


def speculate(target: TargetProtocol, state: DecodeState, config: DecodeConfig,
              generator: torch.Generator | None = None, observe: Observer | None = None) -> Generation:
    """The speculative loop, each cycle: draft a block, verify it in one target forward,
    accept (and commit) the longest path the target agrees with, until a stop.
    ``observe(phase)`` is called as each cycle starts (``"cycle"``) and as each phase ends
    (``"draft"``, ``"verify"``, ``"accept"``): a timer marks time there."""
    observe = observe if observe is not None else _unobserved
    criteria, tokenizer = _criteria(target, config), getattr(target, "tokenizer", None)
    _first_token(state, config.sampling, generator)
    stop = find_stop(state.tokens, 0, criteria, tokenizer)
    cycles = []
    while stop is None:
        state.reserve(config.block_size)
        observe("cycle")
        tree = draft(target, state, config, generator)
        observe("draft")
        logits, hidden = verify(target, state, tree)
        observe("verify")
        acc, committed, stop = accept_and_commit(target, state, tree, logits, hidden, config, generator,
                                                 criteria, tokenizer)
        observe("accept")
        cycles.append(CycleStats(len(acc.path) - 1, acc.tried, committed, len(tree)))
    text = tokenizer.decode(state.tokens, skip_special_tokens=True) if tokenizer is not None else ""
    return Generation(list(state.tokens), text, stop[1], state.prompt_len, cycles=cycles)


def draft(target: TargetProtocol, state: DecodeState, config: DecodeConfig, generator=None) -> Tree:
    """The state's drafter proposes a block over what the last verification left."""
    return state.drafter.draft_block(target, state.pending(), config, generator)


def accept_and_commit(target: TargetProtocol, state: DecodeState, tree: Tree, logits: torch.Tensor,
                      hidden: torch.Tensor, config: DecodeConfig, generator, criteria: StopCriteria, tokenizer
                      ) -> tuple[Acceptance, int, tuple | None]:
    """A verified tree's outcome: ``accept``, ``commit``, and the stop check (the committed
    tokens cut at a stop). What the target said (the path, its logits) waits in the state
    for the drafter's next block. Returns the acceptance, the tokens committed and the stop
    (None: go on)."""
    acc = accept(tree, logits, config.sampling, generator)
    state.verified = (acc.path, logits)
    before = len(state.tokens)
    commit(state, acc, hidden)
    stop = find_stop(state.tokens, before, criteria, tokenizer)
    if stop is not None:
        del state.tokens[stop[0]:]
    return acc, len(state.tokens) - before, stop


def generate(target: TargetProtocol, draft, prompt: Encoded, config: DecodeConfig,
             generator: torch.Generator | None = None, captions: list[str] | None = None,
             workspace: Workspace | None = None, observe: Observer | None = None) -> Generation:
    """Prefill ``prompt`` (an ``Encoded`` from ``target.encode_prompt``) and decode.

    ``config.method = "ar"`` is plain decoding of the target (the head is ignored).
    ``captions`` (one per image of the prompt) are for drafters that read them.
    Caches are sized for the whole generation up front, in ``workspace``'s buffers: pass
    the same workspace for every prompt of a benchmark and each step is captured once.
    ``observe(phase)`` is called once the prefill is done (``"prefill"``), then as
    ``speculate`` says.
    """
    need = len(prompt.input_ids) + config.max_new_tokens + 2 * config.block_size
    capacity = -(-need // CAPACITY_STEP) * CAPACITY_STEP  # a few capacities, so a few shapes to capture
    state = prefill(target, build_drafter(target, draft, config, captions), prompt, capacity, workspace)
    if observe is not None:
        observe("prefill")
    return decode(target, state, config, generator, observe)
