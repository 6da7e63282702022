"""Lossless speculative decoding with MSD draft heads (needs only torch and transformers).

    from msd_train.decoding import DecodeConfig, generate
    out = generate(target, draft, target.encode_prompt(messages, images), DecodeConfig(method="tree"))
    out.tokens, out.text, out.tau, out.cycles

Modules, each importing only those before it: ``sampling``, ``stopping``, ``tree``,
``cache`` (static KV caches written by position), ``graphs`` (captured steps), ``config``
(``DecodeConfig``), ``drafter`` (the drafter interface, one head, the tree and chain
drafters), ``ensemble`` (a head drafter over input variants), ``build`` (settings -> the
drafter), ``acceptance`` (the greedy and sampling acceptance rules), ``state`` (the decode
state, the workspace, what a generation reports), ``speculative`` (prefill, verify,
commit, the loops). Timing the loop is the caller's (``msd_train.evaluation.timing``).
"""

from msd_train.decoding.acceptance import Acceptance, accept, accept_greedy, accept_sampling, read_acceptance
from msd_train.decoding.block import BlockDrafter, draft_block
from msd_train.decoding.build import build_drafter, use_draft_vocabulary
from msd_train.decoding.cache import PositionCache, key_mask
from msd_train.decoding.config import METHODS, DecodeConfig
from msd_train.decoding.drafter import Drafter, HeadDrafter, Pending, PromptPass, draft_chain, draft_tree
from msd_train.decoding.ensemble import EnsembleDrafter
from msd_train.decoding.sampling import SamplingParams, log_probs, logits_to_probs, sample
from msd_train.decoding.speculative import (
    commit,
    decode,
    decode_plain,
    generate,
    prefill,
    speculate,
    verify,
)
from msd_train.decoding.state import CycleStats, DecodeState, Generation, Workspace
from msd_train.decoding.stopping import StopCriteria, find_stop
from msd_train.decoding.tree import Tree, chain

__all__ = [
    "METHODS", "Acceptance", "BlockDrafter", "CycleStats", "DecodeConfig", "DecodeState", "Drafter", "EnsembleDrafter",
    "Generation", "HeadDrafter", "Pending", "PositionCache", "PromptPass", "SamplingParams", "StopCriteria", "Tree",
    "Workspace", "accept", "accept_greedy", "accept_sampling", "build_drafter", "chain", "commit", "decode",
    "decode_plain", "draft_block", "draft_chain", "draft_tree", "find_stop", "generate", "key_mask", "log_probs",
    "logits_to_probs", "prefill", "read_acceptance", "sample", "speculate", "use_draft_vocabulary", "verify",
]
