"""Decoding settings, and the drafter they ask for."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from msd_train.checks import METHODS, check_decoding  # noqa: F401  (METHODS: msd_train.decoding's)
from msd_train.decoding.drafter import HeadDrafter
from msd_train.decoding.ensemble import EnsembleDrafter
from msd_train.decoding.sampling import SamplingParams
from msd_train.draft.vocabulary import COUNTS_FILE, most_frequent
from msd_train.errors import ConfigError


@dataclass
class DecodeConfig:
    method: str = "tree"  # tree (EAGLE-2 dynamic tree) | chain | ar (plain decoding)
    #: tree: frontier expansions after the root's children (EAGLE-2's convention), so a
    #: path holds up to depth + 1 draft tokens
    depth: int = 5
    top_k: int = 10  # tree: frontier width and children per expanded node
    total_tokens: int = 60  # tree: nodes verified per cycle, root included
    k: int = 5  # chain: draft tokens per cycle
    #: chain: stop drafting a cycle once the chain's probability under the head would fall
    #: below this (0: always k tokens); a host read per draft token, for targets whose
    #: verification costs more per token verified (a CPU), see draft_chain
    draft_min_prob: float = 0.0
    max_new_tokens: int = 64
    stop_strings: tuple[str, ...] = ()
    #: None: the target's own EOS ids (generation config, else tokenizer); () never stops on EOS
    eos_token_ids: tuple[int, ...] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    #: per-phase times in ``Generation.cycles`` (CUDA events on a GPU: no synchronisation
    #: per phase, one at the end); off, the cycle runs with no timing at all
    timing: bool = False
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


def use_draft_vocabulary(draft, target, size: int | None) -> None:
    """Restrict ``draft`` to the ``size`` target tokens its training data used most (its
    saved token counts), or lift the restriction (None). ``size`` None on a head trained
    over a draft vocabulary (``draft.train_vocab``) means that vocabulary; the target's
    vocabulary size lifts it. Idempotent: a benchmark calls it once per prompt."""
    if draft is None:
        return
    if size is None:
        size = draft.config.train_vocab if draft.supports_restrict_vocabulary else None
    if size is not None and size >= target.vocab_size:
        size = None
    restrict = draft.restrict_vocabulary if draft.supports_restrict_vocabulary else None  # a declared capability
    if size is None:
        if restrict is not None:
            restrict(target, None)
        return
    if restrict is None:
        own = getattr(getattr(draft, "config", None), "draft_vocab_size", None)
        raise ValueError(f"an {getattr(draft, 'architecture', '')} head drafts over the {own}-token vocabulary it was "
                         f"trained with (draft.draft_vocab_size at training); decoding.draft_vocab is for msd heads")
    counts = getattr(draft, "token_counts", None)
    if counts is None:
        raise ConfigError(
            f"decoding.draft_vocab={size} needs the head's token counts ({COUNTS_FILE} in its folder, which "
            f"training writes beside every export); this head has none: write them with "
            f"python scripts/count_tokens.py draft=HEAD_DIR data=... (its training data), or drop decoding.draft_vocab")
    restrict(target, most_frequent(counts, size))


def build_drafter(draft, config: DecodeConfig, captions: list[str] | None = None) -> HeadDrafter | None:
    """The drafter ``config`` asks for: None for plain decoding, one head, or one head over
    several input variants. ``captions`` (one per image) are read only by variant C."""
    if config.method == "ar" or draft is None:
        return None
    if config.ensemble is None:
        return HeadDrafter(draft)
    return EnsembleDrafter(draft, config.variants, config.ensemble, config.tabed_window, captions)
