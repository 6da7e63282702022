"""The MSD-3 head: EAGLE-3's architecture with MSD's decoupled visual tokens.

    g_t    = fc(concat(a^{l1}_t, .., a^{lk}_t))         inputs of k target layers, no bias
    s_t    = midlayer(e_{t+1}, g_t)                      attention reads
                                                         cat(input_layernorm(e), hidden_norm(g)), 2H wide
    logits = lm_head(norm(s_t))                         over the draft vocabulary,
                                                         target id = i + d2t[i]

A drafting step reads the head's own previous state ``s`` in place of ``g``. At image
positions ``e`` is the target's visual embedding (the projector output) with
``decouple_visual``, the image placeholder token's embedding without (plain EAGLE-3).

The training-time test runs the head ``ttt_steps`` times over a sequence
(``DraftHead.unroll``): exactly what a chain drafted from each anchor sees.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

from msd_train.draft.config import MSD3DraftConfig
from msd_train.draft.families import layer_family
from msd_train.draft.head import DraftHead, HeadCard, pair, register_head
from msd_train.draft.model import (
    _SUPPORTED_ATTENTION,
    MSDDraftOutput,
    attention_bias,
    check_finite,
)
from msd_train.draft.positions import draft_position_ids
from msd_train.draft.vocabulary import on_target_ids
from msd_train.hf_compat import cache_kwargs
from msd_train.targets.protocol import TargetProtocol


class _Replayed:
    """A cache for one checkpointed layer call: the first call extends ``cache``; the
    recomputation in the backward pass, when later steps have extended it further, sees
    the keys and values the first call saw, and extends nothing."""

    def __init__(self, cache):
        self.cache, self.past = cache, None

    def update(self, keys, values, layer_idx, *args, **kwargs):
        if self.cache is None:
            return keys, values
        if self.past is None:
            n = self.cache.get_seq_length(layer_idx)
            out = self.cache.update(keys, values, layer_idx, *args, **kwargs)
            self.past = (out[0][..., :n, :], out[1][..., :n, :])
            return out
        return torch.cat([self.past[0], keys], -2), torch.cat([self.past[1], values], -2)


@register_head
class MSD3DraftModel(DraftHead):
    architecture = "msd3"
    config_class = MSD3DraftConfig
    supports_gradient_checkpointing = True
    has_draft_vocabulary = True

    def __init__(self, config: MSD3DraftConfig):
        super().__init__(config)
        self.gradient_checkpointing = False
        hidden = config.hidden_size
        self.fc = nn.Linear(len(config.feature_layers) * hidden, hidden, bias=False)
        layer = layer_family(config.layer_family).decoder_layer(config, layer_idx=0)
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):  # the attention reads [embedding, hidden]: 2H wide
            old = getattr(attn, name)
            setattr(attn, name, nn.Linear(2 * hidden, old.out_features, bias=old.bias is not None))
        layer.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.midlayer = layer
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(config.target_vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        rotary_class = Qwen2VLRotaryEmbedding if config.uses_mrope else LlamaRotaryEmbedding
        self.rotary_emb = rotary_class(config)
        self.post_init()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """As ``MSDDraftModel.from_pretrained``: a head with NaN or inf weights is refused."""
        out = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        check_finite((out[0] if isinstance(out, tuple) else out).state_dict().items(), str(pretrained_model_name_or_path))
        return out

    def set_vocabulary(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(f"vocabulary maps of shapes {list(d2t.shape)}, {list(t2d.shape)} do not fit a head "
                             f"with {self.d2t.shape[0]} draft and {self.t2d.shape[0]} target ids")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @property
    def draft_ids(self) -> torch.Tensor:
        """(N,) the target id of every draft id."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    # ----- the head interface ------------------------------------------------------------

    @property
    def feature_layers(self) -> list[int]:
        return list(self.config.feature_layers)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(features.to(self.fc.weight.dtype))

    def embeddings(self, features, target: TargetProtocol | None = None) -> torch.Tensor:
        """The embedding stream over a target pass: the target's input embeddings (visual
        embeddings at image positions), or with ``decouple_visual`` off the placeholder's."""
        embeds = features.inputs_embeds
        if self.config.decouple_visual or features.visual_mask is None:
            return embeds
        if target is None:  # (not asked whether the pass has images: that would be a host sync per batch)
            raise ValueError("an msd3 head with decouple_visual=false needs the target (its image placeholder "
                             "embedding) to read a target pass")
        placeholder = target.embed_tokens.weight[target.image_token_id].to(embeds.dtype)
        return torch.where(features.visual_mask[..., None].bool(), placeholder, embeds)

    def target_inputs(self, features, target: TargetProtocol | None = None,
                      position_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor | None]:
        """The paired inputs (``pair``) with the k layers' features fused by ``fc``."""
        embeds, states = pair(self.embeddings(features, target), self.head_features(features))
        pos = position_ids
        if pos is None and features.position_ids is not None:
            pos = draft_position_ids(self.config, features.position_ids)
        return {"input_embeds": embeds, "hidden_states": self.project(states),
                "position_ids": None if pos is None else pos[..., :-1]}

    def forward(self, input_embeds, hidden_states, position_ids=None, attention_mask=None, past_key_values=None,
                use_cache: bool = False) -> MSDDraftOutput:
        """One pass of the layer over T positions; ``hidden_states`` are H wide (fused
        target features, or the head's own states). Masks and caches as MSDDraftModel's."""
        attn_impl = self.config._attn_implementation
        if attn_impl not in _SUPPORTED_ATTENTION:
            raise ValueError(f"MSD draft heads need one of {_SUPPORTED_ATTENTION} attention, got {attn_impl!r}")
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        batch_size, query_length = input_embeds.shape[:2]
        past_length = past_key_values.get_seq_length() if past_key_values is not None else 0
        layer = self.midlayer
        h = hidden_states.to(self.fc.weight.dtype)
        x = torch.cat([layer.input_layernorm(input_embeds.to(h.dtype)), layer.hidden_norm(h)], dim=-1)
        position_ids = self._position_ids(position_ids, batch_size, query_length, past_length, h.device)
        position_embeddings = self.rotary_emb(h, position_ids)
        if attention_mask is None and (query_length == 1 or (past_length == 0 and attn_impl == "sdpa")):
            bias = None
        else:
            bias = attention_bias(attention_mask, batch_size, query_length, past_length, h.dtype, h.device)
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            # The training-time test runs the layer ttt_steps times per batch: recomputing it in
            # the backward pass keeps each step's layer inputs, not its attention and MLP activations.
            h = self._gradient_checkpointing_func(self._layer, x, h, bias, position_embeddings, use_cache,
                                                  _Replayed(past_key_values))
        else:
            h = self._layer(x, h, bias, position_embeddings, use_cache, past_key_values)
        return MSDDraftOutput(last_hidden_state=h, cache=past_key_values)

    def _layer(self, x, h, bias, position_embeddings, use_cache, cache):
        layer = self.midlayer
        a, _ = layer.self_attn(hidden_states=x, attention_mask=bias, position_embeddings=position_embeddings,
                               use_cache=use_cache, **cache_kwargs(cache))
        h = h + a
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def draft_logits(self, states: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary."""
        return self.lm_head(self.norm(states))

    def logits(self, states: torch.Tensor, target: TargetProtocol) -> torch.Tensor:
        """Draft-vocabulary logits put at their target ids; -inf at every other id."""
        small, ids = self.logits_on_ids(states, target)
        return on_target_ids(small, ids, self.t2d.shape[0])

    def logits_on_ids(self, states: torch.Tensor, target: TargetProtocol) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft-vocabulary logits and the target ids they stand for."""
        return self.draft_logits(states.to(self.lm_head.weight.dtype)).to(target.dtype), self.draft_ids

    # ----- the model card -------------------------------------------------------------------

    @classmethod
    def card(cls, config: MSD3DraftConfig, num_parameters: int | None = None, dtype: str | None = None) -> HeadCard:
        visual = ("the target's visual embeddings (the projector's outputs) at image positions, as MSD does"
                  if config.decouple_visual else
                  "the image placeholder token's embedding at image positions (plain EAGLE-3, no visual decoupling)")
        summary = (
            "A draft head for lossless speculative decoding of a multimodal model: an msd3 head, EAGLE-3's "
            "architecture (Li et al., arXiv 2503.01840)"
            + (" with MSD's decoupled visual tokens (Lin et al., arXiv 2505.14260)" if config.decouple_visual else "")
            + f". It fuses the inputs of {len(config.feature_layers)} target layers "
            f"({', '.join(map(str, config.feature_layers))}), runs one decoder layer over them and the next token's "
            f"embedding, and predicts tokens with its own `lm_head` over a draft vocabulary of "
            f"{config.draft_vocab_size} target tokens; it was trained with EAGLE-3's training-time test "
            f"({config.ttt_steps} steps on its own outputs) and reads {visual}. It is not a model on its own: it "
            "uses the target's embedding table and layer features, and the target verifies every drafted token, "
            "so outputs are exactly the target's. Trained with msd-train.")
        decoupling = ("on: the projector's outputs at image positions" if config.decouple_visual
                      else "off: the image placeholder's embedding at image positions (plain EAGLE-3)")
        rows = [
            ("architecture", "msd3 (EAGLE-3's head" + (" with MSD's visual decoupling)" if config.decouple_visual
                                                       else ", visual decoupling off)")),
            ("fused target layers", f"inputs of layers {', '.join(map(str, config.feature_layers))}"
             + (f" of {config.target_num_layers}" if config.target_num_layers else "")),
            ("draft vocabulary", f"{config.draft_vocab_size} tokens"
             + (f" of the target's {config.target_vocab_size}" if config.target_vocab_size else "")
             + " (`d2t`/`t2d` saved with the head)"),
            ("training-time test steps", f"{config.ttt_steps} (step i's loss weighted {config.ttt_decay}^i)"),
            ("visual decoupling", decoupling),
            ("draft positions", config.draft_positions if config.mrope_section else None),
            ("layer family", config.layer_family),
            ("hidden size", config.hidden_size),
            ("intermediate size", config.intermediate_size),
            ("attention heads (KV heads)", f"{config.num_attention_heads} ({config.num_key_value_heads})"),
            ("M-RoPE sections", config.mrope_section),
            ("parameters", f"{num_parameters:,}" if num_parameters else None),
            ("dtype", dtype),
        ]
        usage = ["", "# the EAGLE-3 layout (midlayer.*, fc, norm, lm_head, d2t, t2d) that EAGLE-3 and SpecForge read",
                 "from msd_train.hub.eagle3 import export_eagle3", "export_eagle3(head, \"eagle3-head\")"]
        return HeadCard(name="MSD-3 draft head (EAGLE-3 style)", summary=summary, rows=rows, tags=("eagle3",),
                        usage=usage)

    @classmethod
    def card_training(cls, draft: dict) -> str | None:
        return "- head: msd3, " + ", ".join(f"{k}={draft[k]}" for k in (
            "ttt_steps", "ttt_decay", "decouple_visual", "feature_layers", "draft_vocab_size", "draft_positions")
            if draft.get(k) is not None)
