"""Lossless speculative decoding with MSD draft heads (needs only torch and transformers).

    from msd_train.decoding import DecodeConfig, generate
    out = generate(target, draft, target.encode_prompt(messages, images), DecodeConfig(method="tree"))
    out.tokens, out.text, out.tau, out.cycles
"""

from msd_train.decoding.sampling import SamplingParams, log_probs, logits_to_probs, sample
from msd_train.decoding.speculative import (
    METHODS,
    CycleStats,
    DecodeConfig,
    DecodeState,
    Generation,
    accept_greedy,
    accept_sampling,
    commit,
    decode,
    draft_chain,
    draft_tree,
    generate,
    keep_cache_entries,
    prefill,
    verify,
)
from msd_train.decoding.stopping import StopCriteria, find_stop
from msd_train.decoding.tree import Tree, chain, tree_attention_bias

__all__ = [
    "METHODS", "CycleStats", "DecodeConfig", "DecodeState", "Generation", "SamplingParams", "StopCriteria",
    "Tree", "accept_greedy", "accept_sampling", "chain", "commit", "decode", "draft_chain", "draft_tree",
    "find_stop", "generate", "keep_cache_entries", "log_probs", "logits_to_probs", "prefill", "sample",
    "tree_attention_bias", "verify",
]
