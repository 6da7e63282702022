"""What the rest of the project uses of a target, declared: ``TargetProtocol``.

The trainer (``training/``), the feature sources (``features/``), the datasets
(``data/``), the decoder (``decoding/``) and the hub read a loaded target only through
these members; an adapter (``targets.base.Target`` and its five families) may hold more,
for its own use. ``tests/contracts/test_target_contract.py`` checks that every family's adapter
satisfies the protocol, so a sixth family (or a stand-in in a test) knows what to provide.

Class-level facts that code outside ``targets/`` reads from an adapter class (through
``adapter_class`` / ``head_family``, before any target is loaded) are declared as
``ClassVar``\\ s; the rest are what a loaded target answers.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from msd_train.targets.base import Encoded, Features


@runtime_checkable
class TargetProtocol(Protocol):
    # ----- the family's facts (class level) ----------------------------------------------
    family: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    draft_layer_family: ClassVar[str]  # the head's decoder-layer family (msd_train.draft.families)
    uses_mrope: ClassVar[bool]
    display_name: ClassVar[str]
    hub_tags: ClassVar[tuple[str, ...]]
    reference_model_type: ClassVar[str | None]
    vocab_appended: ClassVar[bool]

    # ----- identity -----------------------------------------------------------------------
    name: str
    tokenizer: Any
    chat_template: str | None

    @property
    def config(self) -> Any: ...  # the composite transformers config

    @property
    def text_config(self) -> Any: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def image_token_id(self) -> int: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def eos_token_ids(self) -> list[int]: ...

    @property
    def embed_tokens(self) -> nn.Embedding: ...

    @property
    def lm_head(self) -> nn.Linear: ...

    @classmethod
    def default_feature_layers(cls, config) -> list[int]: ...

    # ----- text and images -> ids ---------------------------------------------------------
    def tokenizing_view(self) -> TargetProtocol: ...

    def image_inputs(self, images: list) -> tuple[dict[str, torch.Tensor], list[int]]: ...

    def image_token_counts(self, sizes: list[tuple[int, int]]) -> list[int]: ...  # (width, height) -> visual tokens

    def template_vars(self) -> dict[str, str]: ...

    def encode(self, messages: list[dict], images: list = (), counts: list[int] | None = None) -> Encoded: ...

    def encode_many(self, conversations: list[tuple[list[dict], list[int]]]) -> list[tuple[list[int], list[int]]]: ...

    def encode_prompt(self, messages: list[dict], images: list) -> Encoded: ...

    # ----- ids -> embeddings, positions ---------------------------------------------------
    def embed(self, input_ids: torch.Tensor, pixel: dict[str, torch.Tensor] | None = None) -> torch.Tensor: ...

    def prompt_inputs(self, input_ids: torch.Tensor, pixel: dict[str, torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, dict]: ...

    def image_grids(self, pixel: dict[str, torch.Tensor]) -> list[tuple[int, int]]: ...

    def position_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, pixel: dict
                     ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def continue_positions(self, start: int, n: int, rope_deltas: torch.Tensor | None) -> torch.Tensor: ...

    # ----- forwards -----------------------------------------------------------------------
    def run_language_model(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor,
                           attention_mask: torch.Tensor | None = None, past_key_values=None,
                           use_cache: bool = False, extras: dict | None = None): ...

    def run_for_head(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor,
                     attention_mask: torch.Tensor | None = None, past_key_values=None, use_cache: bool = False,
                     layers: list[int] | None = None, extras: dict | None = None): ...

    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 pixel: dict | None = None, layers: list[int] | None = None) -> Features: ...


#: the members of the protocol (what the contract test checks on every adapter)
PROTOCOL_MEMBERS: tuple[str, ...] = tuple(sorted(
    name for name in {*TargetProtocol.__annotations__, *vars(TargetProtocol)}
    if not name.startswith("_")))
