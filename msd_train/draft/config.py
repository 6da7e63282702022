"""Configuration of an MSD draft head.

The config carries everything needed to rebuild the head (layer sizes, RoPE, layer
family, fusion and decoupling conventions) plus the identity of the target it was
trained for. It is also handed directly to transformers' decoder-layer classes, so it
holds the few attributes those classes read (see the class attributes below).
"""

from typing import Literal

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters

from msd_train.draft.families import layer_family as family_of


@strict
class MSDDraftConfig(PreTrainedConfig):
    r"""
    Config of an MSD draft head: `fc(concat(e_{t+1}, h_t))`, then `num_hidden_layers`
    decoder layers; the target's embedding table and lm_head are used, never stored.

    Args:
        hidden_size, intermediate_size, num_attention_heads, num_key_value_heads,
        head_dim, num_hidden_layers, rms_norm_eps, hidden_act, max_position_embeddings:
            decoder-layer sizes, normally copied from the target's text config
            (see `from_target_config`).
        rope_parameters: transformers-5 RoPE dict (`rope_type`, `rope_theta`, ...);
            `rope_theta=` is accepted as a keyword and folded into it.
        mrope_section: M-RoPE split of the rotary frequencies into (temporal, height,
            width) sections, e.g. `[16, 24, 24]` for Qwen2-VL; `None` for 1-D RoPE.
            Kept in sync with `rope_parameters["mrope_section"]`.
        layer_family: "llama" (no attention bias) or "qwen2" (q/k/v bias): a
            `msd_train.draft.families.LAYER_FAMILIES` entry.
        fc_bias: whether the fusion layer `fc: Linear(2H, H)` has a bias.
        first_layer_input_norm: whether the first decoder layer keeps its
            `input_layernorm`. `None` picks the family default: False for llama (the
            EAGLE convention of the released LLaVA heads), True for qwen2.
        decouple_visual: replace the fused input at image positions by the raw visual
            embedding (the projector output). That is MSD's decoupling.
        visual_offset: where the visual block sits in the draft sequence.
            "released": positions `p-1 .. p+N-2` (the released MSD heads);
            "paper": positions `p .. p+N-1` (the paper's formula); `p` is the first
            image position of the expanded target sequence.
        draft_positions: the position ids the head reads under M-RoPE (see
            `msd_train.draft.positions.draft_position_ids`). "mrope": the target's own
            M-RoPE ids (image blocks on a 2-D grid, text after an image offset by the
            grid). "1d": the token index `arange(L)` in all three M-RoPE rows, tree nodes
            at the root's index plus depth: how the released Qwen2-VL heads were trained
            and are run. Heads of 1-D RoPE targets (LLaVA) read 1-D ids either way. New
            heads are "1d": `from_target_config` (the library's way to build a head for a
            target, training's included) and `conf/head/*.yaml` say so. The field's own
            default, "mrope", is how a saved head without the field is read: this project
            trained such heads before the field existed, with "mrope".
        visual_compression: "none", "kmeans" or "pool": keep at most
            `visual_compression_tokens` (K) slots per image in the head's own context
            (centroids of KMeans over the visual embeddings, or means of K contiguous
            groups); the target still reads the whole image. See
            `msd_train.draft.compression`. "none" (the default): every visual token.
        visual_compression_tokens: K, the slots an image keeps; an image of at most K
            visual tokens is not compressed.
        train_vocab: N, the token term was trained over the N target tokens the training
            data used most (``draft.train_vocab``; ``msd_train.draft.loss.TrainVocab``);
            decoding then drafts over the same N by default. None: the whole vocabulary.
        target_name_or_path, target_vocab_size, target_hidden_size, target_adapter:
            the target this head drafts for (the head reuses its embedding and lm_head).
        target_model_type: that target's family, as the composite model_type of its
            adapter ("llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "qwen3_vl";
            `msd_train.targets.FAMILIES`), so model cards and exports can name it; None for
            heads saved before the field existed (their layer_family tells LLaVA from Qwen2-VL).
    """

    model_type = "msd_draft"
    ignore_keys_at_rope_validation = {"mrope_section"}

    #: keys a later stage may change on the head it starts from (``draft.<key>`` of its launch)
    stage_overridable = ("decouple_visual", "visual_offset", "draft_positions", "visual_compression",
                         "visual_compression_tokens")
    #: fields other engines' layouts (vLLM's, EAGLE-3's) have no key for: their "msd" block keeps them
    layout_extras = ("fc_bias", "first_layer_input_norm", "decouple_visual", "visual_offset", "draft_positions",
                     "visual_compression", "visual_compression_tokens", "layer_family", "mrope_section",
                     "target_name_or_path", "target_vocab_size", "target_hidden_size", "target_adapter",
                     "target_model_type")

    # Read by transformers' decoder-layer classes, fixed for every MSD head and therefore
    # class attributes rather than saved fields.
    attention_bias = False  # LlamaAttention; Qwen2 layers hard-code q/k/v bias
    mlp_bias = False
    attention_dropout = 0.0
    use_sliding_window = False  # Qwen2VLDecoderLayer
    sliding_window = None

    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    num_hidden_layers: int = 1
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    rope_parameters: RopeParameters | dict | None = None
    mrope_section: list[int] | None = None

    layer_family: Literal["llama", "qwen2"] = "llama"
    fc_bias: bool = True
    first_layer_input_norm: bool | None = None
    decouple_visual: bool = True
    visual_offset: Literal["released", "paper"] = "released"
    draft_positions: Literal["mrope", "1d"] = "mrope"
    visual_compression: Literal["none", "kmeans", "pool"] = "none"
    visual_compression_tokens: int = 32
    train_vocab: int | None = None

    target_name_or_path: str | None = None
    target_vocab_size: int | None = None
    target_hidden_size: int | None = None
    target_adapter: str | None = None
    target_model_type: str | None = None

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.first_layer_input_norm is None:
            self.first_layer_input_norm = family_of(self.layer_family).first_layer_input_norm
        super().__post_init__(**kwargs)  # folds rope_theta/rope_scaling into rope_parameters
        self._sync_mrope_section()

    def _sync_mrope_section(self):
        """Keep `mrope_section` and `rope_parameters["mrope_section"]` equal: the field is
        the public knob, the dict entry is what Qwen2VLRotaryEmbedding reads."""
        rope = self.rope_parameters
        in_rope = rope.get("mrope_section") if rope else None
        if self.mrope_section is None and in_rope is not None:
            self.mrope_section = list(in_rope)
        elif self.mrope_section is not None:
            if in_rope is not None and list(in_rope) != list(self.mrope_section):
                raise ValueError(
                    f"mrope_section={self.mrope_section} disagrees with "
                    f"rope_parameters['mrope_section']={in_rope}; set only one of them"
                )
            self.mrope_section = list(self.mrope_section)
            self.rope_parameters["mrope_section"] = list(self.mrope_section)

    def validate_architecture(self):
        """Part of `@strict` validation: shapes the decoder layers can actually build."""
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not a multiple of num_attention_heads={self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if family_of(self.layer_family).derived_head_dim and \
                self.head_dim != self.hidden_size // self.num_attention_heads:
            raise ValueError(
                f"layer_family={self.layer_family!r} needs head_dim = hidden_size // num_attention_heads "
                f"({self.hidden_size // self.num_attention_heads}), got head_dim={self.head_dim}"
            )
        if self.visual_compression_tokens < 1:
            raise ValueError(f"visual_compression_tokens must be at least 1, got {self.visual_compression_tokens}")
        if self.mrope_section is not None and 2 * sum(self.mrope_section) != self.head_dim:
            raise ValueError(f"mrope_section={self.mrope_section} must sum to head_dim/2 = {self.head_dim // 2}")

    @property
    def uses_mrope(self) -> bool:
        """True when positions are M-RoPE ids of shape (3, B, T) (Qwen2-VL family)."""
        return self.mrope_section is not None

    @classmethod
    def from_target_config(cls, text_config, target_name_or_path: str | None, **overrides) -> "MSDDraftConfig":
        """Derive a draft config from a target's config.

        Sizes, RoPE (M-RoPE sections included) and the layer family come from the
        target's text config, so that the head's layer matches one target layer and the
        target's `embed_tokens`/`lm_head` fit it. `text_config` may also be a composite
        config (`LlavaConfig`, `Qwen2VLConfig`); its text part is used. `overrides` set
        any field last (e.g. `visual_offset="paper"`, `num_hidden_layers=2`).
        """
        from msd_train.targets import adapter_class  # the family's facts live on its adapter

        try:
            adapter = adapter_class(text_config)
        except ValueError as e:
            raise ValueError(f"no MSD draft head for this target: {e}") from None
        text_config = text_config.get_text_config(decoder=True)
        family = adapter.draft_layer_family
        rope = adapter.rope_parameters_of(text_config)
        mrope_section = adapter.mrope_section_of(text_config)
        hidden = text_config.hidden_size
        heads = text_config.num_attention_heads
        fields = dict(
            hidden_size=hidden,
            intermediate_size=text_config.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=text_config.num_key_value_heads or heads,
            head_dim=getattr(text_config, "head_dim", None) or hidden // heads,
            rms_norm_eps=text_config.rms_norm_eps,
            hidden_act=text_config.hidden_act,
            max_position_embeddings=text_config.max_position_embeddings,
            rope_parameters=rope,
            mrope_section=list(mrope_section) if mrope_section is not None else None,
            layer_family=family,
            target_name_or_path=target_name_or_path,
            target_vocab_size=text_config.vocab_size,
            target_hidden_size=hidden,
            target_model_type=adapter.model_types[0],
            draft_positions="1d",  # new heads: as the released Qwen heads (the field's default reads old saves)
        )
        fields.update(overrides)
        return cls(**fields)


def default_feature_layers(num_layers: int) -> list[int]:
    """EAGLE-3's layers: the inputs of layers 2, N/2 and N-3, clamped into [0, N-1] and
    without repeats (a shallow target has fewer distinct layers to read)."""
    from msd_train.targets.base import eagle3_layers  # one formula, which families adjust

    return eagle3_layers(num_layers)


@strict
class MSD3DraftConfig(MSDDraftConfig):
    r"""
    Config of an MSD-3 head (EAGLE-3's architecture with MSD's decoupled visual tokens):
    `fc: k*H -> H` (no bias) over the inputs of k target layers, one decoder layer whose
    attention reads `cat(input_layernorm(e), hidden_norm(h))` (2H wide), a final norm and
    its own `lm_head` over a draft vocabulary.

    Args (besides MSDDraftConfig's; `fc_bias`, `first_layer_input_norm` and
    `visual_offset` are not read):
        feature_layers: target layers whose inputs (HF `hidden_states[i]`) are fused;
            None: EAGLE-3's default 2, N/2, N-3 (`default_feature_layers`).
        target_num_layers: the target's layer count (what the default is taken from).
        draft_vocab_size: size of the draft vocabulary; None: min(32000, target vocabulary).
        ttt_steps: steps of the training-time test (the head unrolled on its own outputs).
        ttt_decay: weight of step i's loss is ttt_decay**i.
        decouple_visual: True: the embedding stream carries the target's visual embeddings
            (projector outputs) at image positions; False: the image placeholder token's
            embedding there, as EAGLE-3 heads for VLMs were trained.
    """

    model_type = "msd3_draft"

    stage_overridable = ("decouple_visual", "draft_positions", "ttt_steps", "ttt_decay", "visual_compression",
                         "visual_compression_tokens")
    layout_extras = ("decouple_visual", "draft_positions", "ttt_steps", "ttt_decay", "layer_family", "mrope_section",
                     "target_name_or_path", "target_num_layers", "target_adapter", "target_hidden_size",
                     "visual_compression", "visual_compression_tokens", "target_model_type")

    feature_layers: list[int] | None = None
    target_num_layers: int | None = None
    draft_vocab_size: int | None = None
    ttt_steps: int = 7
    ttt_decay: float = 0.8

    def __post_init__(self, **kwargs):
        if self.feature_layers is None and self.target_num_layers is not None:
            self.feature_layers = default_feature_layers(self.target_num_layers)
        if self.feature_layers is not None:
            self.feature_layers = [int(i) for i in self.feature_layers]
        if self.draft_vocab_size is None and self.target_vocab_size is not None:
            self.draft_vocab_size = min(32000, self.target_vocab_size)
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        super().validate_architecture()
        if self.num_hidden_layers != 1:
            raise ValueError(f"an msd3 head has one decoder layer, got num_hidden_layers={self.num_hidden_layers}")
        if self.target_num_layers is not None and self.feature_layers is not None:
            bad = [i for i in self.feature_layers if not 0 <= i < self.target_num_layers]
            if bad:
                raise ValueError(f"feature_layers {bad} are not layers of a {self.target_num_layers}-layer target "
                                 f"(0 .. {self.target_num_layers - 1})")
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps must be at least 1, got {self.ttt_steps}")
        if self.draft_vocab_size is not None and not (
                0 < self.draft_vocab_size <= (self.target_vocab_size or self.draft_vocab_size)):
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} must be between 1 and the target's vocabulary "
                             f"({self.target_vocab_size})")

    @classmethod
    def from_target_config(cls, text_config, target_name_or_path: str | None, **overrides) -> "MSD3DraftConfig":
        """MSDDraftConfig's, with the target's layer count and its family's default
        ``feature_layers`` (``Target.default_feature_layers``; Qwen3-VL's avoid deepstack)."""
        from msd_train.targets import adapter_class

        layers = text_config.get_text_config(decoder=True).num_hidden_layers
        defaults = {"target_num_layers": layers, "feature_layers": adapter_class(text_config).default_feature_layers(
            text_config)}
        return super().from_target_config(text_config, target_name_or_path, **{**defaults, **overrides})
