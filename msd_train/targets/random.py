"""Offline pieces for randomly initialised targets (tests, benchmarks of published shapes):
nothing here downloads anything.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

WORDS = (
    "the a an is are what colour shape red green blue circle square how many image "
    "describe this that there one two three four it of and in on to you assistant user "
    "system helpful hello world python function returns value"
).split()


def char_tokenizer(specials: list[str], bos: str | None, eos: str, template: str) -> PreTrainedTokenizerFast:
    """A character-and-word level tokenizer: small, exact round trip of ASCII text."""
    vocab = {}
    for tok in specials + [chr(i) for i in range(32, 127)] + ["\n"] + ["Ġ" + w for w in WORDS] + WORDS:
        vocab.setdefault(tok, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=specials[0], ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token=specials[0], bos_token=bos, eos_token=eos,
        pad_token=specials[0], additional_special_tokens=[s for s in specials if s not in (specials[0], bos, eos)],
    )
    fast.chat_template = template
    return fast
