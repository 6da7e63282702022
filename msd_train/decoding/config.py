"""Decoding settings (``DecodeConfig``); the objects they ask for are built in ``build.py``."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from msd_train.checks import METHODS, check_decoding  # noqa: F401  (METHODS: msd_train.decoding's)
from msd_train.decoding.sampling import SamplingParams


@dataclass
class DecodeConfig:
    method: str = "tree"  # tree (EAGLE-2 dynamic tree) | chain | block (a dflash head's block) | ar (plain decoding)
    #: tree: frontier expansions after the root's children (EAGLE-2's convention), so a
    #: path holds up to depth + 1 draft tokens
    depth: int = 5
    top_k: int = 10  # tree: frontier width and children per expanded node
    total_tokens: int = 60  # tree: nodes verified per cycle, root included
    k: int = 5  # chain: draft tokens per cycle; block: the first min(k, block_size - 1) of the head's block
    #: chain: stop drafting a cycle once the chain's probability under the head would fall
    #: below this (0: always k tokens); a host read per draft token, for targets whose
    #: verification costs more per token verified (a CPU), see draft_chain
    draft_min_prob: float = 0.0
    max_new_tokens: int = 64
    stop_strings: tuple[str, ...] = ()
    #: None: the target's own EOS ids (generation config, else tokenizer); () never stops on EOS
    eos_token_ids: tuple[int, ...] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    #: capture the verify forward, the head's draft step and the plain one-token step in
    #: CUDA graphs (msd_train/decoding/graphs.py): auto = on for CUDA targets, off on CPU;
    #: a step whose capture fails runs eagerly after one warning
    cuda_graphs: str | bool = "auto"
    #: msd heads: draft over the ``draft_vocab`` target tokens most frequent in the head's
    #: training data only (``msd_train.draft.vocabulary``); None: the vocabulary the head was
    #: trained over (``draft.train_vocab``), else the whole one; the target's vocabulary size: the whole
    draft_vocab: int | None = None
    #: plain decoding's target forward: 1 row, or 2 (the step's token twice) so that it rounds
    #: as verification's multi-row forwards do; auto: 2 for bf16/fp16 targets on a CPU
    #: (``speculative.plain_rows``), where it costs what one row does
    plain_rows: str | int = "auto"
    # --- drafting with input variants (msd_train/decoding/ensemble.py) ---
    ensemble: str | None = None  # None: the head alone (variant M) | ibed | tabed
    variants: tuple[str, ...] = ("M",)  # the head's input variants, one batch row each
    #: tabed: the most recent verified positions the weight search looks back over, or
    #: "all" for the whole answer so far (TABED's own choice; docs/ensembles.md)
    tabed_window: int | str = 32

    def __post_init__(self):
        self.stop_strings = tuple(self.stop_strings or ())
        self.variants = tuple(self.variants or ("M",))
        # the bounds live in msd_train/checks.py (torch-free), which eval.py runs before any model loads
        check_decoding({f.name: getattr(self, f.name) for f in fields(self) if f.name != "sampling"})

    @property
    def block_size(self) -> int:
        """Cache slots one cycle may write beyond the committed length (target or head)."""
        if self.method == "tree":
            return max(self.total_tokens, min(self.top_k, 1 << 20) * (self.depth + 1)) + self.depth + 2
        return self.k + 2
