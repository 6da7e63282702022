"""The DFlash head: a block drafter (Chen et al., arXiv 2602.06036) with MSD's decoupled visual tokens as an option.

One forward proposes a whole block. Its inputs are the target's context and one block:

    c_j    = hidden_norm(fc(concat(a^{l1}_j, .., a^{lk}_j)))  context entry of position j: the inputs of
                                                           k target layers, no bias; with ``decouple_visual``
                                                           visual_norm(e_j) at image positions (the projector's
                                                           output: the visual tokens' own path)
    x      = [e(root), m, m, .., m]                        the block: the last accepted token's embedding, then
                                                           block_size - 1 mask positions (``mask_embedding``)
    s      = norm(layers(x; context c_0 .. c_{r-1}))       each layer's attention: queries from the block, keys
                                                           and values from the context (that layer's k/v
                                                           projections of c) and from the block itself,
                                                           bidirectional within the block
    logits = lm_head(s_i)                                  block position i > 0 proposes token r + i

where r is the root's position. Positions are the root's plus 0 .. block_size - 1 (RoPE),
context entries keep their own. Every layer is one of transformers' decoder layers of the
target's family (its projections, norms and MLP); only the attention's inputs differ, so
``_block_attention`` is written here. The target's lm_head gives the logits (over a draft
vocabulary of its rows when ``train_vocab`` / ``decoding.draft_vocab`` name one).

In the project's indexing (``pair``: draft position t reads h_t and e_{t+1} and predicts
token t+2) the block anchored at draft position a has its root at a+1 and sees the context
h_0 .. h_a; its block position i predicts token a+1+i, so a chain's step j is block
position j+1. ``target_inputs`` gives every anchor of a pass; the objective picks which
(``training/objective.py``, ``DFlashObjective``).

What was taken from the public implementations (z-lab's ``dflash/model.py``, SpecForge's
``specforge/core/dflash.py``), rewritten here: the fused k-layer context behind ``fc`` and
``hidden_norm``, context keys and values projected by each layer's own k/v projections, a
non-causal block of the root plus mask positions at positions r .. r+B-1, a final norm before
the target's lm_head, the default target layers (evenly spaced from 1 to N-3, one layer
per draft layer; the middle one for a one-layer draft), and, in training, anchors sampled
inside the answers, each seeing the context strictly before its root, with position i's
loss weighted exp(-(i-1)/gamma). What differs: DFlash reads the outputs of target layers
(``hidden_states[i + 1]``), this project names layers by their inputs (``hidden_states[i]``,
as msd3 does), so DFlash's layer j is this project's j+1; DFlash's mask positions read the
embedding of a mask token added to the target's tokenizer, here the head holds its own
learned ``mask_embedding`` (a target has no spare row in general); the token loss is the
project's soft cross-entropy to the target's distribution (DFlash: hard labels, equal to the
target's argmax on target-regenerated data).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

from msd_train.draft.config import MSDDraftConfig
from msd_train.draft.families import layer_family
from msd_train.draft.head import DraftHead, HeadCard, pair, register_head
from msd_train.draft.model import MSDDraftOutput, check_finite
from msd_train.draft.positions import draft_position_ids
from msd_train.draft.vocabulary import ReadsTargetLMHead, VocabSubset
from msd_train.errors import ConfigError
from msd_train.hf_compat import rope_cos_sin
from msd_train.targets.protocol import TargetProtocol


def dflash_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default target layers, as this project names them (layer inputs): DFlash
    reads the outputs of layers evenly spaced from 1 to N-3, one per draft layer (the middle
    layer N//2 for a one-layer draft); the output of layer j is the input of layer j+1.
    Clamped into [1, N-1] and without repeats (a shallow target has fewer layers to read)."""
    n, k = num_target_layers, num_draft_layers
    if k == 1:
        outputs = [n // 2]
    else:
        start, end = 1, max(n - 3, 1)
        outputs = [int(round(start + i * (end - start) / (k - 1))) for i in range(k)]
    return sorted({min(max(j + 1, 1), n - 1) for j in outputs})


@strict
class DFlashDraftConfig(MSDDraftConfig):
    r"""
    Config of a DFlash head (module docstring). The field defaults are the field's GPU
    recipes (DFlash: 5 draft layers, block 16, loss decay gamma 7); ``conf/head/dflash.yaml``
    sets the CPU default.

    Args (besides MSDDraftConfig's sizes, RoPE, ``decouple_visual``, ``draft_positions`` and
    ``train_vocab``; ``fc_bias``, ``first_layer_input_norm`` and ``visual_offset`` are not read,
    ``visual_compression`` must stay "none"):
        block_size: B, tokens of one block: the root plus B-1 proposals (one forward).
        num_hidden_layers: draft decoder layers.
        feature_layers: target layers whose inputs are fused into the context; None:
            DFlash's default for ``target_num_layers`` and ``num_hidden_layers``
            (``dflash_layers``); ``[target_num_layers]``: the target's last, post-norm
            output, the feature an msd head reads (``reads_last_output``).
        target_num_layers: the target's layer count.
        num_anchors: training: blocks sampled per sequence (anchors inside the answers).
        loss_decay_gamma: training: block position i's loss weighs exp(-(i-1)/gamma).
        decouple_visual: True: context entries at image positions are the target's visual
            embeddings (projector outputs) through their own norm, as MSD gives visual
            tokens their own path; False: the fused target features there too (the draft
            sees images only through the target's hidden states, as the field's drafts do).
    """

    model_type = "dflash_draft"

    stage_overridable = ("decouple_visual", "draft_positions", "num_anchors", "loss_decay_gamma")
    layout_extras = ("decouple_visual", "draft_positions", "block_size", "feature_layers", "target_num_layers",
                     "num_anchors", "loss_decay_gamma", "train_vocab", "layer_family", "mrope_section",
                     "target_name_or_path",
                     "target_vocab_size", "target_hidden_size", "target_adapter", "target_model_type")

    num_hidden_layers: int = 5
    block_size: int = 16
    feature_layers: list[int] | None = None
    target_num_layers: int | None = None
    num_anchors: int = 512
    loss_decay_gamma: float = 7.0

    def __post_init__(self, **kwargs):
        if self.feature_layers is None and self.target_num_layers is not None:
            self.feature_layers = dflash_layers(self.target_num_layers, self.num_hidden_layers)
        if self.feature_layers is not None:
            self.feature_layers = [int(i) for i in self.feature_layers]
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        super().validate_architecture()
        if self.num_hidden_layers < 1:
            raise ValueError(f"a dflash head has at least one decoder layer, got num_hidden_layers="
                             f"{self.num_hidden_layers}")
        if self.block_size < 2:
            raise ValueError(f"draft.block_size={self.block_size}: a block is the root plus at least one proposal; "
                             f"give 2 or more (e.g. 4 on a CPU, 16 on a GPU)")
        if self.num_anchors < 1 or self.loss_decay_gamma <= 0:
            raise ValueError(f"draft.num_anchors={self.num_anchors} must be at least 1 and draft.loss_decay_gamma="
                             f"{self.loss_decay_gamma} above 0")
        if self.visual_compression != "none":
            raise ValueError(f"draft.visual_compression={self.visual_compression}: a dflash head reads every visual "
                             "token of its context; use draft.visual_compression=none")

    @classmethod
    def from_target_config(cls, text_config, target_name_or_path: str | None, **overrides) -> DFlashDraftConfig:
        """MSDDraftConfig's, with the target's layer count; refuses (``ConfigError``, before
        the head is built) a block longer than the target's context and target layers the
        target does not have."""
        text = text_config.get_text_config(decoder=True)
        n, context = text.num_hidden_layers, text.max_position_embeddings
        block = overrides.get("block_size", cls.block_size)
        if isinstance(block, int) and block < 2:
            raise ConfigError(f"draft.block_size={block}: a block is the root plus at least one proposal; give 2 or "
                              f"more (4 on a CPU, 16 on a GPU)")
        if isinstance(block, int) and block >= context:
            raise ConfigError(f"draft.block_size={block}: the target's context holds {context} positions "
                              f"(max_position_embeddings), and a block must fit in it after the prompt; give a "
                              f"smaller draft.block_size (4 on a CPU, 16 on a GPU)")
        layers = overrides.get("feature_layers")
        if layers is not None:
            layers = [int(i) for i in layers]
            bad = [i for i in layers if not 0 <= i <= n]
            if bad or not layers or (n in layers and len(layers) > 1):
                raise ConfigError(f"draft.feature_layers={layers}: the target has {n} layers; name the inputs of "
                                  f"layers among 0 .. {n - 1}, or [{n}] alone for its last output (what an msd head "
                                  f"reads: a feature store made for msd serves it), or draft.feature_layers=null for "
                                  f"DFlash's default "
                                  f"({dflash_layers(n, overrides.get('num_hidden_layers', cls.num_hidden_layers))})")
        return super().from_target_config(text_config, target_name_or_path, **{"target_num_layers": n, **overrides})


def _block_attention(attn, x: torch.Tensor, block_pe, context_kv, context_mask: torch.Tensor | None) -> torch.Tensor:
    """One layer's attention for N blocks of S positions: ``x`` (B, N, S, H) the block states
    after the input norm, ``block_pe`` their (cos, sin) (B, N*S, D), ``context_kv`` the
    context's keys and values (B, KV, C, D), RoPE applied; ``context_mask`` (B, N, C) bool,
    the context entries each block sees (None: all). Each query attends to the context it
    may see and to its whole block (both directions), softmax over the two together."""
    B, N, S, _ = x.shape
    d, groups = attn.head_dim, attn.num_key_value_groups
    flat = x.reshape(B, N * S, -1)
    q = attn.q_proj(flat).view(B, N * S, -1, d).transpose(1, 2)  # (B, h, N*S, d)
    k = attn.k_proj(flat).view(B, N * S, -1, d).transpose(1, 2)
    v = attn.v_proj(flat).view(B, N * S, -1, d).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, *block_pe)
    ck, cv = context_kv
    if groups > 1:
        k, v, ck, cv = (t.repeat_interleave(groups, dim=1) for t in (k, v, ck, cv))
    h = q.shape[1]
    q = q.view(B, h, N, S, d)
    k, v = k.view(B, h, N, S, d), v.view(B, h, N, S, d)
    own = torch.einsum("bhnsd,bhntd->bhnst", q, k) * attn.scaling  # (B, h, N, S, S)
    ctx = torch.einsum("bhnsd,bhcd->bhnsc", q, ck) * attn.scaling  # (B, h, N, S, C)
    if context_mask is not None:
        ctx = ctx.masked_fill(~context_mask[:, None, :, None, :], torch.finfo(ctx.dtype).min)
    p = torch.cat([ctx, own], dim=-1).float().softmax(-1).to(q.dtype)
    C = ck.shape[2]
    out = torch.einsum("bhnsc,bhcd->bhnsd", p[..., :C], cv) + torch.einsum("bhnst,bhntd->bhnsd", p[..., C:], v)
    out = out.permute(0, 2, 3, 1, 4).reshape(B, N * S, h * d)
    return attn.o_proj(out).view(B, N, S, -1)


