"""One interface for every draft-head architecture, and the registry that picks the class.

A head is a ``DraftHead`` (an abstract class: the model half of a head kind). Feature
storage, both drafters and the head's training objective (``msd_train.training.objective``)
call only the members below, never the concrete ``forward`` signature or the target's lm_head.

    head.feature_layers                 which target features it reads: None for the last
                                        layer's post-norm output (``msd``), else the
                                        target layers whose inputs it reads (``msd3``)
    head.target_inputs(features, target)  its ``forward`` inputs over one target pass (``pair``);
                                        abstract
    head.read_pass(features, target)    those inputs as the head reads them: with its
                                        visual compression, if any, and the SlotMap
                                        that puts its outputs back (``compression.py``)
    head.head_features(features)        the per-token target features it reads
    head.project(features)              target features -> the state its step reads
    head.step(embeds, state, ...)       one drafting step over T new positions -> states
    head.logits(states, target)         logits over the TARGET vocabulary; abstract
    head.unroll(inputs, steps)          the chains drafted from every anchor of a target
                                        pass along its tokens, each step reading the
                                        head's own previous states (training-time test)

Optional capabilities are declared class attributes, which the trainer and the decoder
read (never ``hasattr``): ``supports_restrict_vocabulary`` (``restrict_vocabulary(target,
ids)``: decode over a subset of the target's vocabulary: msd), ``has_draft_vocabulary``
(``set_vocabulary(d2t, t2d)``: a draft vocabulary of its own, built from the stage's token
counts: msd3) and ``rollout_reads_cache`` (its on-policy rollout keeps a key cache, so
``stage=3`` cannot checkpoint its layers: msd) and ``decoding_methods`` (the
``decoding.method`` values its drafter honours: tree and chain, or a dflash head's block). How a head kind is trained (its loss,
held-out loss and rollout hits) is its
``Objective`` (``training/objective.py``), not the head's.

What else differs between head kinds is declared by the head, and the trainer and the hub
ask: its config class's ``stage_overridable`` (the keys a later stage may change on the head
it starts from) and ``layout_extras`` (the fields other engines' layouts have no key for,
kept in their ``"msd"`` block), and the head class's ``card`` (its section of a model card,
a ``HeadCard``). A new head is its own module (config + head class, ``register_head``), its
objective (``register_objective``) and a ``conf/head/`` file: nothing else lists heads.

The pairing rule lives in ``pair``: draft position t reads the target feature h_t and
the embedding e_{t+1} of the next token, and is trained to predict token t+2.
"""

from __future__ import annotations

import json
from abc import ABCMeta, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache

from msd_train.draft.compression import SlotMap, slot_map
from msd_train.draft.families import LAYER_FAMILIES
from msd_train.formatting import with_article
from msd_train.targets.protocol import TargetProtocol

#: architecture name (``draft.architecture`` in conf/head/*.yaml) -> head class
HEADS: dict[str, type] = {}


def register_head(cls):
    """Class decorator: make ``cls`` loadable by its architecture and its config's model_type."""
    HEADS[cls.architecture] = cls
    return cls


def head_class(architecture: str) -> type:
    if architecture not in HEADS:
        raise ValueError(f"draft.architecture={architecture!r} is no head architecture; use one of {sorted(HEADS)}")
    return HEADS[architecture]


def head_class_of_config(model_type: str) -> type | None:
    """The head class whose config has this ``model_type`` (None: not a head)."""
    for cls in HEADS.values():
        if cls.config_class.model_type == model_type:
            return cls
    return None


def saved_model_type(path, **kwargs) -> str | None:
    """``model_type`` of a saved head (a folder or a Hub id), without building it."""
    folder = Path(path)
    if folder.is_dir() and (folder / "config.json").is_file():
        return json.loads((folder / "config.json").read_text()).get("model_type")
    config, _ = PreTrainedConfig.get_config_dict(str(path), **{k: v for k, v in kwargs.items()
                                                                if k in ("revision", "cache_dir")})
    return config.get("model_type")


def shift(x: torch.Tensor, i: int, fill=0) -> torch.Tensor:
    """``x[:, t + i]`` at t, over dim 1 (positions past the end: ``fill``)."""
    out = torch.full_like(x, fill)
    out[:, : x.shape[1] - i] = x[:, i:]
    return out


