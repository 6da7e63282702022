"""The MSD draft head.

    x_t   = fc(concat(e_{t+1}, h_t))                  fusion (embedding half first)
    x_t   = v_t            where t is a visual slot   decoupling (config.decouple_visual)
    f_hat = layers(x)                                 no final norm
    logits = target.lm_head(f_hat)                    computed by callers

`e` are the target's input embeddings (projector outputs at image positions), `h` the
target's last-layer post-norm hidden states. The head stores no embedding table and no
lm_head: both stay with the target.
"""

from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding
from transformers.utils import ModelOutput

from msd_train.draft.config import MSDDraftConfig
from msd_train.draft.families import layer_family
from msd_train.draft.head import DraftHead, HeadCard, head_class_of_config, pair, register_head, saved_model_type
from msd_train.draft.positions import draft_position_ids
from msd_train.draft.vocabulary import ReadsTargetLMHead, VocabSubset
from msd_train.hf_compat import cache_kwargs
from msd_train.targets.protocol import TargetProtocol

# Attention implementations that honour an arbitrary 4-D additive mask exactly (tree
# drafting needs it); flash-attention variants only take padding masks.
_SUPPORTED_ATTENTION = ("sdpa", "eager")


@dataclass
class MSDDraftOutput(ModelOutput):
    """Output of `MSDDraftModel.forward`.

    last_hidden_state: [B, T, H] predicted next features `f_hat_{t+1}`; logits are
        `target.lm_head(last_hidden_state)`.
    cache: the draft's KV cache (a `DynamicCache`) when one was used. The field is not
        called ``past_key_values``: transformers >= 5.24 renames that keyword on every
        ModelOutput's construction (see ``msd_train.hf_compat``).
    layer_input: [B, T, H] the first layer's input (fused, then visual-replaced);
        only with `return_layer_input=True`.
    """

    last_hidden_state: torch.Tensor | None = None
    cache: Cache | None = None
    layer_input: torch.Tensor | None = None


