"""When generation ends: EOS, stop strings, ``max_new_tokens``.

Stopping is a function of the generated token sequence alone, so speculative and plain
decoding stop at the same token whenever they generate the same tokens. A block of
tokens committed by one verification is scanned token by token: the first stopping
event wins, and nothing after it is returned.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StopCriteria:
    max_new_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    #: generation ends with the token that completes one of these strings (kept)
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


def find_stop(tokens: list[int], start: int, criteria: StopCriteria, tokenizer=None) -> tuple[int, str] | None:
    """First stop in ``tokens[start:]`` (the tokens before ``start`` were already checked).

    Returns ``(n, reason)``: keep ``tokens[:n]``; reason is ``eos`` (the EOS token is the
    last one kept), ``stop_string`` (the last kept token completes the string) or
    ``max_new_tokens``. None when generation goes on.
    """
    check_strings = bool(criteria.stop_strings) and tokenizer is not None
    if check_strings:  # one decode of the whole text decides whether to look closer
        text = tokenizer.decode(tokens, skip_special_tokens=False)
        check_strings = any(s in text for s in criteria.stop_strings)
    for i in range(start, len(tokens)):
        if tokens[i] in criteria.eos_token_ids:
            return i + 1, "eos"
        if check_strings:
            text = tokenizer.decode(tokens[: i + 1], skip_special_tokens=False)
            if any(s in text for s in criteria.stop_strings):
                return i + 1, "stop_string"
        if i + 1 >= criteria.max_new_tokens:
            return i + 1, "max_new_tokens"
    return None
