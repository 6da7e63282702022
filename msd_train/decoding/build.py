"""Settings -> the objects that decode, in one place: ``build_drafter`` makes the drafter a
``DecodeConfig`` asks for (none for plain decoding, one head, one head over several input
variants, or a block head's ``BlockDrafter``), over the vocabulary it asks for
(``use_draft_vocabulary``), after asking the head whether it can honour the method
(``DraftHead.decoding_methods``).

What a head can do is asked here and nowhere else in the decoder: whether it can be restricted
to a draft vocabulary (its declared ``supports_restrict_vocabulary``, msd heads), and then which
one it trained over (``config.train_vocab``).
"""

from __future__ import annotations

from msd_train.checks import method_refusal
from msd_train.decoding.block import BlockDrafter
from msd_train.decoding.config import DecodeConfig
from msd_train.decoding.drafter import Drafter, HeadDrafter
from msd_train.decoding.ensemble import EnsembleDrafter
from msd_train.draft.vocabulary import COUNTS_FILE, most_frequent
from msd_train.errors import ConfigError
from msd_train.formatting import with_article
from msd_train.targets import TargetProtocol


def build_drafter(target: TargetProtocol, draft, config: DecodeConfig, captions: list[str] | None = None
                  ) -> Drafter | None:
    """The drafter ``config`` asks for, its head restricted to ``config.draft_vocab``: None
    for plain decoding (or no head), one head, or one head over several input variants.
    ``captions`` (one per image) are read only by variant C."""
    if config.method == "ar" or draft is None:
        return None
    check_method(draft, config)
    use_draft_vocabulary(draft, target, config.draft_vocab)
    if config.method == "block":
        return BlockDrafter(draft)
    if config.ensemble is None:
        return HeadDrafter(draft)
    return EnsembleDrafter(draft, config.variants, config.ensemble, config.tabed_window, captions)


def check_method(draft, config: DecodeConfig) -> None:
    """``config.method`` against what ``draft``'s drafter honours (``ConfigError`` naming the fix)."""
    why = method_refusal(getattr(draft, "architecture", "msd"), getattr(draft, "decoding_methods", ("tree", "chain")),
                         config.method, config.ensemble)
    if why is not None:
        raise ConfigError(why)


def use_draft_vocabulary(draft, target: TargetProtocol, size: int | None) -> None:
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
        raise ValueError(f"{with_article(getattr(draft, 'architecture', ''))} head drafts over the {own}-token vocabulary it was "
                         f"trained with (draft.draft_vocab_size at training); decoding.draft_vocab is for msd heads")
    counts = getattr(draft, "token_counts", None)
    if counts is None:
        raise ConfigError(
            f"decoding.draft_vocab={size} needs the head's token counts ({COUNTS_FILE} in its folder, which "
            f"training writes beside every export); this head has none: write them with "
            f"python scripts/count_tokens.py draft=HEAD_DIR data=... (its training data), or drop decoding.draft_vocab")
    restrict(target, most_frequent(counts, size))