def pair(first: torch.Tensor, per_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairing rule, over one target pass of L tokens: draft position t reads the
    target feature h_t (``per_token[:, t]``) and the next token's embedding e_{t+1}
    (``first[:, t + 1]``). Returns (embeds, features), each of length L-1."""
    return first[:, 1:], per_token[:, :-1]


@dataclass
class HeadCard:
    """What a model card says about one head (``DraftHead.card``); the rest of the card
    (usage, serving, target, training, evaluation) is the same for every head kind
    (``msd_train.hub.card``)."""

    name: str  # the title reads "<name> for <the target>"
    summary: str  # the paragraph under the title
    rows: list[tuple[str, Any]]  # the Head table (a row whose value is None is left out)
    tags: tuple[str, ...] = ()  # Hub tags besides the project's and the target family's
    usage: list[str] = field(default_factory=list)  # Python lines after ``load_head`` in the Use snippet


class DraftHead(PreTrainedModel, metaclass=ABCMeta):
    """The members every head architecture implements (see the module docstring)."""

    architecture: str = ""
    #: ``restrict_vocabulary(target, ids)`` drafts over a subset of the target's vocabulary
    supports_restrict_vocabulary: ClassVar[bool] = False
    #: ``set_vocabulary(d2t, t2d)``: the head predicts over a draft vocabulary of its own
    has_draft_vocabulary: ClassVar[bool] = False
    #: its on-policy rollout reads its own earlier steps' keys from a cache (which layers under
    #: gradient checkpointing drop): the trainer refuses the two together
    rollout_reads_cache: ClassVar[bool] = False
    #: the ``decoding.method`` values its drafter can honour: a stepped head drafts trees and
    #: chains; a block head (dflash) proposes a block in one forward (``decoding=block``)
    decoding_methods: ClassVar[tuple[str, ...]] = ("tree", "chain")
    main_input_name = "input_embeds"
    # heads are built from these transformers layers and need attention that takes 4-D masks
    _no_split_modules = [f.decoder_layer.__name__ for f in LAYER_FAMILIES.values()]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False

    def _position_ids(self, position_ids, batch_size, query_length, past_length, device):
        """Default `past + arange(T)`; broadcast [B, T] to [3, B, T] under M-RoPE."""
        if position_ids is None:
            position_ids = past_length + torch.arange(query_length, device=device)
            position_ids = position_ids[None].expand(batch_size, query_length)
        if self.config.uses_mrope and position_ids.ndim == 2:
            position_ids = position_ids[None].expand(3, *position_ids.shape)
        if not self.config.uses_mrope and position_ids.ndim != 2:
            raise ValueError(
                f"position_ids must be [batch, T] for 1-D RoPE, got {list(position_ids.shape)}; "
                f"M-RoPE ids [3, batch, T] need a config with mrope_section"
            )
        return position_ids

    @property
    def feature_layers(self) -> list[int] | None:
        """Target layers whose inputs the head reads, or None: the last post-norm output."""
        return None

    @abstractmethod
    def target_inputs(self, features, target: TargetProtocol | None = None,
                      position_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor | None]:
        """``forward``'s keyword inputs over one target pass of L tokens (a
        ``targets.Features``), each over the L-1 draft positions. ``position_ids``: the
        head's own position ids of the L tokens when the caller has them (ensemble variants
        edit a whole prompt's, ``draft_position_ids``); None: derived from
        ``features.position_ids`` as the head's config says."""

    @abstractmethod
    def forward(self, input_embeds, hidden_states, **kwargs):
        """The head over T positions: ``target_inputs``' keys, plus ``attention_mask``,
        ``past_key_values`` and ``use_cache``; returns an output with ``last_hidden_state``."""

    def visual_slots(self, features) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(B, L-1) bool visual slots of a target pass and (B, L-1, H) their visual
        embeddings, as ``pair`` aligns them (slot t holds the embedding e_{t+1}); None
        without images. What visual compression merges."""
        if features.visual_mask is None:
            return None
        embeds, _ = pair(features.inputs_embeds, features.inputs_embeds)
        return features.visual_mask[:, 1:].bool(), embeds

    def read_pass(self, features, target: TargetProtocol | None = None, **kwargs) -> tuple[dict, SlotMap | None]:
        """``target_inputs`` as the head reads them: each image's visual slots compressed
        to at most ``visual_compression_tokens`` slots when the config asks for it. Returns
        the inputs and the ``SlotMap`` whose ``expand`` puts outputs back on the L-1 slots
        (None: nothing was compressed, the inputs are ``target_inputs``' own)."""
        inputs = self.target_inputs(features, target, **kwargs)
        method = getattr(self.config, "visual_compression", "none")
        slots = self.visual_slots(features) if method != "none" else None
        plan = None if slots is None else slot_map(method, self.config.visual_compression_tokens, *slots)
        return (inputs, None) if plan is None else (plan.compress_inputs(inputs), plan)

    def head_features(self, features) -> torch.Tensor:
        """The per-token target features this head reads from a ``Features``."""
        if self.feature_layers is None:
            return features.hidden_states
        if features.layer_states is None:
            raise ValueError(f"a {self.architecture} head reads the inputs of target layers {self.feature_layers}; "
                             f"compute the features with layers=head.feature_layers")
        return features.layer_states

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Target features (as ``head_features`` gives them) -> the state ``step`` reads."""
        return features

    def step(self, input_embeds, states, position_ids=None, attention_mask=None, past_key_values=None,
             use_cache: bool = True) -> torch.Tensor:
        """One drafting step over T new positions: (B, T, H) states, whose logits are
        ``logits(states)`` and which the next step reads as its ``states``."""
        return self(input_embeds, states, position_ids=position_ids, attention_mask=attention_mask,
                    past_key_values=past_key_values, use_cache=use_cache).last_hidden_state

    @abstractmethod
    def logits(self, states: torch.Tensor, target: TargetProtocol) -> torch.Tensor:
        """Logits over the target's vocabulary after the head's ``states``."""

    def logits_on_ids(self, states: torch.Tensor, target: TargetProtocol) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits over the target ids the head drafts from (..., N), those ids (N,)); ids None:
        the whole vocabulary in id order. ``logits`` is these at their ids of a row of -inf: a
        drafter that only ranks tokens reads these instead, at N / V of the work."""
        return self.logits(states, target), None

    def restrict_vocabulary(self, target: TargetProtocol, ids: torch.Tensor | None) -> None:
        """Draft over target ids ``ids`` only (None: the whole vocabulary); heads with
        ``supports_restrict_vocabulary``."""
        raise NotImplementedError(f"{with_article(self.architecture)} head cannot draft over a subset of the target's vocabulary")

    def set_vocabulary(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Set the head's own draft vocabulary (draft id i is target id i + d2t[i]; t2d marks
        the members); heads with ``has_draft_vocabulary``."""
        raise NotImplementedError(f"{with_article(self.architecture)} head has no draft vocabulary of its own")

    @classmethod
    def card(cls, config, num_parameters: int | None = None, dtype: str | None = None) -> HeadCard:
        """This head's section of a model card (``HeadCard``), from its saved config. The
        default describes any head by its architecture and layer sizes; a head kind says more."""
        rows = [("architecture", cls.architecture), ("layer family", config.layer_family),
                ("decoder layers", config.num_hidden_layers), ("hidden size", config.hidden_size),
                ("intermediate size", config.intermediate_size),
                ("attention heads (KV heads)", f"{config.num_attention_heads} ({config.num_key_value_heads})"),
                ("visual decoupling", getattr(config, "decouple_visual", None)),
                ("M-RoPE sections", config.mrope_section),
                ("parameters", f"{num_parameters:,}" if num_parameters else None), ("dtype", dtype)]
        summary = (f"A draft head for lossless speculative decoding of a multimodal model: {with_article(cls.architecture)} "
                   "head. It is not a model on its own: it drafts from the target's features and embedding table, "
                   "and the target verifies every drafted token, so outputs are exactly the target's. Trained with "
                   "msd-train.")
        return HeadCard(name=f"{cls.architecture} draft head", summary=summary, rows=rows)

    @classmethod
    def card_training(cls, draft: dict) -> str | None:
        """The card's line on the head in one stage's training record (``draft``: that stage's
        ``cfg.draft``), or None: nothing beyond the stage's settings."""
        return None

    def unroll(self, inputs: dict, steps: int, forward=None) -> list[torch.Tensor]:
        """The head's states (B, T, H) for steps 0..steps-1 of the chain drafted from every
        anchor t of one pass (``inputs``: ``read_pass``'s), along the pass's own tokens:
        step i at anchor t reads the embedding e_{t+1+i} (every per-token input shifted by
        i), the head's own step i-1 state at t, at position id pos_t + i, and attends to the
        step-0 keys up to t and to the keys of its own chain (steps 1..i at t): exactly what
        a chain drafted from anchor t sees, the target's features committed up to t and the
        head's own predictions after. Step 0 is ``forward`` over the pass. Per-token inputs
        past the sequence's end are zeros (those positions are never loss positions).
        ``forward``: the callable that runs the head (the DeepSpeed engine in training)."""
        forward = forward or self
        states, pos = inputs["hidden_states"], inputs.get("position_ids")
        per_token = {k: v for k, v in inputs.items() if k not in ("hidden_states", "position_ids") and v is not None}
        embeds = inputs["input_embeds"]
        B, T = embeds.shape[:2]
        if pos is None:
            pos = torch.arange(T, device=embeds.device)[None].expand(B, T)
        cache = DynamicCache()
        causal = torch.ones(T, T, dtype=torch.bool, device=embeds.device).tril()
        own = torch.eye(T, dtype=torch.bool, device=embeds.device)
        outs = []
        for i in range(steps):
            mask = torch.cat([causal] + [own] * i, dim=1)[None, None].expand(B, 1, T, (i + 1) * T)
            states = forward(**{k: shift(v, i) for k, v in per_token.items()}, hidden_states=states,
                             position_ids=pos + i, attention_mask=mask, past_key_values=cache,
                             use_cache=True).last_hidden_state
            outs.append(states)
        return outs
