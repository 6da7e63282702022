"""The drafter: what proposes the tokens a cycle verifies (vLLM's proposer).

One interface (``Drafter``), two implementations: ``HeadDrafter`` (one draft head over the
prompt as it was trained) here, and ``EnsembleDrafter`` (``ensemble.py``: a head drafter
over several input variants of the prompt, one batch row each). The decoder calls two
methods:

    drafter.prefill(target, prompt_pass, workspace, capacity)   the head reads the prompt
    tree = drafter.draft_block(target, pending, config)         a tree (or chain) of proposals

The drafter owns what only drafting reads (its head's cache and position offsets); what
the last verification left for it comes in as an argument (``Pending``: the target's
features and tokens to feed the head, and what the target said about the last block), so
it never reads the decoder's state back.

``draft_tree`` and ``draft_chain`` below are the block drafters (``propose`` picks the one
the settings name). They read a drafter's rows through ``feed_pending`` (the pending pairs
into the head's cache), ``head`` (the head over new positions of every row),
``distribution`` (the draft distribution after the rows' outputs) and ``top_children``
(the tree's ranking of the next tokens; a head drafter ranks only the ids its head drafts
from, not a whole-vocabulary row of mostly -inf). Each tree records
where its nodes' children came from (``Tree.children_from``) for drafters that look back
at it.

Indexing (see ``state.py``): draft position t pairs the target feature h_t with the
embedding e_{t+1}; its position id is the target's position of x_t. The head's cache holds
the committed draft positions; the pairs the last verification produced (``pending``)
are the first thing the next block feeds it.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from msd_train.decoding.cache import PositionCache, attention_width, key_mask
from msd_train.decoding.graphs import StepGraphs
from msd_train.decoding.sampling import SamplingParams, log_probs, logits_to_probs, sample
from msd_train.decoding.tree import Tree, chain
from msd_train.draft import DraftHead, draft_rope_deltas
from msd_train.targets import Features, TargetProtocol


@dataclass
class PromptPass:
    """One target pass over a prompt (batch 1), as ``speculative.prefill`` makes it."""

    ids: torch.Tensor  # (1, L)
    embeds: torch.Tensor  # (1, L, H)
    hidden: torch.Tensor  # (1, L, H)
    pos: torch.Tensor  # (1, L) or (3, 1, L)
    visual: torch.Tensor  # (1, L) bool: image tokens
    pixel: dict  # the processor's image tensors (only their grid shapes are read)
    rope_deltas: torch.Tensor | None = None  # M-RoPE: the target's text position minus token index
    layer_states: torch.Tensor | None = None  # (1, L, k*H): the inputs of the head's feature layers, if any


@dataclass
class Pending:
    """What the last verification left for the head: the target features h_{m-n} .. h_{m-1}
    (n, H), the tokens x_{m-n+1} .. x_m paired with them (n,), the root last (both on the
    device), m, the root's index in the sequence (known on the host), and what the target
    said about the last block: its accepted path (tree nodes, root first) and the target's
    logits (N, V) after each node (None before the first block; a TABED ensemble reads it)."""

    hidden: torch.Tensor
    tokens: torch.Tensor
    root: int
    verified: tuple[list[int], torch.Tensor] | None = None


class Drafter(ABC):
    """What the decoder and the block drafters ask of a drafter.

    The decoder: ``prefill``, ``draft_block``, ``clone``, and ``draft`` (its head: the
    target features it reads) and ``cache`` (the head's cache, sized with the target's).
    The block drafters (``draft_tree``, ``draft_chain``): ``feed_pending``, then ``head``,
    ``distribution`` and ``top_children`` over the drafter's rows; ``feed_pending`` and the node positions read
    the head's position offsets (``rope_deltas``, ``merged``)."""

    draft: DraftHead
    #: committed draft positions [0, cache.length); R rows for a drafter of R rows
    cache: PositionCache | None
    #: added to token indices for the head's position ids after the prompt: the target's
    #: rope deltas, or zeros for a head with draft_positions="1d" (see msd_train.draft.positions)
    rope_deltas: torch.Tensor | None
    #: prompt slots the head's cache does not hold (visual compression merged them): its
    #: cache entry i is draft position i + merged after the prompt's images
    merged: int

    @abstractmethod
    def prefill(self, target: TargetProtocol, prompt: PromptPass, workspace, capacity: int) -> None:
        """The head over the prompt; its cache into ``workspace``'s buffers (``capacity`` slots at least)."""

    @abstractmethod
    def draft_block(self, target: TargetProtocol, pending: Pending, config,
                    generator: torch.Generator | None = None) -> Tree:
        """The tree (or chain) of proposals ``config`` asks for, after feeding ``pending``."""

    @abstractmethod
    def clone(self, workspace) -> Drafter:
        """A copy drafting over ``workspace`` (a clone of the one this drafter's prefill used)."""

    @abstractmethod
    def head(self, embeds: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, queries: torch.Tensor
             ) -> torch.Tensor:
        """The head over T new positions of every row (R, T, H); ``queries`` (T, A) bool:
        which of the A newest cache slots (after the committed ones; these T queries are the
        last T) each query sees."""

    @abstractmethod
    def distribution(self, target: TargetProtocol, out: torch.Tensor, sampling: SamplingParams,
                     log: bool = False) -> torch.Tensor:
        """The draft distribution (T, V) after the rows' head outputs ``out`` (R, T, H)."""

    def top_children(self, target: TargetProtocol, out: torch.Tensor, sampling: SamplingParams, k: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` best next tokens after each of T head outputs ``out`` (R, T, H) and their
        scores (each (T, k)): the tree's ranking, ``distribution(log=True)`` clamped at 0."""
        lp = self.distribution(target, out, sampling, log=True).clamp_max(0)
        return lp.topk(min(k, lp.shape[-1]), dim=-1)

    def feed_pending(self, target: TargetProtocol, pending: Pending) -> torch.Tensor:
        """Feed the head the pairs (h_t, e_{t+1}) the last verification produced and commit
        them to its cache. Returns (R, H), the head's output at the newest position of each
        row: its prediction of the root's feature."""
        n = pending.hidden.shape[0]
        # positions past the prompt keep the target's index, however short the cache is
        pos = target.continue_positions(self.cache.length + self.merged, n, self.rope_deltas)
        hidden = self.draft.project(pending.hidden)[None]  # (1, n, H): after the prompt every row reads the same
        causal = torch.ones(n, n, dtype=torch.bool, device=target.device).tril()
        out = self.head(target.embed_tokens(pending.tokens)[None], hidden, pos, causal)
        self.cache.length += n
        return out[:, -1]


class HeadDrafter(Drafter):
    """One MSD head drafting over the prompt as it was trained (variant M): one row."""

    def __init__(self, draft: DraftHead):
        self.draft = draft
        self.cache: PositionCache | None = None
        self.rope_deltas: torch.Tensor | None = None
        self.graphs: StepGraphs | None = None  # the workspace's (set by ``prefill``)
        self.merged = 0

    def clone(self, workspace) -> HeadDrafter:
        out = copy.copy(self)
        out.cache, out.graphs = workspace.caches["head"], workspace.graphs
        return out

    @torch.inference_mode()
    def prefill(self, target: TargetProtocol, prompt: PromptPass, workspace, capacity: int) -> None:
        """The head over the prompt through ``draft.read_pass``, exactly as in training:
        decoupled visual slots match the head's ``visual_offset``, positions its
        ``draft_positions``, images compressed as its ``visual_compression`` says (so its
        cache may hold fewer entries than the prompt has draft positions). Its cache goes
        into the workspace's buffers (``capacity`` slots at least), its draft steps into
        the workspace's captured steps."""
        from transformers import DynamicCache

        cache = DynamicCache()
        self.rope_deltas = draft_rope_deltas(self.draft.config, prompt.rope_deltas)
        if prompt.ids.shape[1] > 1:
            features = Features(prompt.embeds, prompt.hidden, prompt.visual, prompt.pos, layer_states=prompt.layer_states)
            inputs, _ = self.draft.read_pass(features, target)
            self.draft(**inputs, past_key_values=cache, use_cache=True)
        self.attach(workspace, workspace.load("head", cache, capacity))
        self.merged = max(prompt.ids.shape[1] - 1, 0) - self.cache.length

    def attach(self, workspace, cache: PositionCache) -> None:
        """Draft over ``cache`` (the workspace's ``"head"`` buffers) with the workspace's captured steps."""
        self.cache, self.graphs = cache, workspace.graphs

    def draft_block(self, target: TargetProtocol, pending: Pending, config,
                    generator: torch.Generator | None = None) -> Tree:
        return propose(self, target, pending, config, generator)

    # ----- what the block drafters read ---------------------------------------------------

    def head(self, embeds: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, queries: torch.Tensor
             ) -> torch.Tensor:
        """``embeds`` (1, T, H), ``hidden`` (1, T, H), ``pos`` the row's position ids."""
        return self.run(embeds, hidden, pos, queries, self.mask(queries))

    def mask(self, queries: torch.Tensor) -> torch.Tensor:
        """The additive mask (1, 1, T, width) of T queries (``queries`` (T, A), see ``head``)
        over the committed slots and the A newest ones: width is the cache's capacity when
        steps are captured, else the slots written so far (``cache.attention_width``)."""
        past, a = self.cache.length, queries.shape[1]
        width = attention_width(self.graphs.enabled, self.cache.capacity, past + a)
        return key_mask(past, width, queries, self.draft.dtype)

    def run(self, embeds: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, queries: torch.Tensor,
            mask: torch.Tensor) -> torch.Tensor:
        """The head's step over T new positions of every row under ``mask``, written at the
        last T of the A newest slots (``queries`` (T, A)); replayed from a captured graph
        when capture is on. Returns (R, T, H)."""
        past, (t, a) = self.cache.length, queries.shape
        write_index = torch.arange(past + a - t, past + a, device=embeds.device)
        return self.graphs.run("head", self._step, embeds=embeds, hidden=hidden, pos=pos, mask=mask,
                               write_index=write_index)[0]

    def _step(self, embeds, hidden, pos, mask, write_index):
        """The head forward as a function of tensors only (what a captured graph replays)."""
        return (self.draft.step(embeds, hidden, position_ids=pos, attention_mask=mask,
                                past_key_values=self.cache.at(write_index, mask.shape[-1]), use_cache=True),)

    def distribution(self, target: TargetProtocol, out: torch.Tensor, sampling: SamplingParams,
                     log: bool = False) -> torch.Tensor:
        """Probabilities (sampling: warped; greedy: any distribution with the right argmax),
        or log-probabilities with ``log``."""
        logits = self.draft.logits(out[0], target)
        return log_probs(logits, sampling) if log else logits_to_probs(logits, sampling)

    def top_children(self, target: TargetProtocol, out: torch.Tensor, sampling: SamplingParams, k: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Ranked by the raw log-softmax (greedy, or ``rank_by=raw``), over the ids the head
        drafts from only (its draft or decode-time vocabulary): the same children as the
        whole-vocabulary ranking, whose other ids are -inf, without building that row."""
        if not (sampling.greedy or sampling.rank_by == "raw"):
            return super().top_children(target, out, sampling, k)
        small, ids = self.draft.logits_on_ids(out[0], target)
        if ids is not None and k > ids.shape[0]:  # the -inf ids pad the children: keep the shapes
            return super().top_children(target, out, sampling, k)
        scores, index = small.float().log_softmax(-1).clamp_max(0).topk(min(k, small.shape[-1]), dim=-1)
        return scores, (index if ids is None else ids[index])


# ----- the block drafters ---------------------------------------------------------------


def propose(drafter: Drafter, target: TargetProtocol, pending: Pending, config,
            generator: torch.Generator | None = None) -> Tree:
    """The block ``config.method`` names over ``drafter``'s rows: ``draft_tree`` or ``draft_chain``."""
    if config.method == "tree":
        return draft_tree(drafter, target, pending, config.depth, config.top_k, config.total_tokens, config.sampling)
    return draft_chain(drafter, target, pending, config.k, config.sampling, generator, config.draft_min_prob)


def _node_positions(drafter: Drafter, target: TargetProtocol, root: int, depth: int, n: int) -> torch.Tensor:
    """Draft position ids of n nodes at tree depth ``depth`` (draft index m - 1 + depth)."""
    pos = target.continue_positions(root - 1 + depth, 1, drafter.rope_deltas)
    return pos.expand(*pos.shape[:-1], n)


@torch.inference_mode()
def draft_chain(drafter: Drafter, target: TargetProtocol, pending: Pending, k: int, sampling: SamplingParams,
                generator: torch.Generator | None = None, min_prob: float = 0.0) -> Tree:
    """Up to k draft tokens, one after another: the argmax of the draft distribution q when
    greedy, else a draw from it (q kept, for the acceptance test).

    ``min_prob`` > 0 stops the chain before the token that would take the chain's
    probability under the head (the product of its tokens' q) below ``min_prob``: a chain
    of 0 tokens makes the cycle a plain decoding step. Verification decides as always, so
    outputs do not change; each draft token costs one host read (the length is decided on
    the host), which a CPU does not notice and a GPU does.
    """
    h = drafter.feed_pending(target, pending)  # (R, H)
    tokens, probs, chain_prob = [], [], 1.0
    for i in range(k):
        if sampling.greedy and min_prob > 0:  # the head's probability of its argmax: the log-softmax's max
            lp = drafter.distribution(target, h[:, None], sampling, log=True)[0]
            x, p_x = lp.argmax(-1), lp.max(-1).values.exp()
        else:
            q = drafter.distribution(target, h[:, None], sampling)[0]
            x = q.argmax(-1) if sampling.greedy else sample(q, generator)
            p_x = None if sampling.greedy else q.gather(-1, x[..., None])
        if min_prob > 0:
            chain_prob *= float(p_x.reshape(-1)[0])  # the host read deciding the length
            if chain_prob < min_prob:
                break
        if not sampling.greedy:
            probs.append(q)
        tokens.append(x)
        if i + 1 < k:  # each row's next input: (its own predicted feature, e(x)), causal over the chain
            seen = torch.ones(1, i + 1, dtype=torch.bool, device=target.device)
            h = drafter.head(target.embed_tokens(x.view(1, 1)), h[:, None],
                             _node_positions(drafter, target, pending.root, i + 1, 1), seen)[:, -1]
    n = len(tokens)
    index = torch.arange(n + 1, device=target.device)  # node i's children came from the i-th distribution
    root = pending.tokens[-1:]
    tree = chain(root, torch.stack(tokens), torch.stack(probs) if probs else None) if tokens else chain(root)
    tree.children_from = torch.where(index < n, index, -1)  # the last node has none
    return tree


@torch.inference_mode()
def draft_tree(drafter: Drafter, target: TargetProtocol, pending: Pending, depth: int, top_k: int, total_tokens: int,
               sampling: SamplingParams) -> Tree:
    """EAGLE-2 dynamic draft tree, built on the device with fixed shapes.

    The root's top_k children start the frontier. Each of ``depth`` steps runs the head
    once over the frontier (tree attention over the head's cache), gives every frontier
    node its top_k children, and keeps the top_k of those by cumulative log-probability
    as the next frontier. Finally all generated nodes are re-ranked by cumulative score
    and the best ``total_tokens - 1`` are verified. A child's score never exceeds its
    parent's and ties go to the earlier (parent) node, so the kept set contains every
    kept node's ancestors. Children are deterministic proposals (``draft_probs`` None).

    Shapes depend only on the settings: the pool has k + depth * k * k nodes, the tree
    min(total_tokens, pool + 1); nodes with score -inf (the warpers removed them) pad the
    tree and are marked invalid, so no count is read back from the device.
    """
    device = target.device
    out = drafter.feed_pending(target, pending)  # (R, H)
    scores, tokens = (t[0] for t in drafter.top_children(target, out[:, None], sampling, top_k))
    k = scores.shape[0]
    pool_tokens, pool_scores = [tokens], [scores]
    pool_parents = [torch.full((k,), -1, device=device)]
    pool_depths = [torch.ones(k, dtype=torch.long, device=device)]
    front_idx = torch.arange(k, device=device)  # pool indices of the frontier
    front_tokens, front_scores = tokens, scores
    front_in = out[:, None].expand(-1, k, -1)  # (R, k, H) each frontier node's parent output, per row
    front_anc = torch.zeros(k, 0, dtype=torch.bool, device=device)  # ancestor slots among the head's tree entries
    expanded = []  # pool indices of the frontier nodes, step by step (their children's distributions)
    for step in range(depth):
        anc = torch.cat([front_anc, torch.eye(k, dtype=torch.bool, device=device)], dim=1)
        out = drafter.head(target.embed_tokens(front_tokens)[None], front_in,
                           _node_positions(drafter, target, pending.root, step + 1, k), anc)
        expanded.append(front_idx)
        child_lp, child_tokens = drafter.top_children(target, out, sampling, k)  # (k, k)
        cand_scores = (front_scores[:, None] + child_lp).flatten()
        cand_tokens = child_tokens.flatten()
        base = k + step * k * k
        pool_tokens.append(cand_tokens)
        pool_scores.append(cand_scores)
        pool_parents.append(front_idx.repeat_interleave(k))
        pool_depths.append(torch.full((k * k,), step + 2, device=device))
        best = cand_scores.topk(k).indices
        parent = best // k
        front_idx, front_tokens, front_scores = base + best, cand_tokens[best], cand_scores[best]
        front_in, front_anc = out[:, parent], anc[parent]

    scores, tokens = torch.cat(pool_scores), torch.cat(pool_tokens)
    parents, depths = torch.cat(pool_parents), torch.cat(pool_depths)
    n_keep = min(total_tokens - 1, scores.shape[0])
    order = torch.sort(scores, descending=True, stable=True).indices
    keep = order[:n_keep].sort().values  # pool order: parents before children
    new_index = torch.full((scores.shape[0] + 1,), -1, dtype=torch.long, device=device)
    new_index[keep + 1] = torch.arange(1, n_keep + 1, device=device)
    new_index[0] = 0  # pool parent -1 is the root
    # a kept node's parent is always kept (scores are monotone along paths, ties keep the parent)
    tree_parents = new_index[parents[keep] + 1]
    flat = torch.full((scores.shape[0],), -1, dtype=torch.long, device=device)
    for step, idx in enumerate(expanded):  # where each kept node's children distribution sits (the root's: 0)
        flat[idx] = 1 + step * k + torch.arange(k, device=device)
    root = pending.tokens[-1:]
    zero = torch.zeros(1, dtype=torch.long, device=device)
    kept_scores = scores[keep]
    return Tree(
        tokens=torch.cat([root, tokens[keep]]),
        parents=torch.cat([zero - 1, tree_parents]),
        depths=torch.cat([zero, depths[keep]]),
        scores=torch.cat([zero.to(scores.dtype), kept_scores]),
        valid=torch.cat([torch.ones(1, dtype=torch.bool, device=device), torch.isfinite(kept_scores)]),
        max_depth=depth + 1,
        children_from=torch.cat([torch.zeros(1, dtype=torch.long, device=device), flat[keep]]),
    )
