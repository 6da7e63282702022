"""The draft classes the vLLM plugin registers (see ``vllm_plugin``); imported by vLLM only.

MSD's decoupling in vLLM. The proposer hands the draft slot t the token t+1 and the
target's hidden state h_t; with a draft class that declares
``supports_multimodal_embeddings`` it first calls ``embed_input_ids(input_ids,
multimodal_embeddings, is_multimodal)`` with the target's visual embeddings of token t+1
(``gpu_model_runner._gather_mm_embeddings(shift_computed_tokens=1)``) and then
``forward(inputs_embeds=...)``. So slot t sees e_{t+1}, visual at image slots: the
``"released"`` offset of ``msd_train.draft.model.align_inputs``, where slot t is replaced
when token t+1 is visual. ``embed_input_ids`` keeps that mask for the ``forward`` that
follows it (drafting steps after the first call it with text tokens only: no slot is
visual there). The ``"paper"`` offset (slot t replaced when token t is visual) would need
token t's embedding at slot t, which the proposer does not pass: such heads are refused.

A dflash head (``MSDDFlashForCausalLM``, method ``dflash``) is vLLM's DFlash draft with
this project's layers. vLLM's DFlash proposer (``v1/spec_decode/dflash.py``) writes the
context's keys and values from the fused target features (``combine_hidden_states``, then
``precompute_and_store_context_kv``) and runs the block [root, mask x k] non-causally over
them, as the head does; what differs is held here: Llama-family layers (no per-head q/k
norms), the learned mask embedding (``mask_embedding.pt``, under a mask id no target token
has), the fused layers in the head's order, the draft vocabulary, and with
``decouple_visual`` the visual path: a context entry at an image position is
``visual_norm`` of the target's input embedding there. vLLM captures that embedding as the
input of target layer 0 (the export lists it in ``target_layer_ids``), but its proposer
hands the draft only hidden states: which context tokens are images it does not say. So
the plugin wraps ``DFlashProposer.propose`` (once, when such a head loads) to hand the draft
the context's token ids first (``take_context_ids``); image positions are those holding the
target's image token (``image_token_index``, which the proposer copies onto the draft's
config).
"""

from __future__ import annotations

import functools
import inspect
import logging
from itertools import chain
from pathlib import Path

import torch
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import QKVParallelLinear, ReplicatedLinear
from vllm.model_executor.models.llama_eagle import EagleLlamaForCausalLM
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Attention, DFlashQwen3ForCausalLM, DFlashQwen3Model
from vllm.model_executor.models.utils import _merge_multimodal_embeddings

log = logging.getLogger(__name__)


def _msd_block(config, architecture: str) -> dict | None:
    block = getattr(config, "msd", None)
    if isinstance(block, dict) and block.get("architecture") == architecture:
        return block
    return None


def _extras(vllm_config, block: dict, name: str | None = None) -> dict[str, torch.Tensor]:
    """The tensors the export kept out of model.safetensors (``msd_train.hub.vllm.EXTRAS``),
    or those of another file of the folder (``name``); {} when it has none."""
    from safetensors.torch import load_file

    model = vllm_config.speculative_config.draft_model_config.model
    folder = Path(model)
    name = name or block.get("extras") or "msd/extras.safetensors"
    if not folder.is_dir():  # a Hub id: fetch the one file beside the weights vLLM fetched
        from huggingface_hub import hf_hub_download

        try:
            return load_file(hf_hub_download(model, name))
        except Exception:  # the head has no extras (e.g. an msd3 head)
            return {}
    path = folder / name
    return load_file(str(path)) if path.is_file() else {}


def check_block(block: dict) -> None:
    """Refuse a folder whose head this plugin would serve otherwise than it was trained
    (``msd_train.hub.vllm.vllm_refusals``: the export refuses these heads; a folder written
    by hand or by an older export may still carry one)."""
    from msd_train.hub.vllm import vllm_refusals

    refused = vllm_refusals(block)
    if refused:
        raise ValueError(f"the vLLM plugin of msd-train cannot serve this {block.get('architecture')} head as it "
                         "was trained: " + "; ".join(refused))


