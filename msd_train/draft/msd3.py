"""The MSD-3 head: EAGLE-3's architecture with MSD's decoupled visual tokens.

    g_t    = fc(concat(a^{l1}_t, .., a^{lk}_t))         inputs of k target layers, no bias
    s_t    = midlayer(e_{t+1}, g_t)                      attention reads
                                                         cat(input_layernorm(e), hidden_norm(g)), 2H wide
    logits = lm_head(norm(s_t))                         over the draft vocabulary,
                                                         target id = i + d2t[i]

A drafting step reads the head's own previous state ``s`` in place of ``g``. At image
positions ``e`` is the target's visual embedding (the projector output) with
``decouple_visual``, the image placeholder token's embedding without (plain EAGLE-3).

The training-time test (``unroll``) runs the head ``ttt_steps`` times over a sequence:
step i at anchor t reads the embedding e_{t+1+i} and the head's own step i-1 state at t,
at position id pos_t + i, and attends to the step-0 keys up to t and to the keys of its
own chain (steps 1..i at t): exactly what a chain drafted from anchor t sees.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

from msd_train.draft.config import MSD3DraftConfig
from msd_train.draft.head import DraftHead, pair, register_head
from msd_train.draft.loss import lm_head_argmax
from msd_train.draft.model import (
    _DECODER_LAYER,
    _SUPPORTED_ATTENTION,
    MSDDraftOutput,
    attention_bias,
    check_finite,
)
from msd_train.draft.positions import draft_position_ids
from msd_train.hf_compat import cache_kwargs


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

    def __init__(self, config: MSD3DraftConfig):
        super().__init__(config)
        self.gradient_checkpointing = False
        hidden = config.hidden_size
        self.fc = nn.Linear(len(config.feature_layers) * hidden, hidden, bias=False)
        layer = _DECODER_LAYER[config.layer_family](config, layer_idx=0)
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

    def restrict_vocabulary(self, target, ids: torch.Tensor | None) -> None:
        if ids is not None:
            raise ValueError(f"an msd3 head drafts over the {self.config.draft_vocab_size}-token vocabulary it was "
                             f"trained with (draft.draft_vocab_size at training); decoding.draft_vocab is for msd heads")

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

    def embeddings(self, features, target=None) -> torch.Tensor:
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

    def target_inputs(self, features, target=None, noise=None) -> dict[str, torch.Tensor | None]:
        """The paired inputs (``pair``) with the k layers' features fused by ``fc``
        (``noise``, in training, is added to those features first)."""
        embeds, states = pair(self.embeddings(features, target), self.head_features(features))
        if noise is not None:
            states = noise(states)
        pos = features.position_ids
        return {"input_embeds": embeds, "hidden_states": self.project(states),
                "position_ids": None if pos is None else draft_position_ids(self.config, pos)[..., :-1]}

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

    def logits(self, states: torch.Tensor, target) -> torch.Tensor:
        """Draft-vocabulary logits put at their target ids; -inf at every other id."""
        small = self.draft_logits(states.to(self.lm_head.weight.dtype)).to(target.dtype)
        out = small.new_full((*small.shape[:-1], self.t2d.shape[0]), float("-inf"))
        return out.index_copy_(-1, self.draft_ids, small)

    # ----- training-time test ------------------------------------------------------------

    def unroll(self, inputs: dict, steps: int, forward=None) -> list[torch.Tensor]:
        """The head's states (B, T, H) for steps 0..steps-1 (see the module docstring):
        step i reads step i-1's states. Embeddings past the sequence's end are zeros (those
        positions are never loss positions)."""
        forward = forward or self
        embeds, states, pos = inputs["input_embeds"], inputs["hidden_states"], inputs["position_ids"]
        B, T = embeds.shape[:2]
        if pos is None:
            pos = torch.arange(T, device=embeds.device)[None].expand(B, T)
        cache = DynamicCache()
        causal = torch.ones(T, T, dtype=torch.bool, device=embeds.device).tril()
        own = torch.eye(T, dtype=torch.bool, device=embeds.device)
        outs = []
        for i in range(steps):
            e = torch.zeros_like(embeds)
            e[:, : T - i] = embeds[:, i:]
            mask = torch.cat([causal] + [own] * i, dim=1)[None, None].expand(B, 1, T, (i + 1) * T)
            states = forward(input_embeds=e, hidden_states=states, position_ids=pos + i, attention_mask=mask,
                             past_key_values=cache, use_cache=True).last_hidden_state
            outs.append(states)
        return outs

    def _targets(self, target, features):
        """Target probabilities over the draft vocabulary at each draft position (B, T, N)
        and whether the target's argmax lies in the draft vocabulary (B, T). Only the draft
        vocabulary's rows of the lm_head are applied; the full argmax runs in chunks, unless
        a feature store holds it (``Features.target_top``)."""
        with torch.no_grad():
            hidden = features.hidden_states[:, 1:]
            head = target.lm_head
            rows = head.weight[self.draft_ids]
            bias = None if getattr(head, "bias", None) is None else head.bias[self.draft_ids]
            probs = F.linear(hidden.to(rows.dtype), rows, bias).float().softmax(-1)
            if features.target_top is not None:  # a feature store's: -1 only where no loss reads it
                top = features.target_top[:, 1:]
                in_vocab = self.t2d[top.clamp(min=0)] & (top >= 0)
            else:
                in_vocab = self.t2d[lm_head_argmax(head, hidden)]
        return probs, in_vocab

    @staticmethod
    def _shift(x: torch.Tensor, i: int, fill=0) -> torch.Tensor:
        """x[:, t + i] at t (positions past the end: ``fill``)."""
        out = torch.full_like(x, fill)
        out[:, : x.shape[1] - i] = x[:, i:]
        return out

    def _ttt(self, target, features, mask, noise=None, forward=None):
        """Per-step (weighted loss sum, hit count, valid count) of the unrolled head."""
        inputs, plan = self.read_pass(features, target, noise=noise)
        probs, in_vocab = self._targets(target, features)
        outs = self.unroll(inputs, self.config.ttt_steps, forward)
        outs = outs if plan is None else [plan.expand(s) for s in outs]
        loss, hits, valid = [], [], []
        for i, states in enumerate(outs):
            logp = torch.log_softmax(self.draft_logits(states).float(), -1)
            ok = self._shift(mask.bool() & in_vocab, i, False)
            p = self._shift(probs, i)
            loss.append(-(p * logp).sum(-1)[ok].sum() * self.config.ttt_decay ** i)
            hits.append(((logp.argmax(-1) == p.argmax(-1)) & ok).sum())
            valid.append(ok.sum())
        return loss, hits, valid

    def training_loss(self, target, features, index, n_tokens: float, train, noise=None, forward=None):
        """The training-time test: soft cross-entropy over the draft vocabulary at each of
        ``ttt_steps`` unrolled steps, weighted ``ttt_decay**i``, at loss positions whose
        target argmax is in the draft vocabulary; divided by ``n_tokens``."""
        B, T = features.hidden_states.shape[0], features.hidden_states.shape[1] - 1
        mask = torch.zeros(B * T, dtype=torch.bool, device=features.hidden_states.device)
        mask[index] = True
        loss, hits, valid = self._ttt(target, features, mask.view(B, T), noise, forward)
        total = torch.stack(loss).sum()
        sums = {"loss_sum": total.detach(), "n": torch.full((), index.numel(), device=total.device)}
        for i, (h, v) in enumerate(zip(hits, valid)):
            sums[f"hit_{i}"], sums[f"valid_{i}"] = h, v
        return total / max(n_tokens, 1.0), sums

    def training_metrics(self, sums: dict[str, float], train) -> dict[str, float]:
        out = {"loss": sums["loss_sum"] / max(sums["n"], 1.0)}
        for i in range(self.config.ttt_steps):  # per-step top-1 accuracy over in-vocabulary positions
            out[f"acc_{i}"] = sums[f"hit_{i}"] / max(sums[f"valid_{i}"], 1.0)
        out["top1"] = out["acc_0"]
        return out

    def eval_loss(self, target, features, mask: torch.Tensor) -> torch.Tensor:
        loss, _, _ = self._ttt(target, features, mask)
        return torch.stack(loss).sum()

    def rollout_hits(self, target, features, k: int) -> list[torch.Tensor]:
        """The unrolled steps are the chains: step j at anchor a predicts token a+2+j."""
        inputs, plan = self.read_pass(features, target)
        outs = self.unroll(inputs, k)
        outs = outs if plan is None else [plan.expand(s) for s in outs]
        target_top = lm_head_argmax(target.lm_head, features.hidden_states[:, 1:])
        # the argmax of ``logits``: the draft-vocabulary argmax, mapped to its target id
        return [self.draft_ids[self.draft_logits(s).argmax(-1)] == self._shift(target_top, j, -1)
                for j, s in enumerate(outs)]
