"""The block drafter: a head that proposes a whole block in one forward (``head=dflash``,
``decoding=block``).

Each cycle is one head forward: the target features the last verification produced become
new context entries (written to the head's cache, which holds only context), the block is
the root (the newest committed token) plus ``block_size - 1`` mask positions, and block
position i proposes the token i after the root. The proposals are a chain (``tree.chain``):
verified in one target forward and accepted by the rules every chain uses
(``acceptance.py``): greedy, the longest prefix the target's argmax agrees with; sampling,
each proposal x_i accepted with min(1, p(x_i) / q_i(x_i)), else the bonus drawn from
norm(max(p - q_i, 0)). That rule is lossless here too: the block's q_i does not depend on
the tokens drawn at earlier positions (they are masks to the head), so x_i is drawn from q_i
whatever was accepted before it.

The head's cache holds one entry per committed position before the root, [0, m); its
forward writes the pending ones at [m - n, m) and attends over them (no block entry is kept).
The block head runs eagerly (no captured step).
"""

from __future__ import annotations

import copy

import torch

from msd_train.decoding.cache import PositionCache
from msd_train.decoding.drafter import Drafter, Pending, PromptPass
from msd_train.decoding.sampling import SamplingParams, logits_to_probs, sample
from msd_train.decoding.tree import Tree, chain
from msd_train.draft import DraftHead, draft_rope_deltas
from msd_train.targets import Features, TargetProtocol


class BlockDrafter(Drafter):
    """One block head (its class declares ``decoding_methods = ("block",)``) over the prompt: one row."""

    def __init__(self, draft: DraftHead):
        self.draft = draft
        self.cache: PositionCache | None = None
        self.rope_deltas: torch.Tensor | None = None
        self.merged = 0  # a block head keeps every context entry

    def clone(self, workspace) -> BlockDrafter:
        out = copy.copy(self)
        out.cache = workspace.caches["head"]
        return out

    @torch.inference_mode()
    def prefill(self, target: TargetProtocol, prompt: PromptPass, workspace, capacity: int) -> None:
        """The prompt's context entries h_0 .. h_{L-2} into the head's cache (h_{L-1} is the
        first block's pending feature), through ``target_inputs`` as in training."""
        from transformers import DynamicCache

        cache = DynamicCache()
        self.rope_deltas = draft_rope_deltas(self.draft.config, prompt.rope_deltas)
        if prompt.ids.shape[1] > 1:
            features = Features(prompt.embeds, prompt.hidden, prompt.visual, prompt.pos,
                                layer_states=prompt.layer_states)
            x = self.draft.target_inputs(features, target)
            self.draft(input_embeds=x["input_embeds"][:, :0], hidden_states=x["hidden_states"],
                       position_ids=x["position_ids"][..., :0], context_position_ids=x["context_position_ids"],
                       past_key_values=cache, use_cache=True)
        self.cache = workspace.load("head", cache, capacity)

    def draft_block(self, target: TargetProtocol, pending: Pending, config,
                    generator: torch.Generator | None = None) -> Tree:
        return draft_block(self, target, pending, min(config.k, self.draft.config.block_size - 1), config.sampling,
                           generator)

    # a block head is not stepped: the tree and chain drafters' members do not apply
    def head(self, embeds, hidden, pos, queries):
        raise NotImplementedError("a block drafter runs its head once per block (draft_block)")

    def distribution(self, target: TargetProtocol, out: torch.Tensor, sampling: SamplingParams,
                     log: bool = False) -> torch.Tensor:
        raise NotImplementedError("a block drafter runs its head once per block (draft_block)")


@torch.inference_mode()
def draft_block(drafter: BlockDrafter, target: TargetProtocol, pending: Pending, k: int, sampling: SamplingParams,
                generator: torch.Generator | None = None) -> Tree:
    """The first ``k`` proposals of one block as a chain after the root: the argmax of each
    block position's distribution q_i when greedy, else a draw from it (q_i kept for the
    acceptance rule)."""
    draft, cache = drafter.draft, drafter.cache
    n, m = pending.hidden.shape[0], pending.root
    start = cache.length  # = m - n: the context entries before the pending ones
    cache.grow(start + n)
    context = draft.context(pending.hidden)[None]  # no image after the prompt: the fused features
    out = draft(input_embeds=target.embed_tokens(pending.tokens[-1:])[None],
                hidden_states=context,
                position_ids=target.continue_positions(m, 1, drafter.rope_deltas),
                context_position_ids=target.continue_positions(start, n, drafter.rope_deltas),
                past_key_values=cache.at(torch.arange(start, start + n, device=target.device), start + n),
                use_cache=True).last_hidden_state  # (1, 1, S, H)
    cache.length = start + n
    states = out[0, 0, 1:1 + k]
    probs = None
    if sampling.greedy:
        small, ids = draft.logits_on_ids(states, target)
        tokens = small.argmax(-1) if ids is None else ids[small.argmax(-1)]
    else:
        probs = logits_to_probs(draft.logits(states, target), sampling)
        tokens = sample(probs, generator)
    tree = chain(pending.tokens[-1:], tokens, probs)
    index = torch.arange(k + 1, device=target.device)
    tree.children_from = torch.where(index < k, index, -1)  # node i's child came from block position i+1
    return tree
