"""Lossless speculative decoding with MSD draft heads (needs only torch and transformers).

    from msd_train.decoding import DecodeConfig, generate
    out = generate(target, draft, target.encode_prompt(messages, images), DecodeConfig(method="tree"))
    out.tokens, out.text, out.tau, out.cycles

Modules, each importing only those before it: ``sampling``, ``stopping``, ``tree``,
``cache`` (static KV caches written by position), ``graphs`` (captured steps), ``drafter`` (the drafter interface,
one head, the tree and chain drafters), ``ensemble`` (a drafter over input variants),
``config`` (``DecodeConfig``), ``speculative`` (prefill, verify, accept, commit, the loops).
"""

from msd_train.decoding.cache import PositionCache, key_mask
from msd_train.decoding.config import METHODS, DecodeConfig, build_drafter, use_draft_vocabulary
from msd_train.decoding.drafter import HeadDrafter, Pending, PromptPass, draft_chain, draft_tree
from msd_train.decoding.sampling import SamplingParams, log_probs, logits_to_probs, sample
from msd_train.decoding.speculative import (
    Acceptance,
    CycleStats,
    DecodeState,
    Generation,
    PhaseTimer,
    Workspace,
    accept,
    accept_greedy,
    accept_sampling,
    commit,
    decode,
    decode_plain,
    generate,
    prefill,
    read_acceptance,
    speculate,
    verify,
)
from msd_train.decoding.stopping import StopCriteria, find_stop
from msd_train.decoding.tree import Tree, chain, tree_attention_bias

__all__ = [
    "METHODS", "Acceptance", "CycleStats", "DecodeConfig", "DecodeState", "Generation", "HeadDrafter",
    "Pending", "PositionCache", "PromptPass", "SamplingParams", "StopCriteria", "Tree", "PhaseTimer", "accept", "accept_greedy", "accept_sampling",
    "build_drafter", "chain", "commit", "decode", "decode_plain", "draft_chain", "draft_tree", "find_stop",
    "generate", "key_mask", "log_probs", "logits_to_probs", "prefill", "read_acceptance", "sample", "speculate",
    "tree_attention_bias", "use_draft_vocabulary", "verify", "Workspace",
]