@register_head
class DFlashDraftModel(ReadsTargetLMHead, DraftHead):
    architecture = "dflash"
    config_class = DFlashDraftConfig
    decoding_methods: ClassVar[tuple[str, ...]] = ("block",)  # decoding.block.BlockDrafter

    def __init__(self, config: DFlashDraftConfig):
        super().__init__(config)
        hidden = config.hidden_size
        self.fc = nn.Linear(len(config.feature_layers or [0]) * hidden, hidden, bias=False)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.visual_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)  # the decoupled path of image positions
        self.mask_embedding = nn.Parameter(torch.zeros(hidden))
        decoder_layer = layer_family(config.layer_family).decoder_layer
        self.layers = nn.ModuleList(decoder_layer(config, layer_idx=i) for i in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = (Qwen2VLRotaryEmbedding if config.uses_mrope else LlamaRotaryEmbedding)(config)
        self._vocab: VocabSubset | None = None  # decode time: see restrict_vocabulary
        self.post_init()
        with torch.no_grad():  # a mask position starts as a token embedding would (post_init leaves raw parameters)
            self.mask_embedding.normal_(0.0, config.initializer_range)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """As ``MSDDraftModel.from_pretrained``: a head with NaN or inf weights is refused."""
        out = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        check_finite((out[0] if isinstance(out, tuple) else out).state_dict().items(), str(pretrained_model_name_or_path))
        return out

    @property
    def block_size(self) -> int:
        return self.config.block_size

    # ----- the head interface ------------------------------------------------------------

    @property
    def reads_last_output(self) -> bool:
        """``feature_layers == [N]``: the context is the target's last, post-norm output (HF's
        ``hidden_states[N]``), the feature an msd head reads, from the same stores."""
        c = self.config
        return c.target_num_layers is not None and list(c.feature_layers or []) == [c.target_num_layers]

    @property
    def feature_layers(self) -> list[int] | None:
        return None if self.reads_last_output else list(self.config.feature_layers)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """k layers' features (..., k*H) -> context entries (..., H)."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def context(self, layer_states: torch.Tensor, embeds: torch.Tensor | None = None,
                visual: torch.Tensor | None = None) -> torch.Tensor:
        """Context entries of target positions: ``project`` of their layer features, with
        ``decouple_visual`` the visual path (``visual_norm`` of the embedding ``embeds``) where
        ``visual`` (bool, same leading shape) is True."""
        out = self.project(layer_states)
        if self.config.decouple_visual and visual is not None and embeds is not None:
            out = torch.where(visual[..., None].bool(), self.visual_norm(embeds.to(out.dtype)), out)
        return out

    def target_inputs(self, features, target: TargetProtocol | None = None,
                      position_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor | None]:
        """Every anchor of a pass of L tokens (draft positions a = 0 .. L-2): the roots'
        embeddings e_{a+1} and positions, and the context h_0 .. h_{L-2} with its positions
        (anchor a may see entries 0 .. a: ``context_mask``)."""
        roots, states = pair(features.inputs_embeds, self.head_features(features))
        embeds = features.inputs_embeds[:, :-1]
        visual = None if features.visual_mask is None else features.visual_mask[:, :-1]
        pos = position_ids
        if pos is None and features.position_ids is not None:
            pos = draft_position_ids(self.config, features.position_ids)
        if pos is None:
            L = features.inputs_embeds.shape[1]
            pos = torch.arange(L, device=roots.device)[None].expand(roots.shape[0], L)
        return {"input_embeds": roots, "hidden_states": self.context(states, embeds, visual),
                "position_ids": pos[..., 1:], "context_position_ids": pos[..., :-1]}

    def forward(self, input_embeds, hidden_states, position_ids=None, context_position_ids=None,
                context_mask: torch.Tensor | None = None, past_key_values=None, use_cache: bool = False,
                **_) -> MSDDraftOutput:
        """N blocks from their roots in one pass.

        Args:
            input_embeds: (B, N, H) the roots' embeddings (block position 0); the other
                block_size - 1 positions hold ``mask_embedding``.
            hidden_states: (B, C, H) new context entries (``context``), appended after the
                cache's (``past_key_values``, when given, is extended by them).
            position_ids: (B, N) or (3, B, N) the roots' positions; block position i is at +i.
            context_position_ids: (B, C) or (3, B, C) the new context entries' positions.
            context_mask: (B, N, C_all) bool, the context entries (cached ones first) each
                block sees; None: all of them.
        Returns:
            MSDDraftOutput(last_hidden_state (B, N, S, H): the normed states of every block
            position; position i > 0 proposes token root + i).
        """
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        B, N, H = input_embeds.shape
        S = self.config.block_size
        dtype = self.fc.weight.dtype
        x = torch.cat([input_embeds.to(dtype)[:, :, None], self.mask_embedding.to(dtype).expand(B, N, S - 1, H)], 2)
        offsets = torch.arange(S, device=x.device)
        if position_ids is None:
            raise ValueError("a dflash head needs the roots' position_ids")
        block_pos = (position_ids[..., None] + offsets).flatten(-2)  # (.., B, N*S)
        sections = self.config.mrope_section if self.config.uses_mrope else None
        block_pe = rope_cos_sin(self.rotary_emb, x, self._position_ids(block_pos, B, N * S, 0, x.device), sections)
        ctx = hidden_states.to(dtype)
        C = ctx.shape[1]
        if context_position_ids is None:
            past = past_key_values.get_seq_length() if past_key_values is not None else 0
            context_position_ids = past + torch.arange(C, device=x.device)[None].expand(B, C)
        ctx_pe = (rope_cos_sin(self.rotary_emb, ctx, self._position_ids(context_position_ids, B, C, 0, x.device), sections)
                  if C else None)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            d = attn.head_dim
            ck = attn.k_proj(ctx).view(B, C, -1, d).transpose(1, 2)
            cv = attn.v_proj(ctx).view(B, C, -1, d).transpose(1, 2)
            if C:
                ck = apply_rotary_pos_emb(ck, ck, *ctx_pe)[0]
            if past_key_values is not None:
                ck, cv = past_key_values.update(ck, cv, i)
            if N == 0:  # the context alone (a prompt's prefill): its keys and values into the cache
                continue
            a = _block_attention(attn, layer.input_layernorm(x), block_pe, (ck, cv), context_mask)
            x = x + a
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return MSDDraftOutput(last_hidden_state=self.norm(x), cache=past_key_values)

    @classmethod
    def card(cls, config: DFlashDraftConfig, num_parameters: int | None = None, dtype: str | None = None) -> HeadCard:
        visual = ("the target's visual embeddings (the projector's outputs) through their own norm at image "
                  "positions of its context, as MSD gives visual tokens their own path" if config.decouple_visual
                  else "the target's layer features at image positions too (it sees images only through the "
                  "target's hidden states, as the field's block drafts do)")
        layers = ", ".join(map(str, config.feature_layers or []))
        last = config.target_num_layers is not None and list(config.feature_layers or []) == [config.target_num_layers]
        source = "the target's last (post-norm) output" if last else f"the inputs of target layers {layers}"
        summary = (
            "A draft head for lossless speculative decoding of a multimodal model: a dflash head, a block drafter "
            "after DFlash (Chen et al., arXiv 2602.06036)"
            + (" with MSD's decoupled visual tokens (Lin et al., arXiv 2505.14260)" if config.decouple_visual else "")
            + f". From the last accepted token and {config.block_size - 1} mask positions it proposes "
            f"{config.block_size - 1} tokens in one forward of its {config.num_hidden_layers} decoder layer(s), "
            f"attending to a context made from {source} and, both ways, within its "
            f"block; its context reads {visual}. It is not a model on its own: it uses the target's embedding "
            "table, layer features and `lm_head`, and the target verifies every drafted token in one forward, so "
            "outputs are exactly the target's. Decode it with `decoding=block`. Trained with msd-train.")
        rows = [
            ("architecture", "dflash (block drafter" + (", MSD's visual decoupling)" if config.decouple_visual
                                                         else ", visual decoupling off)")),
            ("block size", f"{config.block_size} (the root and {config.block_size - 1} proposals per forward)"),
            ("fused target layers", "the last output (post-norm)" if last else f"inputs of layers {layers}"
             + (f" of {config.target_num_layers}" if config.target_num_layers else "")),
            ("draft vocabulary", f"{config.train_vocab} most frequent target tokens" if config.train_vocab
             else "the target's whole vocabulary"),
            ("loss weighting", f"block position i weighs exp(-(i - 1) / gamma), gamma = {config.loss_decay_gamma}; "
                               f"{config.num_anchors} anchors per sequence"),
            ("visual decoupling", "on: projector outputs at image positions of the context" if config.decouple_visual
             else "off: target features at image positions (modality-agnostic)"),
            ("draft positions", config.draft_positions if config.mrope_section else None),
            ("layer family", config.layer_family),
            ("decoder layers", config.num_hidden_layers),
            ("hidden size", config.hidden_size),
            ("intermediate size", config.intermediate_size),
            ("attention heads (KV heads)", f"{config.num_attention_heads} ({config.num_key_value_heads})"),
            ("M-RoPE sections", config.mrope_section),
            ("parameters", f"{num_parameters:,}" if num_parameters else None),
            ("dtype", dtype),
        ]
        return HeadCard(name="DFlash draft head (block drafter)", summary=summary, rows=rows, tags=("dflash",))

    @classmethod
    def card_training(cls, draft: dict) -> str | None:
        return "- head: dflash, " + ", ".join(f"{k}={draft[k]}" for k in (
            "block_size", "num_hidden_layers", "feature_layers", "decouple_visual", "num_anchors", "loss_decay_gamma",
            "train_vocab", "draft_positions") if draft.get(k) is not None)