class _VisualSlots:
    """Keeps ``is_multimodal`` from ``embed_input_ids`` for the ``forward`` that follows."""

    _pending: torch.Tensor | None = None

    def _embed(self, embed_tokens, input_ids, multimodal_embeddings, is_multimodal):
        embeds = embed_tokens(input_ids)
        self._pending = None
        if multimodal_embeddings is not None and is_multimodal is not None and len(multimodal_embeddings) > 0:
            is_multimodal = is_multimodal.to(embeds.device)
            embeds = _merge_multimodal_embeddings(embeds, multimodal_embeddings, is_multimodal)
            self._pending = is_multimodal
        return embeds

    def _take_visual(self, rows: int, device) -> torch.Tensor | None:
        mask, self._pending = self._pending, None
        if mask is None or not bool(mask.any()):
            return None
        out = torch.zeros(rows, dtype=torch.bool, device=device)
        n = min(rows, mask.shape[0])
        out[:n] = mask[:n]
        return out


class MSDEagleLlamaForCausalLM(_VisualSlots, EagleLlamaForCausalLM):
    """vLLM's EAGLE draft, plus what an msd head has: the fc bias, decoupled visual slots,
    a first-layer input norm and Qwen2 q/k/v biases when the head has them."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.msd = _msd_block(self.config, "msd")
        # read by the proposer (``supports_multimodal_embeddings``) on the instance
        self.supports_multimodal_embeddings = bool(self.msd and self.msd.get("decouple_visual"))
        if self.msd is None:
            return
        check_block(self.msd)
        m, c = self.model, self.config
        if self.msd.get("fc_bias"):
            m.fc = ReplicatedLinear(input_size=2 * c.hidden_size, output_size=c.hidden_size, bias=True,
                                    params_dtype=vllm_config.model_config.dtype, quant_config=m.quant_config,
                                    prefix="model.fc", return_bias=False)
        if self.msd.get("first_layer_input_norm"):
            m.layers[0].input_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        from msd_train.draft.families import layer_family  # as msd_train.hub.vllm: only once a head loads

        if layer_family(self.msd.get("layer_family") or "llama").qkv_bias:
            for layer in m.layers:
                old = layer.self_attn.qkv_proj
                layer.self_attn.qkv_proj = QKVParallelLinear(
                    c.hidden_size, layer.self_attn.head_dim, layer.self_attn.total_num_heads,
                    layer.self_attn.total_num_kv_heads, bias=True, quant_config=m.quant_config,
                    prefix=getattr(old, "prefix", ""))
        self._vllm_config = vllm_config

    def embed_input_ids(self, input_ids, multimodal_embeddings=None, is_multimodal=None):
        if not self.supports_multimodal_embeddings:
            return super().embed_input_ids(input_ids)
        return self._embed(self.model.embed_tokens, input_ids, multimodal_embeddings, is_multimodal)

    def forward(self, input_ids, positions, hidden_states, inputs_embeds=None):
        if self.msd is None:
            return super().forward(input_ids, positions, hidden_states, inputs_embeds)
        m = self.model
        embeds = m.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        x = m.fc(torch.cat((embeds, hidden_states), dim=-1))
        visual = self._take_visual(x.shape[0], x.device)
        if visual is not None:  # decoupling: a visual slot's layer input is the visual embedding itself
            x = torch.where(visual[:, None], embeds.to(x.dtype), x)
        residual = None
        for layer in m.layers:
            x, residual = layer(positions, x, residual)
        x = x + residual
        return x, x

    def load_weights(self, weights):
        if self.msd is None:
            return super().load_weights(weights)
        extras = _extras(self._vllm_config, self.msd)
        return super().load_weights(chain(weights, extras.items()))


class MSDEagle3LlamaForCausalLM(_VisualSlots, Eagle3LlamaForCausalLM):
    """vLLM's EAGLE-3 draft reading the target's visual embeddings at image positions,
    as an msd3 head with ``decouple_visual`` was trained (stock: the placeholder's)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.msd = _msd_block(self.config, "msd3")
        self.supports_multimodal_embeddings = bool(self.msd and self.msd.get("decouple_visual"))
        if self.msd is not None:
            check_block(self.msd)

    def embed_input_ids(self, input_ids, multimodal_embeddings=None, is_multimodal=None):
        if not self.supports_multimodal_embeddings:
            return super().embed_input_ids(input_ids, multimodal_embeddings, is_multimodal)
        embeds = self._embed(self.model.embed_tokens, input_ids, multimodal_embeddings, is_multimodal)
        self._pending = None  # the visual embedding is the embedding stream itself: no slot is replaced
        return embeds


# ----- dflash ----------------------------------------------------------------------------

class _LayerAttention(DFlashQwen3Attention):
    """vLLM's DFlash attention without the per-head q/k norms: the head's layers are of its
    target's family (Llama), which has none. (The norms' modules stay, unused: vLLM's context
    precomputation reads their epsilon.)"""

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        output, _ = self.o_proj(self.attn(q, k, v))
        return output


class MSDDFlashModel(DFlashQwen3Model):
    """vLLM's DFlash draft body with this project's head: its layers, fc over the fused layers
    in the head's order, the visual path, the mask embedding under an id no target token has."""

    def __init__(self, *, vllm_config, start_layer_id: int = 0, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, start_layer_id=start_layer_id, prefix=prefix)
        block = _msd_block(self.config, "dflash")
        if block is None:
            raise ValueError(f"{vllm_config.speculative_config.draft_model_config.model}: a DFlashMSDDraftModel folder "
                             "is written by msd-train's format=vllm export, with an \"msd\" block naming architecture "
                             "dflash in its config.json; this one has none. Export the head again")
        check_block(block)
        from msd_train.hub.vllm import captured_layers

        self.msd = block
        for layer in self.layers:
            layer.self_attn.__class__ = _LayerAttention
        captured = captured_layers(block)
        # vLLM concatenates the captured layers' states in layer order, each once; the head's fc
        # reads its feature layers in its own order
        self.feature_index = [captured.index(j) for j in block["feature_layers"]]
        self.embed_index = captured.index(0) if block.get("decouple_visual") else None
        self.num_captured = len(captured)
        c = self.config
        width = getattr(c, "target_hidden_size", None) or c.hidden_size
        self.fc = ReplicatedLinear(input_size=width * len(self.feature_index), output_size=c.hidden_size, bias=False,
                                   params_dtype=vllm_config.model_config.dtype, quant_config=self.quant_config,
                                   prefix=f"{prefix}.fc" if prefix else "fc", return_bias=False)
        self.visual_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps) if self.embed_index is not None else None

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings (the target's table), ``mask_embedding`` at the mask id (no target
        token: it is looked up as token 0 and replaced)."""
        is_mask = input_ids == self.mask_token_id
        embeds = self.embed_tokens(torch.where(is_mask, torch.zeros_like(input_ids), input_ids))
        return torch.where(is_mask[:, None], self.mask_embedding.to(embeds.dtype), embeds)

    def context(self, captured: torch.Tensor, visual: torch.Tensor | None) -> torch.Tensor:
        """The head's context entries of T positions from vLLM's captured states (T, n*H):
        hidden_norm(fc(feature layers)), visual_norm(embedding) where ``visual``."""
        rows = captured.view(captured.shape[0], self.num_captured, -1)
        out = self.hidden_norm(self.fc(rows[:, self.feature_index].flatten(1)))
        if self.visual_norm is not None and visual is not None and bool(visual.any()):
            out = torch.where(visual[:, None], self.visual_norm(rows[:, self.embed_index].contiguous()), out)
        return out

    def _project_context_kv(self, context_states, num_ctx, num_layers, num_kv_heads, head_dim):
        """vLLM's, without its hidden_norm: ``context`` gave the entries normed (the visual ones
        by their own norm)."""
        kv = [proj(context_states)[0][:, q_size:].view(num_ctx, 2, num_kv_heads, head_dim)
              for proj, q_size in zip(self._context_qkv_projs, self._context_q_sizes, strict=True)]
        all_kv = torch.stack(kv, dim=1).permute(2, 1, 0, 3, 4).contiguous()
        return all_kv[0], all_kv[1]

    def _normalize_context_k(self, all_k: torch.Tensor) -> torch.Tensor:
        return all_k  # no per-head k norm in the head's layers


class MSDDFlashForCausalLM(DFlashQwen3ForCausalLM):
    """A dflash head exported with format=vllm, served as trained (module docstring)."""

    model_cls = MSDDFlashModel

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.msd = self.model.msd
        self._vllm_config = vllm_config
        k = vllm_config.speculative_config.num_speculative_tokens
        block = int(self.msd["block_size"])
        if k != block - 1:
            raise ValueError(f"num_speculative_tokens={k}: this dflash head was trained on blocks of {block} (the root "
                             f"and {block - 1} masks, attending to each other both ways), and vLLM's block is the root "
                             f"and num_speculative_tokens masks; give num_speculative_tokens={block - 1}")
        self._context_ids: torch.Tensor | None = None
        self._vocab_mask: torch.Tensor | None = None
        if self.model.visual_norm is not None:
            _hand_context_ids_to_the_draft()

    def take_context_ids(self, token_ids: torch.Tensor) -> None:
        """The token ids of the context rows the next ``combine_hidden_states`` is given."""
        self._context_ids = token_ids

    def combine_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        squeeze = hidden_states.dim() == 1
        if squeeze:
            hidden_states = hidden_states.unsqueeze(0)
        ids, self._context_ids = self._context_ids, None
        visual = None
        image = getattr(self.config, "image_token_index", None)
        if ids is not None and image is not None and ids.shape[0] == hidden_states.shape[0]:
            visual = ids.to(hidden_states.device) == image
        out = self.model.context(hidden_states, visual)
        return out.squeeze(0) if squeeze else out

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden_states)
        if self._vocab_mask is None or logits is None:
            return logits
        mask = self._vocab_mask.to(logits.device)
        return logits.masked_fill(~mask[: logits.shape[-1]], float("-inf"))

    def load_weights(self, weights):
        extras = _extras(self._vllm_config, self.msd)
        keep = {k: v for k, v in extras.items() if k == "visual_norm.weight" and self.model.visual_norm is not None}
        super().load_weights(chain(weights, keep.items()))
        if self.model.mask_token_id is None or not self.model.has_separate_mask_embedding:
            raise ValueError("a dflash export holds its mask embedding in mask_embedding.pt under "
                             "dflash_config.mask_token_id; this folder has none. Export the head again")
        size = self.msd.get("train_vocab")
        vocab = self.config.vocab_size
        if size is not None and size < vocab:
            counts = _extras(self._vllm_config, self.msd, "msd/token_counts.safetensors").get("counts")
            if counts is None:
                raise ValueError(f"train_vocab={size}: the head drafts over the {size} most frequent tokens of its "
                                 "token counts (msd/token_counts.safetensors), which this folder lacks; export again")
            from msd_train.draft.vocabulary import most_frequent

            mask = torch.zeros(vocab, dtype=torch.bool)
            mask[most_frequent(counts, int(size))] = True
            self._vocab_mask = mask


def _hand_context_ids_to_the_draft() -> None:
    """Wrap ``DFlashProposer.propose`` (once per process) to hand a draft that asks for them
    (``take_context_ids``) the context's token ids before the proposer combines the
    context's hidden states: vLLM 0.32's DFlash proposer passes the draft no token ids and
    no multimodal inputs (``build_model_inputs_first_pass`` drops them)."""
    from vllm.v1.spec_decode.dflash import DFlashProposer

    inner = DFlashProposer.propose
    if getattr(inner, "_msd_context_ids", False):
        return
    signature = inspect.signature(inner)

    @functools.wraps(inner)
    def propose(self, *args, **kwargs):
        model = self.model.unwrap() if hasattr(self.model, "unwrap") else self.model
        take = getattr(model, "take_context_ids", None)
        if take is not None:
            take(signature.bind(self, *args, **kwargs).arguments["target_token_ids"])
        return inner(self, *args, **kwargs)

    propose._msd_context_ids = True
    DFlashProposer.propose = propose
