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


def rope_cos_sin(rotary_emb, x, position_ids, mrope_section=None):
    """``rotary_emb(x, position_ids)`` as one (cos, sin) per position, (B, L, D): Qwen2-VL's M-RoPE
    embedding returns one per position-id row, (3, B, L, D), in the older transformers releases (the
    attention then picks each section's row); newer ones pick them inside. Picked here the same way
    (the sections doubled over the two halves of D), so ``apply_rotary_pos_emb`` reads either."""
    cos, sin = rotary_emb(x, position_ids)
    if cos.dim() == 4 and mrope_section:
        split = list(mrope_section) * 2
        cos, sin = (_rows_by_section(t, split) for t in (cos, sin))
    return cos, sin


def _rows_by_section(t, split):
    """Section i of the last dim taken from row i % 3 of ``t`` (3, B, L, D)."""
    import torch

    return torch.cat([part[i % 3] for i, part in enumerate(t.split(split, dim=-1))], dim=-1)
