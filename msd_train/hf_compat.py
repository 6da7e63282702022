"""Names that moved inside transformers' supported range (a leaf: imports transformers only).

transformers 5.24 renamed the KV-cache argument of models and decoder layers, and the
cache field of their outputs, from ``past_key_values`` to ``cache`` (the old argument is
accepted with a deprecation until 5.40; output classes rename the old keyword on
construction, so a ``ModelOutput`` subclass declaring a ``past_key_values`` field no
longer builds). The project passes the name the installed version takes and reads outputs
through :func:`output_cache`, so one code path serves the whole declared range.
"""

from __future__ import annotations

import inspect

from transformers.models.llama.modeling_llama import LlamaDecoderLayer

#: the keyword transformers' models and decoder layers take their KV cache under
CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaDecoderLayer.forward).parameters else "past_key_values"


def cache_kwargs(cache) -> dict:
    """``{CACHE_ARG: cache}``, to splat into a transformers model or layer call."""
    return {CACHE_ARG: cache}


def output_cache(out):
    """The KV cache of a transformers model output, under either field name."""
    return getattr(out, "cache", None) if CACHE_ARG == "cache" else out.past_key_values