def align_inputs(
    config: MSDDraftConfig,
    inputs_embeds: torch.Tensor,
    hidden_states: torch.Tensor,
    visual_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Turn one target pass over L tokens into the draft's L-1 training inputs.

    Draft position t pairs `h_t` with the next token's embedding `e_{t+1}` and is trained
    to predict `h_{t+1}` (hence token t+2 through the lm_head):
        embeds = E[:, 1:]        hidden = Hs[:, :-1]
    Decoupling puts the raw visual embeddings at the image block, whose draft slots
    depend on `config.visual_offset`:
        "released": replace_mask[t] = V[t+1], raw[t] = E[t+1]  (block at p-1 .. p+N-2)
        "paper":    replace_mask[t] = V[t],   raw[t] = E[t]    (block at p .. p+N-1)
    With `decouple_visual=False` (or no image) `replace_mask` is all False.
    Position ids for the draft are the target's ids of tokens 0..L-2
    (`position_ids[..., :-1]`), i.e. those of `h_t`.

    Args:
        inputs_embeds: [B, L, H] target input embeddings E.
        hidden_states: [B, L, H] target last-layer post-norm hidden states Hs.
        visual_mask: [B, L] bool, True at image-token positions; None for text only.
    Returns:
        (embeds, hidden, replace_mask, raw), each of length L-1; replace_mask is bool [B, L-1].
    """
    embeds, hidden = pair(inputs_embeds, hidden_states)
    if visual_mask is None or not config.decouple_visual:
        replace_mask = torch.zeros(embeds.shape[:2], dtype=torch.bool, device=embeds.device)
        return embeds, hidden, replace_mask, embeds
    visual_mask = visual_mask.bool()
    if config.visual_offset == "released":
        return embeds, hidden, visual_mask[:, 1:], inputs_embeds[:, 1:]
    return embeds, hidden, visual_mask[:, :-1], inputs_embeds[:, :-1]


def crop_cache(cache: Cache, length: int) -> Cache:
    """Trim a KV cache back to its first `length` positions (the committed prefix).

    Decoding appends draft-tree nodes to the cache and must drop the rejected ones. Note
    that in transformers 5.23 `Cache.crop(n)` takes a *negative* count of positions to
    remove (a positive `n` raises), hence this helper. Returns the same cache object.
    """
    surplus = cache.get_seq_length() - length
    if surplus < 0:
        raise ValueError(f"cannot crop a cache of length {cache.get_seq_length()} up to {length}")
    if surplus > 0:
        cache.crop(-surplus)
    return cache


def attention_bias(
    attention_mask: torch.Tensor | None,
    batch_size: int,
    query_length: int,
    past_length: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Additive attention bias [B, 1, T, past+T]: 0 where allowed, dtype-min elsewhere.

    Query t (absolute position past+t) may attend key s iff s <= past+t (causal) and,
    for a 2-D padding mask [B, past+T], key s is not padding. A 4-D mask is returned as
    is (a bool 4-D mask, True = attend, is converted): tree drafting builds its own.
    """
    min_value = torch.finfo(dtype).min
    if attention_mask is not None and attention_mask.ndim == 4:
        if attention_mask.dtype == torch.bool:
            return torch.zeros(attention_mask.shape, dtype=dtype, device=device).masked_fill(~attention_mask, min_value)
        return attention_mask.to(dtype)
    kv_length = past_length + query_length
    query_positions = past_length + torch.arange(query_length, device=device)
    allowed = torch.arange(kv_length, device=device)[None, :] <= query_positions[:, None]
    allowed = allowed[None, None].expand(batch_size, 1, query_length, kv_length)
    if attention_mask is not None:
        if attention_mask.shape != (batch_size, kv_length):
            raise ValueError(
                f"2-D attention_mask must be [batch, past + new] = [{batch_size}, {kv_length}], "
                f"got {list(attention_mask.shape)}"
            )
        allowed = allowed & attention_mask.bool()[:, None, None, :]
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return bias.masked_fill(~allowed, min_value)


class NonFiniteWeightsError(ValueError):
    """A head whose weights hold NaN or inf: it would draft garbage that verification
    silently rejects (or, for NaN logits, accepts); the message names the tensors."""


def non_finite_tensors(named) -> list[str]:
    """Names of the floating-point tensors in ``named`` ((name, tensor) pairs) that hold a
    NaN or an inf, each with how many of its numbers are not finite."""
    bad = []
    for name, t in named:
        if t.is_floating_point():
            n = int((~torch.isfinite(t)).sum())
            if n:
                bad.append(f"{name} ({n} of {t.numel()})")
    return bad


def check_finite(named, where: str) -> None:
    """Raise :class:`NonFiniteWeightsError` naming the non-finite tensors of ``named``."""
    bad = non_finite_tensors(named)
    if bad:
        shown = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        raise NonFiniteWeightsError(
            f"{where}: the head's weights are not finite (NaN or inf in {shown}); it cannot draft. Use another "
            "export (RUN_DIR/stageN/best, an earlier checkpoint exported with scripts/export.py) or retrain")


@register_head
class MSDDraftModel(ReadsTargetLMHead, DraftHead):
    """MSD draft head: fusion `fc`, decoupled visual inputs, transformers decoder layers.

    Build with `MSDDraftModel(MSDDraftConfig.from_target_config(target.config, name))`;
    export with `save_pretrained(dir)` (config.json + model.safetensors); load with
    `MSDDraftModel.from_pretrained(dir)`.
    """

    architecture = "msd"
    config_class = MSDDraftConfig
    supports_gradient_checkpointing = True
    rollout_reads_cache = True
    _skip_keys_device_placement = ["past_key_values"]

    def __init__(self, config: MSDDraftConfig):
        super().__init__(config)
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=config.fc_bias)
        layer_class = layer_family(config.layer_family).decoder_layer
        self.layers = nn.ModuleList(layer_class(config, layer_idx=i) for i in range(config.num_hidden_layers))
        if not config.first_layer_input_norm:
            # EAGLE convention: the fused vector enters the first attention un-normalised.
            self.layers[0].input_layernorm = nn.Identity()
        rotary_class = Qwen2VLRotaryEmbedding if config.uses_mrope else LlamaRotaryEmbedding
        self.rotary_emb = rotary_class(config)
        self.gradient_checkpointing = False
        self._vocab: VocabSubset | None = None  # decode time: see restrict_vocabulary
        self.post_init()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """Loads the class the saved config names (``MSDDraftModel.from_pretrained`` opens every
        head architecture: an ``msd3`` folder gives an ``MSD3DraftModel``), refusing a head
        with NaN or inf weights (:class:`NonFiniteWeightsError`) rather than letting it draft."""
        if cls is MSDDraftModel:
            other = head_class_of_config(saved_model_type(pretrained_model_name_or_path, **kwargs))
            if other is not None and other is not cls:
                return other.from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        out = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        model = out[0] if isinstance(out, tuple) else out
        check_finite(model.state_dict().items(), str(pretrained_model_name_or_path))
        return out

    def target_inputs(self, features, target: TargetProtocol | None = None,
                      position_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor | None]:
        """`forward`'s inputs over one target pass of L tokens, as keyword arguments.

        ``features`` holds ``inputs_embeds``, ``hidden_states``, ``visual_mask`` and
        ``position_ids`` (a ``msd_train.targets.Features``). Returns the L-1 aligned pairs
        with their decoupled visual slots (`align_inputs`) at the head's own position ids
        (`draft_position_ids`: the config's convention), so every caller (training,
        validation, decoding) feeds the head the same way: ``draft(**draft.target_inputs(f))``.
        ``position_ids``: the head's own ids of the L tokens, used as given.
        """
        embeds, hidden, replace, raw = align_inputs(
            self.config, features.inputs_embeds, features.hidden_states, features.visual_mask)
        pos = position_ids
        if pos is None and features.position_ids is not None:
            pos = draft_position_ids(self.config, features.position_ids)
        return {"input_embeds": embeds, "hidden_states": hidden, "replace_mask": replace, "raw_embeds": raw,
                "position_ids": None if pos is None else pos[..., :-1]}

    def visual_slots(self, features) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The decoupled block where ``visual_offset`` puts it (see ``align_inputs``)."""
        if features.visual_mask is None or self.config.visual_offset == "released":
            return super().visual_slots(features)
        return features.visual_mask[:, :-1].bool(), features.inputs_embeds[:, :-1]

    def fuse(
        self,
        input_embeds: torch.Tensor,
        hidden_states: torch.Tensor,
        replace_mask: torch.Tensor | None = None,
        raw_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """First-layer input: `fc(concat(e, h))`, replaced by `raw_embeds` where
        `replace_mask` is True if the config decouples visual tokens."""
        dtype = self.fc.weight.dtype
        x = self.fc(torch.cat([input_embeds.to(dtype), hidden_states.to(dtype)], dim=-1))
        if self.config.decouple_visual and replace_mask is not None:
            if raw_embeds is None:
                raise ValueError("replace_mask was given without raw_embeds (the visual embeddings)")
            x = torch.where(replace_mask[..., None].bool(), raw_embeds.to(x.dtype), x)
        return x

    def forward(
        self,
        input_embeds: torch.Tensor,
        hidden_states: torch.Tensor,
        replace_mask: torch.Tensor | None = None,
        raw_embeds: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool = False,
        return_layer_input: bool = False,
    ) -> MSDDraftOutput:
        """Predict the next target features for T new draft positions.

        Args:
            input_embeds: [B, T, H] embeddings of the next tokens `e_{t+1}`.
            hidden_states: [B, T, H] target (or draft-predicted) features `h_t`.
            replace_mask, raw_embeds: [B, T] bool and [B, T, H]: positions whose layer
                input is the raw visual embedding (see `align_inputs`).
            position_ids: [B, T] or, with M-RoPE, [3, B, T]; default `past + arange(T)`.
            attention_mask: None (causal), 2-D padding mask [B, past+T] (causal is
                added), or 4-D additive mask [B, 1, T, past+T] used as is (tree drafting).
            past_key_values: a cache to read and extend; with `use_cache=True` and none
                given, a new `DynamicCache` is created.
            return_layer_input: also return the first layer's input.
        Returns:
            MSDDraftOutput(last_hidden_state [B, T, H], cache, layer_input).
        """
        attn_impl = self.config._attn_implementation
        if attn_impl not in _SUPPORTED_ATTENTION:
            raise ValueError(
                f"MSD draft heads need an attention implementation that takes 4-D masks: "
                f"one of {_SUPPORTED_ATTENTION}, got {attn_impl!r}"
            )
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        batch_size, query_length = input_embeds.shape[:2]
        past_length = past_key_values.get_seq_length() if past_key_values is not None else 0

        x = self.fuse(input_embeds, hidden_states, replace_mask, raw_embeds)
        layer_input = x
        position_ids = self._position_ids(position_ids, batch_size, query_length, past_length, x.device)
        position_embeddings = self.rotary_emb(x, position_ids)
        # With no mask, sdpa's own causal path is exact when there is no past or a single
        # query, and lets it pick a fused kernel; every other case gets an explicit bias.
        if attention_mask is None and (query_length == 1 or (past_length == 0 and attn_impl == "sdpa")):
            bias = None
        else:
            bias = attention_bias(attention_mask, batch_size, query_length, past_length, x.dtype, x.device)

        for layer in self.layers:
            x = layer(
                x,
                attention_mask=bias,
                position_embeddings=position_embeddings,
                use_cache=use_cache,
                **cache_kwargs(past_key_values),
            )
        return MSDDraftOutput(
            last_hidden_state=x,
            cache=past_key_values,
            layer_input=layer_input if return_layer_input else None,
        )

    # ----- the head interface (msd_train.draft.head; logits from ReadsTargetLMHead) -----------

    @classmethod
    def card(cls, config: MSDDraftConfig, num_parameters: int | None = None, dtype: str | None = None) -> HeadCard:
        summary = ("A draft head for lossless speculative decoding of a multimodal model: MSD (Lin et al., "
                   "arXiv 2505.14260), an EAGLE-style head that fuses the target's last hidden state with the next "
                   "token's embedding and treats visual tokens apart from text tokens. It is not a model on its own: "
                   "it uses the target's embedding table and `lm_head`, and the target verifies every drafted token, "
                   "so outputs are exactly the target's. Trained with msd-train.")
        rows = [
            ("layer family", config.layer_family),
            ("decoder layers", config.num_hidden_layers),
            ("hidden size", config.hidden_size),
            ("intermediate size", config.intermediate_size),
            ("attention heads (KV heads)", f"{config.num_attention_heads} ({config.num_key_value_heads})"),
            ("fc bias", config.fc_bias),
            ("input norm on the first layer", config.first_layer_input_norm),
            ("visual decoupling", config.decouple_visual),
            ("visual offset", config.visual_offset),
            ("M-RoPE sections", config.mrope_section),
            ("parameters", f"{num_parameters:,}" if num_parameters else None),
            ("dtype", dtype),
        ]
        return HeadCard(name="MSD draft head", summary=summary, rows=rows)
