"""Lossless speculative decoding of a multimodal target with an MSD draft head (batch 1).

One cycle, each phase one function below::

    tree         = draft_tree(...) or draft_chain(...)   the head proposes continuations
    logits, hid  = verify(...)                            one target forward over the tree
    path, bonus  = accept_greedy(...) or accept_sampling(...)
    commit(...)                                           caches keep exactly the accepted path

Plain autoregressive decoding (the baseline) is the same loop with a one-node tree (the
root) and no head, so both share prefill, verification, cache and stopping code.

Indexing. The committed sequence is ``x_0 .. x_m``: the prompt then the new tokens. The
target's KV cache holds ``x_0 .. x_{m-1}``; the root of the next tree is ``x_m``. Draft
position ``t`` pairs the target feature ``h_t`` with the embedding ``e_{t+1}`` and
predicts ``h_{t+1}`` (so ``lm_head`` of its output predicts ``x_{t+2}``); its position id
is the target's position of ``x_t``. The head's cache holds the committed positions; the
pairs whose features the last verification produced wait in ``pending_hidden`` and are
the first thing the next drafting forward reads.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch

from msd_train.decoding.sampling import SamplingParams, log_probs, logits_to_probs, sample
from msd_train.decoding.stopping import StopCriteria, find_stop
from msd_train.decoding.tree import Tree, chain, tree_attention_bias
from msd_train.draft import crop_cache

METHODS = ("tree", "chain", "ar")


@dataclass
class DecodeConfig:
    method: str = "tree"  # tree (EAGLE-2 dynamic tree) | chain | ar (plain decoding)
    #: tree: frontier expansions after the root's children (EAGLE-2's convention), so a
    #: path holds up to depth + 1 draft tokens
    depth: int = 5
    top_k: int = 10  # tree: frontier width and children per expanded node
    total_tokens: int = 60  # tree: nodes verified per cycle, root included
    k: int = 5  # chain: draft tokens per cycle
    max_new_tokens: int = 64
    stop_strings: tuple[str, ...] = ()
    #: None: the target's own EOS ids (generation config, else tokenizer); () never stops on EOS
    eos_token_ids: tuple[int, ...] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # --- ensemble drafting (msd_train/decoding/ensemble.py) ---
    ensemble: str | None = None  # None: the head alone (variant M) | ibed | tabed
    variants: tuple[str, ...] = ("M",)  # the head's input variants, one batch row each
    tabed_window: int = 32  # tabed: verified positions the weight search looks back over
    # --- end ensemble drafting ---

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"decoding.method must be one of {METHODS}, got {self.method!r}")
        if self.method == "tree" and (self.depth < 0 or self.top_k < 1 or self.total_tokens < 2):
            raise ValueError(
                f"tree decoding needs depth >= 0, top_k >= 1, total_tokens >= 2; got depth={self.depth}, "
                f"top_k={self.top_k}, total_tokens={self.total_tokens}"
            )
        if self.method == "chain" and self.k < 1:
            raise ValueError(f"chain decoding needs k >= 1, got k={self.k}")
        self.stop_strings = tuple(self.stop_strings or ())
        # --- ensemble drafting ---
        self.variants = tuple(self.variants or ("M",))
        if self.ensemble is not None:
            from msd_train.decoding.ensemble import check_ensemble

            check_ensemble(self)
        # --- end ensemble drafting ---


@dataclass
class DecodeState:
    """Everything carried from one cycle to the next."""

    target_cache: object  # transformers Cache over x_0 .. x_{m-1}
    cache_len: int  # m
    prompt_len: int
    rope_deltas: torch.Tensor | None  # M-RoPE: text position minus token index
    next_logits: torch.Tensor  # (V,) target logits after the prompt (the first new token)
    pending_hidden: torch.Tensor  # (n, H) target features h_{m-n} .. h_{m-1} not yet fed to the head
    draft_cache: object | None = None  # the head's cache over draft positions 0 .. draft_len-1
    draft_len: int = 0
    tokens: list[int] = field(default_factory=list)  # new tokens; tokens[-1] is the root x_m
    ensemble: object | None = None  # EnsembleState when drafting with input variants

    def clone(self) -> DecodeState:
        """An independent copy (caches included), e.g. to decode one prompt many times."""
        out = copy.copy(self)
        out.target_cache = _clone_cache(self.target_cache)
        out.draft_cache = _clone_cache(self.draft_cache)
        out.tokens = list(self.tokens)
        out.ensemble = self.ensemble.clone() if self.ensemble is not None else None
        return out


def _clone_cache(cache):
    if cache is None:
        return None
    out = copy.copy(cache)
    out.layers = []
    for layer in cache.layers:
        new = copy.copy(layer)
        if getattr(layer, "is_initialized", False):
            new.keys, new.values = layer.keys.clone(), layer.values.clone()
        out.layers.append(new)
    return out


@dataclass
class CycleStats:
    accepted: int  # draft tokens accepted (before any stop truncation)
    tried: int  # draft positions tested: accepted, plus one if the deepest accepted node had children
    committed: int  # tokens this cycle added to the output (after stop truncation)
    tree_size: int  # nodes verified, root included
    t_draft: float
    t_verify: float
    t_accept: float  # acceptance + cache bookkeeping + stop check


@dataclass
class Generation:
    tokens: list[int]
    text: str
    stop_reason: str  # eos | stop_string | max_new_tokens
    prompt_len: int
    t_prefill: float = 0.0  # seconds, target (and head) prefill and first token
    t_total: float = 0.0  # seconds, everything from the prompt to the last token
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


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


# ----- prefill --------------------------------------------------------------------------


def prefill_target(target, prompt):
    """The target's forward over the prompt (images included).

    Returns a ``DecodeState`` holding the target cache and its first next-token logits,
    plus the prompt's ``ids``, ``embeds``, ``hidden`` states and ``pos`` ids that a head's
    prefill reads (single head here, a batch of input variants in ``ensemble``).
    """
    device = target.device
    ids = prompt.input_ids.to(device)[None]
    pixel = {k: v.to(device) for k, v in (prompt.pixel or {}).items()}
    embeds = target.embed(ids, pixel)
    pos, deltas = target.position_ids(ids, None, pixel)
    hidden, cache = target.run_language_model(embeds, pos, None, None, use_cache=True)
    length = ids.shape[1]
    state = DecodeState(
        target_cache=cache, cache_len=length, prompt_len=length, rope_deltas=deltas,
        next_logits=target.lm_head(hidden[0, -1]), pending_hidden=hidden[0, -1:],
    )
    return state, ids, embeds, hidden, pos


@torch.inference_mode()
def prefill(target, draft, prompt) -> DecodeState:
    """Target forward over the prompt (images included) and the head's prefill.

    The head reads the prompt through ``draft.align_inputs``, exactly as in training, so
    decoupled visual slots match the head's ``visual_offset``.
    """
    state, ids, embeds, hidden, pos = prefill_target(target, prompt)
    length = ids.shape[1]
    if draft is not None:
        from transformers import DynamicCache

        state.draft_cache = DynamicCache()
        if length > 1:
            e, h, replace, raw = draft.align_inputs(embeds, hidden, ids == target.image_token_id)
            draft(e, h, replace, raw, position_ids=pos[..., :-1], past_key_values=state.draft_cache, use_cache=True)
            state.draft_len = length - 1
    return state


# ----- drafting -------------------------------------------------------------------------
#
# The head runs over R rows: one for a single head, one per input variant when drafting
# with an ensemble (msd_train/decoding/ensemble.py). Rows share the tokens drafted and the
# positions; each keeps its own features and cache. Their next-token distributions are
# mixed into the one distribution that drafting (and the acceptance test) uses.


def _head(draft, state: DecodeState, embeds: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor,
          tree: torch.Tensor | None = None) -> torch.Tensor:
    """Run the head over T new positions of every row; returns (R, T, H).

    ``embeds`` (1, T, H) are shared by the rows, ``hidden`` (R, T, H) is each row's,
    ``pos`` batch-1 position ids. ``tree`` (T, A) bool: which of the last A cache
    entries (this block's tree nodes, the T queries last) each query sees; None: causal.
    """
    rows = hidden.shape[0]
    if rows > 1:
        embeds = embeds.expand(rows, -1, -1)
        pos = pos.expand(*pos.shape[:-2], rows, pos.shape[-1])
    ens = state.ensemble
    pad = ens.head_bias if ens is not None and ens.key_bias is not None else None  # rows' left padding
    past = state.draft_cache.get_seq_length()
    n, keys = embeds.shape[1], past + embeds.shape[1]
    if tree is None and n == 1:
        mask = pad(keys) if pad is not None else None  # the one query sees every (real) key
    elif tree is None and pad is None:
        mask = None  # the head's own causal mask
    else:  # a tree (or, with padding, causal: a chain-shaped tree) over the newest keys
        if tree is None:
            tree = torch.ones(n, n, dtype=torch.bool, device=embeds.device).tril()
        mask = tree_attention_bias(tree, keys - tree.shape[1], draft.dtype)
        if pad is not None:
            mask = mask + pad(keys)
    return draft(embeds, hidden, position_ids=pos, attention_mask=mask, past_key_values=state.draft_cache,
                 use_cache=True).last_hidden_state


def _draft_pending(draft, target, state: DecodeState) -> torch.Tensor:
    """Feed the head the pairs (h_t, e_{t+1}) the last verification produced.

    Returns (R, H), the head's output at the newest position of each row: its prediction
    of the root's feature, whose lm_head gives the distribution of the root's children.
    """
    n = state.pending_hidden.shape[0]
    tokens = torch.as_tensor(state.tokens[-n:], device=target.device)
    pos = target.continue_positions(state.draft_len, n, state.rope_deltas)
    hidden = state.pending_hidden[None]
    if state.ensemble is not None:
        hidden = hidden.expand(state.ensemble.rows, -1, -1)
    out = _head(draft, state, target.embed_tokens(tokens)[None], hidden, pos)
    state.draft_len += n
    return out[:, -1]


def _distribution(target, state: DecodeState, out: torch.Tensor, sampling: SamplingParams,
                  log: bool = False) -> torch.Tensor:
    """The draft distribution (T, V) after the head's outputs ``out`` (R, T, H):
    probabilities (sampling: warped; greedy: any distribution with the right argmax),
    or log-probabilities with ``log``. An ensemble's is the mixture of its rows'."""
    out = out.to(target.dtype)
    if state.ensemble is not None:
        q = state.ensemble.mix(out, target.lm_head, sampling)
        return q.log() if log else q
    logits = target.lm_head(out[0])
    return log_probs(logits, sampling) if log else logits_to_probs(logits, sampling)


def _node_positions(target, state: DecodeState, depth: int, n: int) -> torch.Tensor:
    """Draft position ids of n nodes at tree depth ``depth`` (draft index m - 1 + depth)."""
    pos = target.continue_positions(state.cache_len - 1 + depth, 1, state.rope_deltas)
    return pos.expand(*pos.shape[:-1], n)


@torch.inference_mode()
def draft_chain(draft, target, state: DecodeState, k: int, sampling: SamplingParams,
                generator: torch.Generator | None = None) -> Tree:
    """k draft tokens, one after another: the argmax of the draft distribution q when
    greedy, else a draw from it (q kept, for the acceptance test)."""
    ens = state.ensemble
    if ens is not None:
        ens.begin_block()
    h = _draft_pending(draft, target, state)  # (R, H)
    tokens, probs = [], []
    for i in range(k):
        q = _distribution(target, state, h[:, None], sampling)[0]
        x = q.argmax(-1) if sampling.greedy else sample(q, generator)
        if not sampling.greedy:
            probs.append(q)
        tokens.append(x)
        if i + 1 < k:  # each row's next input: (its own predicted feature, e(x))
            h = _head(draft, state, target.embed_tokens(x.view(1, 1)), h[:, None],
                      _node_positions(target, state, i + 1, 1))[:, -1]
    crop_cache(state.draft_cache, state.draft_len)
    if ens is not None:  # node i's children were drafted from the i-th distribution; the last node has none
        ens.block_index = torch.arange(k + 1, device=target.device)
        ens.block_index[k] = -1
    root = torch.as_tensor([state.tokens[-1]], device=target.device)
    return chain(root, torch.stack(tokens), torch.stack(probs) if probs else None)


@torch.inference_mode()
def draft_tree(draft, target, state: DecodeState, depth: int, top_k: int, total_tokens: int,
               sampling: SamplingParams) -> Tree:
    """EAGLE-2 dynamic draft tree.

    The root's top_k children start the frontier. Each of ``depth`` steps runs the head
    once over the frontier (tree attention over the head's cache), gives every frontier
    node its top_k children, and keeps the top_k of those by cumulative log-probability
    as the next frontier. Finally all generated nodes are re-ranked by cumulative score
    and the best ``total_tokens - 1`` are verified. A child's score never exceeds its
    parent's and ties go to the earlier (parent) node, so the kept set contains every
    kept node's ancestors. Children are deterministic proposals (``draft_probs`` None).
    With an ensemble, scores are the log of the rows' mixture, and each row carries its
    own frontier features.
    """
    device = target.device
    ens = state.ensemble
    if ens is not None:
        ens.begin_block()
    out = _draft_pending(draft, target, state)  # (R, H)
    past = state.draft_len  # committed head cache; tree nodes are appended after it
    lp = _distribution(target, state, out[:, None], sampling, log=True)[0].clamp_max(0)
    k = min(top_k, lp.shape[-1])
    scores, tokens = lp.topk(k)
    pool_tokens, pool_scores = [tokens], [scores]
    pool_parents = [torch.full((k,), -1, device=device)]
    pool_depths = [torch.ones(k, dtype=torch.long, device=device)]
    front_idx = torch.arange(k, device=device)  # pool indices of the frontier
    front_tokens, front_scores = tokens, scores
    front_in = out[:, None].expand(-1, k, -1)  # (R, k, H) each frontier node's parent output, per row
    front_anc = torch.zeros(k, 0, dtype=torch.bool, device=device)  # ancestor slots in the head's tree cache
    expanded = []  # pool indices of the frontier nodes, step by step (their children's distributions)
    for step in range(depth):
        anc = torch.cat([front_anc, torch.eye(k, dtype=torch.bool, device=device)], dim=1)
        out = _head(draft, state, target.embed_tokens(front_tokens)[None], front_in,
                    _node_positions(target, state, step + 1, k), tree=anc)
        expanded.append(front_idx)
        lp = _distribution(target, state, out, sampling, log=True).clamp_max(0)
        child_lp, child_tokens = lp.topk(k, dim=-1)  # (k, k)
        cand_scores = (front_scores[:, None] + child_lp).flatten()
        cand_tokens = child_tokens.flatten()
        base = sum(t.shape[0] for t in pool_tokens)
        pool_tokens.append(cand_tokens)
        pool_scores.append(cand_scores)
        pool_parents.append(front_idx.repeat_interleave(k))
        pool_depths.append(torch.full((k * k,), step + 2, device=device))
        best = cand_scores.topk(k).indices
        parent = best // k
        front_idx, front_tokens, front_scores = base + best, cand_tokens[best], cand_scores[best]
        front_in, front_anc = out[:, parent], anc[parent]
    crop_cache(state.draft_cache, past)

    scores, tokens = torch.cat(pool_scores), torch.cat(pool_tokens)
    parents, depths = torch.cat(pool_parents), torch.cat(pool_depths)
    order = torch.sort(scores, descending=True, stable=True).indices
    n_keep = min(total_tokens - 1, int(torch.isfinite(scores).sum()))
    keep = order[:n_keep].sort().values  # pool order: parents before children
    new_index = torch.full((scores.shape[0] + 1,), -1, dtype=torch.long, device=device)
    new_index[keep + 1] = torch.arange(1, n_keep + 1, device=device)
    new_index[0] = 0  # pool parent -1 is the root
    tree_parents = new_index[parents[keep] + 1]
    if bool((tree_parents < 0).any()):  # cannot happen: scores are monotone along paths
        raise RuntimeError("draft tree selection dropped an ancestor of a kept node")
    if ens is not None:  # where each kept node's children distribution sits (the root's: 0)
        flat = torch.full((scores.shape[0],), -1, dtype=torch.long, device=device)
        for step, idx in enumerate(expanded):
            flat[idx] = 1 + step * k + torch.arange(k, device=device)
        ens.block_index = torch.cat([torch.zeros(1, dtype=torch.long, device=device), flat[keep]])
    root = torch.as_tensor([state.tokens[-1]], device=device)
    zero = torch.zeros(1, dtype=torch.long, device=device)
    return Tree(
        tokens=torch.cat([root, tokens[keep]]),
        parents=torch.cat([zero - 1, tree_parents]),
        depths=torch.cat([zero, depths[keep]]),
        scores=torch.cat([zero.to(scores.dtype), scores[keep]]),
    )


# ----- verification ---------------------------------------------------------------------


@torch.inference_mode()
def verify(target, state: DecodeState, tree: Tree) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over all tree nodes: each sees the cached prefix and its
    ancestors, at position (root position + depth). Returns logits (N, V) and post-norm
    features (N, H). The target cache grows by N; ``commit`` trims it to the path."""
    embeds = target.embed_tokens(tree.tokens)[None]
    pos = target.continue_positions(state.cache_len, 1, state.rope_deltas) + tree.depths
    mask = None if tree.is_chain else tree_attention_bias(tree.ancestor_mask(), state.cache_len, target.dtype)
    hidden, state.target_cache = target.run_language_model(
        embeds, pos, mask, past_key_values=state.target_cache, use_cache=True
    )
    return target.lm_head(hidden[0]), hidden[0]


# ----- acceptance -----------------------------------------------------------------------


def accept_greedy(tree: Tree, logits: torch.Tensor) -> tuple[list[int], int]:
    """Longest root-to-node path whose every token is the target's argmax after its
    parent; the target's argmax after that path is the bonus token."""
    best = logits.argmax(-1).tolist()
    tokens, kids = tree.tokens.tolist(), tree.children()
    path = [0]
    while True:
        want = best[path[-1]]
        nxt = next((c for c in kids[path[-1]] if tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)


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


# ----- cache update ---------------------------------------------------------------------


@torch.inference_mode()
def keep_cache_entries(cache, start: int, index: list[int]) -> None:
    """Keep the cache entries ``start + index`` (in that order) right after the first
    ``start`` entries and drop everything after them."""
    n = len(index)
    if index != list(range(n)):
        idx = torch.as_tensor(index, device=cache.layers[0].keys.device) + start
        for layer in cache.layers:
            layer.keys[..., start : start + n, :] = layer.keys[..., idx, :]
            layer.values[..., start : start + n, :] = layer.values[..., idx, :]
    crop_cache(cache, start + n)


@torch.inference_mode()
def commit(state: DecodeState, tree: Tree, path: list[int], bonus: int, hidden: torch.Tensor) -> list[int]:
    """Commit the accepted path and the bonus token.

    The target cache keeps the root and the accepted nodes (moved into place); their
    features become the head's pending inputs. The head's cache already holds only
    committed positions (drafting crops it back). Returns the new tokens.
    """
    keep_cache_entries(state.target_cache, state.cache_len, path)
    state.cache_len += len(path)
    new = tree.tokens[path[1:]].tolist() + [bonus]
    state.tokens.extend(new)
    state.pending_hidden = hidden[path]
    return new


# ----- the loop -------------------------------------------------------------------------


def _choose(logits: torch.Tensor, sampling: SamplingParams, generator) -> int:
    if sampling.greedy:
        return int(logits.argmax(-1))
    return int(sample(logits_to_probs(logits, sampling), generator))


@torch.inference_mode()
def decode(target, draft, state: DecodeState, config: DecodeConfig,
           generator: torch.Generator | None = None) -> Generation:
    """Generate from a prefilled state until EOS, a stop string or ``max_new_tokens``."""
    device = target.device
    sampling = config.sampling
    eos = target.eos_token_ids if config.eos_token_ids is None else config.eos_token_ids
    criteria = StopCriteria(config.max_new_tokens, tuple(eos), config.stop_strings)
    tokenizer = getattr(target, "tokenizer", None)
    if config.method != "ar" and draft is None:
        raise ValueError(f"decoding.method={config.method} needs a draft head")

    state.tokens.append(_choose(state.next_logits, sampling, generator))
    stop = find_stop(state.tokens, 0, criteria, tokenizer)
    cycles = []
    while stop is None:
        t0 = _now(device)
        if config.method == "tree":
            tree = draft_tree(draft, target, state, config.depth, config.top_k, config.total_tokens, sampling)
        elif config.method == "chain":
            tree = draft_chain(draft, target, state, config.k, sampling, generator)
        else:
            tree = chain(torch.as_tensor([state.tokens[-1]], device=device))
        t1 = _now(device)
        logits, hidden = verify(target, state, tree)
        t2 = _now(device)
        if sampling.greedy:
            path, bonus = accept_greedy(tree, logits)
        else:
            path, bonus = accept_sampling(tree, logits_to_probs(logits, sampling), generator)
        if state.ensemble is not None:  # ensemble drafting: TABED's verified history
            state.ensemble.record_verified(path, logits, target.lm_head)
        tried = len(path) - 1 + int(bool((tree.parents == path[-1]).any()))
        before = len(state.tokens)
        commit(state, tree, path, bonus, hidden)
        stop = find_stop(state.tokens, before, criteria, tokenizer)
        if stop is not None:
            del state.tokens[stop[0]:]
        t3 = _now(device)
        cycles.append(CycleStats(len(path) - 1, tried, len(state.tokens) - before, len(tree), t1 - t0, t2 - t1, t3 - t2))
    text = tokenizer.decode(state.tokens, skip_special_tokens=True) if tokenizer is not None else ""
    return Generation(list(state.tokens), text, stop[1], state.prompt_len, cycles=cycles)


def generate(target, draft, prompt, config: DecodeConfig, generator: torch.Generator | None = None,
             captions: list[str] | None = None) -> Generation:
    """Prefill ``prompt`` (an ``Encoded`` from ``target.encode_prompt``) and decode.

    ``config.method = "ar"`` is plain decoding of the target (the head is ignored).
    ``captions`` (one per image of the prompt) are read only by the ensemble variant C.
    """
    device = target.device
    t0 = _now(device)
    if config.ensemble is not None and config.method != "ar":  # ensemble drafting
        from msd_train.decoding.ensemble import prefill_ensemble

        state = prefill_ensemble(target, draft, prompt, config.variants, config.ensemble, config.tabed_window,
                                 captions)
    else:
        state = prefill(target, draft if config.method != "ar" else None, prompt)
    t1 = _now(device)
    out = decode(target, draft, state, config, generator)
    t2 = _now(device)
    out.t_prefill, out.t_total = t1 - t0, t2 - t0
    return out
