"""The interface every target family implements, and what it returns.

A target adapter wraps a frozen Hugging Face multimodal model and answers the questions
the rest of the project asks of it: how a conversation becomes token ids and a loss mask,
what the model's input embeddings and last hidden states are, where the visual tokens
sit, which position ids the model uses, and how to run its language model over a KV
cache with an arbitrary (tree) attention mask. Everything the reference implementation
hard-coded (image token id, visual tokens per image) is read from the model's config or
processor here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
from torch import nn

from msd_train.hf_compat import cache_kwargs, output_cache
from msd_train.targets.chat import Segment, render_prompt, render_segments
from msd_train.targets.tokenize import encode_segments, encode_segments_many


@dataclass
class Encoded:
    """One tokenised conversation.

    ``input_ids`` has image placeholders already expanded to one token per visual
    embedding; ``pixel`` holds the processor's image tensors for this sample (empty for
    text-only samples).
    """

    input_ids: torch.Tensor  # (L,)
    loss_mask: torch.Tensor  # (L,)
    pixel: dict[str, torch.Tensor] = field(default_factory=dict)
    num_images: int = 0


@dataclass
class Features:
    """What one frozen forward of the target yields for a batch."""

    inputs_embeds: torch.Tensor  # (B, L, H): text embeddings, projector outputs at visual slots
    hidden_states: torch.Tensor  # (B, L, H): last layer, after the final norm
    visual_mask: torch.Tensor  # (B, L) bool
    position_ids: torch.Tensor  # (B, L) for 1-D RoPE, (3, B, L) for M-RoPE
    rope_deltas: torch.Tensor | None = None  # (B,) M-RoPE: text position minus token index
    #: (B, L, k*H): the inputs of the k target layers a head reads (``DraftHead.feature_layers``),
    #: concatenated in that order; None when only the last layer's output was asked for
    layer_states: torch.Tensor | None = None
    #: (B, L) the target's top-1 id at each position (argmax of lm_head(hidden_states)) where a
    #: feature store holds it, -1 elsewhere; None when not known (the loss computes it)
    target_top: torch.Tensor | None = None


def eagle3_layers(num_layers: int, low: int = 2) -> list[int]:
    """EAGLE-3's layers: the inputs of layers ``low`` (2), N/2 and N-3, clamped into
    [0, N-1] and without repeats (a shallow target has fewer distinct layers to read)."""
    return sorted({min(max(i, 0), num_layers - 1) for i in (low, num_layers // 2, num_layers - 3)})


class Target(ABC):
    """Base class for a frozen multimodal target. Subclasses fill in the family specifics:
    the five abstract methods (images -> tensors and token counts, visual embeddings, image
    grids, position ids) and the class-level facts below.

    Everything the project knows about a family lives on its adapter class, so that adding
    a family touches its adapter, its ``conf/target`` file and its test. Class-level facts
    (readable from a config alone, without loading weights):

    * ``model_types`` / ``text_model_types``: the composite and text ``model_type`` values
      of the configs the adapter serves (``msd_train.targets.adapter_class`` looks them up);
    * ``draft_layer_family``, :meth:`mrope_section_of`, :meth:`rope_parameters_of`: what a
      draft head's layer and RoPE copy from the target (``MSDDraftConfig.from_target_config``);
    * :meth:`default_feature_layers`: the target layers an msd3 head reads by default;
    * ``display_name``, ``hub_tags``, ``reference_model_type``, ``published_targets``: how
      model cards and the released-head layout name the family;
    * ``shapes``: the published checkpoints' sizes, for benchmarks of random models.

    Per loaded target: :meth:`load_processor`, :meth:`encode` / :meth:`encode_prompt`
    (conversations with images, the chat template), :meth:`image_inputs` (each image's token
    count), :meth:`prompt_inputs` (what a forward over a prompt reads), :meth:`position_ids`
    / :meth:`continue_positions`, :meth:`run_for_head` (the language model over a KV cache
    with any attention mask: a tree's verification) and :meth:`features`.
    ``tests/contracts/test_target_contract.py`` holds every family to it.
    """

    family: str = "base"
    #: composite config model_types this adapter serves (``config.model_type``)
    model_types: tuple[str, ...] = ()
    #: text config model_types of those targets (what a draft head may be derived from)
    text_model_types: tuple[str, ...] = ()
    #: the draft head's decoder-layer family: "llama" (no attention bias) or "qwen2" (q/k/v bias)
    draft_layer_family: str = "llama"
    #: True when position ids are M-RoPE ids (3, B, L); False for 1-D RoPE (B, L)
    uses_mrope: bool = False
    #: how model cards name the family, and the Hub tags they carry
    display_name: str = "base"
    hub_tags: tuple[str, ...] = ()
    #: model_type of the released MSD heads' config.json for this family (None: none released)
    reference_model_type: str | None = None
    #: True when the processor's tokens (``<image>``, padding) were appended after the language
    #: model's own vocabulary, whose size is then the tokenizer's ``vocab_size`` (llava-hf)
    vocab_appended: bool = False
    #: hidden size -> (Hub id, vocabulary rows) of the targets released heads were trained for
    published_targets: dict[int, tuple[str, int]] = {}
    #: the oldest transformers this family's adapter was tested on, where newer than the
    #: project's floor (``wrap_target`` refuses an older one, naming the upgrade)
    min_transformers: str | None = None
    #: published checkpoints' shapes, for benchmarks of random models of their size: name ->
    #: ``text`` / ``vision`` (config keywords), ``image_side`` (a benchmark image's side in
    #: pixels) and ``visual`` (its visual tokens)
    shapes: dict[str, dict] = {}
    #: the placeholder string the processor expands, e.g. "<image>" or "<|image_pad|>"
    image_text: str
    #: text that stands for one image in a rendered prompt (placeholder plus wrappers)
    image_prompt_text: str

    def __init__(self, model: nn.Module, processor, name: str, chat_template: str | None):
        self.model = model.eval().requires_grad_(False)
        self._config = model.config
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.name = name
        self.chat_template = chat_template or self.tokenizer.chat_template
        if self.chat_template is None:
            raise ValueError(
                f"target {name} has no chat template; set target.chat_template "
                "(vicuna_v1 for LLaVA-1.5, chatml_qwen for Qwen2-VL)"
            )

    # ----- family facts from a config (no weights) ----------------------------------------
    @classmethod
    def mrope_section_of(cls, text_config) -> list[int] | None:
        """The M-RoPE split of the rotary frequencies (temporal, height, width), or None."""
        rope = text_config.rope_parameters or {}
        return list(rope["mrope_section"]) if rope.get("mrope_section") else None

    @classmethod
    def rope_parameters_of(cls, text_config) -> dict:
        """The text model's RoPE parameters without the M-RoPE entries (``mrope_section_of``)."""
        import copy

        rope = copy.deepcopy(text_config.rope_parameters) or {}
        for key in ("mrope_section", "mrope_interleaved"):
            rope.pop(key, None)
        return rope

    @classmethod
    def default_feature_layers(cls, config) -> list[int]:
        """The target layers (inputs, HF ``hidden_states[i]``) an msd3 head reads by default:
        EAGLE-3's 2, N/2 and N-3, clamped into [0, N-1] and without repeats."""
        return eagle3_layers(config.get_text_config(decoder=True).num_hidden_layers)

    @classmethod
    def load_processor(cls, name_or_path: str, trust_remote_code: bool = False):
        """The target's processor (tokenizer + image processor) from a folder or Hub id."""
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)

    # ----- identity -------------------------------------------------------------------
    @property
    def config(self):
        return self._config

    def tokenizing_view(self) -> Target:
        """A copy without the model: enough to encode conversations, cheap to pickle
        into ``datasets.map`` worker processes."""
        import copy

        view = copy.copy(self)
        view.model = None
        return view

    @property
    def text_config(self):
        return self.config.text_config

    @property
    def hidden_size(self) -> int:
        return self.text_config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.text_config.vocab_size

    @property
    def image_token_id(self) -> int:
        return self.config.image_token_id

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def eos_token_ids(self) -> list[int]:
        ids = self.model.generation_config.eos_token_id if self.model.generation_config else None
        if ids is None:
            ids = self.tokenizer.eos_token_id
        return [ids] if isinstance(ids, int) else list(ids)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.lm_head

    @property
    def language_model(self) -> nn.Module:
        return self.model.model.language_model

    # ----- formatting -----------------------------------------------------------------
    def template_vars(self) -> dict[str, str]:
        return {"eos_token": self.tokenizer.eos_token or "", "bos_token": self.tokenizer.bos_token or ""}

    def add_bos(self) -> bool:
        return True

    @property
    def end_of_turn(self) -> str:
        """The text that closes an assistant turn (the last token that carries loss)."""
        return self.tokenizer.eos_token

    @abstractmethod
    def image_inputs(self, images: list) -> tuple[dict[str, torch.Tensor], list[int]]:
        """Processor tensors for ``images`` (PIL) and the visual tokens each one expands to."""

    @abstractmethod
    def image_token_counts(self, sizes: list[tuple[int, int]]) -> list[int]:
        """The visual tokens of images of these (width, height) sizes, without their pixels:
        the family's rule, the arithmetic its processor applies (equal to ``image_inputs``'
        counts; ``tests/unit/test_data_scale.py`` holds every family to it)."""

    def encode(self, messages: list[dict], images: list = (), counts: list[int] | None = None) -> Encoded:
        """A conversation (``<image>`` markers in the text, PIL images) -> ids and loss mask.

        The loss mask is 1 exactly on the assistant turns' tokens, each turn's
        end-of-turn token included. With ``counts`` (each image's visual tokens, e.g. from
        :meth:`image_token_counts`) no image is needed and no pixels are computed.
        """
        if counts is not None:
            [(ids, mask)] = self.encode_many([(messages, counts)])
            return Encoded(torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long), {}, len(counts))
        segments = render_segments(
            messages, self.chat_template, self.image_prompt_text, self.end_of_turn,
            **self.template_vars(),
        )
        return self._encode_rendered(segments, images)

    def encode_many(self, conversations: list[tuple[list[dict], list[int]]]) -> list[tuple[list[int], list[int]]]:
        """``encode(messages, counts=counts)`` of many ``(messages, counts)`` pairs, as lists of
        ids and loss mask, with one tokenizer call for all of them: what the data cache's
        tokenising workers run (no tensors, no pixels)."""
        special, end_of_turn = self.template_vars(), self.end_of_turn
        segments = [render_segments(m, self.chat_template, self.image_prompt_text, end_of_turn, **special)
                    for m, _ in conversations]
        return encode_segments_many(self.tokenizer, segments, self.image_text, self.image_token_id,
                                    [c for _, c in conversations], bos=self.add_bos())

    def encode_prompt(self, messages: list[dict], images: list) -> Encoded:
        """The ids a target reads before generating the next assistant turn (no loss).

        The prompt is tokenised as one piece, as the target's own processor would, not
        turn by turn as ``encode`` does for an exact loss mask.
        """
        text = render_prompt(messages, self.chat_template, self.image_prompt_text, **self.template_vars())
        return self._encode_rendered([Segment(text, False)], images)

    def _encode_rendered(self, segments: list[Segment], images: list) -> Encoded:
        """Rendered segments and their images -> ``Encoded`` (what both encoders share)."""
        pixel, counts = self.image_inputs(images) if images else ({}, [])
        ids, mask = encode_segments(
            self.tokenizer, segments, self.image_text, self.image_token_id, counts, bos=self.add_bos()
        )
        return Encoded(ids, mask, pixel, len(images))

    # ----- forward pieces -------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor, pixel: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Input embeddings: the token table, with projector outputs at visual slots."""
        embeds = self.embed_tokens(input_ids)
        if pixel:
            visual = self.visual_embeddings(pixel).to(embeds.dtype)
            slots = (input_ids == self.image_token_id).unsqueeze(-1).expand_as(embeds)
            if int(slots[..., 0].sum()) != visual.shape[0]:
                raise ValueError(
                    f"{int(slots[..., 0].sum())} image tokens in the ids but the vision tower "
                    f"produced {visual.shape[0]} visual embeddings"
                )
            embeds = embeds.masked_scatter(slots, visual)
        return embeds

    def prompt_inputs(self, input_ids: torch.Tensor, pixel: dict[str, torch.Tensor] | None = None
                      ) -> tuple[torch.Tensor, dict]:
        """What a forward over a prompt with images reads: the input embeddings (``embed``)
        and the extra language-model inputs the family needs beside them (Qwen3-VL's
        deepstack features; none for the others), to pass to ``run_for_head(extras=...)``."""
        return self.embed(input_ids, pixel), {}

    @abstractmethod
    def visual_embeddings(self, pixel: dict[str, torch.Tensor]) -> torch.Tensor:
        """All images' projector outputs, concatenated: (total visual tokens, H)."""

    @abstractmethod
    def image_grids(self, pixel: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
        """(rows, columns) of each image's visual tokens, in order (row-major in the ids)."""

    @abstractmethod
    def position_ids(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, pixel: dict
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Position ids of a (padded, right-padded) batch and, for M-RoPE, the rope deltas."""

    def continue_positions(self, start: int, n: int, rope_deltas: torch.Tensor | None) -> torch.Tensor:
        """Position ids of ``n`` text tokens placed after ``start`` cached tokens (batch 1).

        The decoder adds tree depths to these; for M-RoPE text tokens all three axes
        share one value, offset by the prompt's rope delta.
        """
        pos = torch.arange(start, start + n, device=self.device).unsqueeze(0)
        return pos

    def run_language_model(
        self,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
        use_cache: bool = False,
        extras: dict | None = None,
    ):
        """The language model alone; returns (post-norm hidden states, cache)."""
        hidden, cache, _ = self.run_for_head(inputs_embeds, position_ids, attention_mask, past_key_values, use_cache,
                                             extras=extras)
        return hidden, cache

    def run_for_head(
        self,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
        use_cache: bool = False,
        layers: list[int] | None = None,
        extras: dict | None = None,
    ):
        """``run_language_model`` plus the features a head reads: returns (post-norm hidden
        states, cache, head features). The head features are the post-norm states when
        ``layers`` is None, else the inputs of those layers concatenated (B, T, k*H).
        ``extras``: the second half of ``prompt_inputs`` for a forward over a prompt."""
        out = self.language_model(
            inputs_embeds=inputs_embeds,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=use_cache,
            output_hidden_states=layers is not None,
            **cache_kwargs(past_key_values),
            **(extras or {}),
        )
        if layers is None:
            return out.last_hidden_state, output_cache(out), out.last_hidden_state
        # hidden_states[i] is the input of layer i (hidden_states[0]: the embeddings)
        states = torch.cat([out.hidden_states[i] for i in layers], dim=-1)
        return out.last_hidden_state, output_cache(out), states

    @torch.no_grad()
    def features(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, pixel: dict | None = None,
        layers: list[int] | None = None,
    ) -> Features:
        """One frozen forward: embeddings, last hidden states, visual mask, positions, and
        with ``layers`` the inputs of those layers (``Features.layer_states``)."""
        pixel = {k: v.to(self.device) for k, v in (pixel or {}).items()}
        input_ids = input_ids.to(self.device)
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device)
        embeds, extras = self.prompt_inputs(input_ids, pixel)
        pos, deltas = self.position_ids(input_ids, attention_mask, pixel)
        hidden, _, states = self.run_for_head(embeds, pos, attention_mask, layers=layers, extras=extras)
        return Features(embeds, hidden, input_ids == self.image_token_id, pos, deltas,
                        None if layers is None else states)
