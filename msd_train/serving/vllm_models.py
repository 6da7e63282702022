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
"""

from __future__ import annotations

import logging
from itertools import chain
from pathlib import Path

import torch
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import QKVParallelLinear, ReplicatedLinear
from vllm.model_executor.models.llama_eagle import EagleLlamaForCausalLM
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
from vllm.model_executor.models.utils import _merge_multimodal_embeddings

log = logging.getLogger(__name__)


def _msd_block(config, architecture: str) -> dict | None:
    block = getattr(config, "msd", None)
    if isinstance(block, dict) and block.get("architecture") == architecture:
        return block
    return None


def _extras(vllm_config, block: dict) -> dict[str, torch.Tensor]:
    """The tensors the export kept out of model.safetensors (``msd_train.hub.vllm.EXTRAS``)."""
    from safetensors.torch import load_file

    model = vllm_config.speculative_config.draft_model_config.model
    folder = Path(model)
    name = block.get("extras") or "msd/extras.safetensors"
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
