"""The draft layer families: one table of what each family of decoder layer means.

A head's ``layer_family`` (``MSDDraftConfig.layer_family``; its target adapter's
``draft_layer_family``) picks the transformers decoder-layer class its layers are built
from and the conventions that come with it. The head (``draft/model.py``, ``msd3.py``),
its config, the hub's formats (``hub/reference.py``, ``hub/eagle3.py``, ``hub/vllm.py``)
and serving (``serving/vllm_models.py``) read this table instead of comparing names, so
a third family is one more entry here (and in the config's ``layer_family`` choices).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLDecoderLayer


@dataclass(frozen=True)
class LayerFamily:
    name: str
    #: the transformers class every decoder layer of the head is
    decoder_layer: type
    #: whether its attention's q/k/v projections carry a bias (Qwen2) or not (Llama);
    #: EAGLE-3 layers in SGLang and vLLM have none
    qkv_bias: bool
    #: the default of ``first_layer_input_norm``: what the released heads of the family do
    #: (the EAGLE convention of the LLaVA heads: the fused input enters the first attention
    #: un-normalised; the Qwen2-VL heads normalise it)
    first_layer_input_norm: bool
    #: the layer derives head_dim from hidden_size // num_attention_heads (no head_dim field)
    derived_head_dim: bool
    #: its targets' positions are M-RoPE ids, so a released head of the family takes the
    #: target's sections when its config.json names none
    mrope: bool
    #: how the released code of the family is named in messages
    released_code: str


LAYER_FAMILIES: dict[str, LayerFamily] = {
    family.name: family for family in (
        LayerFamily("llama", LlamaDecoderLayer, qkv_bias=False, first_layer_input_norm=False,
                    derived_head_dim=False, mrope=False, released_code="LLaVA"),
        LayerFamily("qwen2", Qwen2VLDecoderLayer, qkv_bias=True, first_layer_input_norm=True,
                    derived_head_dim=True, mrope=True, released_code="Qwen2-VL"),
    )
}


def layer_family(name: str) -> LayerFamily:
    """The family named ``name`` (a config's ``layer_family``)."""
    if name not in LAYER_FAMILIES:
        raise ValueError(f"layer_family={name!r} is not a draft layer family; use one of {sorted(LAYER_FAMILIES)}")
    return LAYER_FAMILIES[name]


def family_with_qkv_bias(bias: bool) -> LayerFamily:
    """The family whose layers have (or lack) q/k/v biases: how weights without a recorded
    family (an EAGLE-3 folder of another tool) tell it."""
    return next(f for f in LAYER_FAMILIES.values() if f.qkv_bias == bias)
