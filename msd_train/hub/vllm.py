"""The layouts vLLM serves, for msd and msd3 heads, and their load-back.

``msd`` head -> vLLM's native EAGLE layout (``speculative_config={"method": "eagle", ...}``):
    config.json       a LlamaConfig with ``architectures: ["LlamaForCausalLM"]`` (vLLM names
                      the draft class ``Eagle`` + that, ``EagleLlamaForCausalLM``), the
                      head's layer count, ``vocab_size`` of the target, plus an ``"msd"``
                      block (below)
    model.safetensors ``fc.weight [H, 2H]`` and ``layers.N.*`` under transformers' names;
                      no embedding, no lm_head (vLLM shares the target's)
``msd3`` head -> the speculators EAGLE-3 layout (``method`` "eagle3", read from the folder):
    config.json       ``speculators_model_type: "eagle3"``, ``speculators_config`` (verifier,
                      ``proposal_methods[0].speculative_tokens``), ``transformer_layer_config``
                      (the layer's LlamaConfig), ``draft_vocab_size``, ``target_hidden_size``,
                      ``eagle_aux_hidden_state_layer_ids``, ``norm_before_residual: false``
                      (vLLM's default for the format is true; MSD-3's residual is the
                      un-normalised state), plus the ``"msd"`` block
    model.safetensors ``fc.weight``, ``layers.0.*`` (q/k/v take 2H; ``hidden_norm``),
                      ``norm.weight``, ``lm_head.weight``, ``d2t``/``t2d`` when the draft
                      vocabulary is smaller than the target's

``dflash`` head -> vLLM's DFlash layout (``speculative_config={"method": "dflash",
"num_speculative_tokens": block_size - 1}``), under an architecture only this project's
plugin registers:
    config.json       a LlamaConfig of the head's layers with ``architectures:
                      ["DFlashMSDDraftModel"]``, ``block_size``, ``target_hidden_size`` and
                      ``dflash_config``: ``target_layer_ids`` (DFlash names a layer by its
                      output, this project by its input: j here is j-1 there; -1, the
                      target's input embeddings, is added for ``decouple_visual``, whose
                      context reads them at image positions), ``mask_token_id`` (the
                      target's vocabulary size: no target token, so a block's root is never
                      taken for a mask); plus the ``"msd"`` block
    model.safetensors ``fc.weight``, ``hidden_norm.weight``, ``layers.N.*``, ``norm.weight``
                      under DFlash's names; no embedding, no lm_head (the target's)
    mask_embedding.pt the learned mask embedding, as vLLM's DFlash loader reads a
                      separately trained one (``{"mask_token_id", "embedding"}``)
    msd/extras.safetensors ``visual_norm.weight`` (the decoupled visual path)
    msd/token_counts.safetensors the head's token counts, when it has them (its draft
                      vocabulary, ``train_vocab``, is their most frequent ids)
Stock vLLM has no class for it: its DFlash draft (``qwen3_dflash.py``) is Qwen3's, with
per-head q/k norms that this head's Llama-family layers lack, so it would draft otherwise
than the head was trained; the plugin's ``MSDDFlashForCausalLM`` serves it.

What the stock vLLM classes cannot express is kept where stock vLLM does not look and
this project's plugin (``msd_train.serving.vllm_plugin``) does:
    - the ``"msd"`` block of config.json: decoupling, visual offset, draft positions, the
      trained fields; vLLM's config classes carry unknown keys along unread;
    - ``msd/extras.safetensors``: tensors the stock class has no parameter for (the msd
      head's fc bias, a first-layer input norm, Qwen2 q/k/v biases). vLLM's loader reads
      only ``*.safetensors`` at the top of the folder, and its AutoWeightsLoader raises on
      any name the class lacks, so they cannot sit in model.safetensors.
``export_vllm`` returns (and scripts/export.py prints) what stock vLLM loses.

What the plugin cannot serve as trained is refused at export (``vllm_refusals``), each
setting named with the format that keeps it, rather than written into a folder that would
draft differently from the head evaluated: draft-side visual compression (vLLM's draft
keeps every visual token in its cache), ``visual_offset="paper"`` (vLLM hands slot t the
embedding of token t+1), ``draft_positions="1d"`` on an M-RoPE head (vLLM passes the
draft the target's M-RoPE positions), Qwen2 layers in an msd3 head (the plugin's EAGLE-3
class has no q/k/v bias), and for a dflash head M-RoPE (vLLM's parallel drafting refuses an M-RoPE
draft and passes a 1-D one the target's temporal row), q/k/v biases and an activation other
than SiLU (vLLM's DFlash layer has neither). What it keeps: decoupling, the fc bias, a first-layer input
norm, Qwen2 biases of an msd head (the plugin), the fused target layers
(``eagle_aux_hidden_state_layer_ids``: vLLM captures the input of each named layer, as
``feature_layers`` means) and the draft vocabulary (``d2t``) (stock vLLM).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from msd_train.draft import MSD3DraftConfig, MSD3DraftModel, MSDDraftConfig, MSDDraftModel
from msd_train.draft.families import layer_family
from msd_train.draft.head import DraftHead, head_class, head_class_of_config
from msd_train.formatting import with_article
from msd_train.hub.folders import IncompleteHeadError
from msd_train.hub.formats import HeadFormat
from msd_train.runtime import atomic_dir, resolve_dtype
from msd_train.targets.protocol import TargetProtocol

log = logging.getLogger(__name__)

EXTRAS = "msd/extras.safetensors"
COUNTS = "msd/token_counts.safetensors"
EAGLE_ARCHITECTURE = "LlamaForCausalLM"
#: the architecture name of a dflash export: registered by this project's plugin only
DFLASH_ARCHITECTURE = "DFlashMSDDraftModel"
#: the file vLLM's DFlash loader reads a separately trained mask embedding from
MASK_EMBEDDING = "mask_embedding.pt"
#: speculative tokens written into a speculators config (vLLM's default k for the head;
#: ``num_speculative_tokens`` at serving time overrides it)
DEFAULT_SPECULATIVE_TOKENS = 5

_LAYER_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "rms_norm_eps", "hidden_act", "max_position_embeddings")
_QWEN2_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
_KEEP = "format=msd keeps it (served by this project's decoder: eval.py, msd_train.decoding)"


def _architecture(config) -> str | None:
    """The head architecture of a head config, or of an export's ``"msd"`` block (a dict)."""
    if isinstance(config, dict):
        return config.get("architecture")
    cls = head_class_of_config(config.model_type)
    return None if cls is None else cls.architecture


def vllm_refusals(config) -> list[str]:
    """Why this project's vLLM plugin cannot serve a head of ``config`` (a head config, or
    the ``"msd"`` block of an export as a dict) as it was trained: one sentence per setting,
    naming it and the format that keeps it; [] when it can. ``export_vllm`` refuses such a
    head; the plugin refuses such a folder; the model card says so."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    layout = vllm_layout(config)
    if layout is None:
        return [f"the layout holds {' and '.join(_LAYOUTS)} heads, and this is {with_article(_architecture(config))} head; "
                f"{_KEEP}"]
    out = []
    if (get("visual_compression") or "none") != "none":
        out.append(f"visual_compression={get('visual_compression')} (visual_compression_tokens="
                   f"{get('visual_compression_tokens')}): vLLM's draft keeps every visual token in its cache and "
                   f"the plugin has no compressed context, so vLLM would draft otherwise than the head was "
                   f"trained and evaluated; {_KEEP}")
    if get("mrope_section") and get("draft_positions") == "1d":
        out.append(f"draft_positions=1d: vLLM feeds the draft the target's M-RoPE positions, not 1-D ones; {_KEEP}")
    return out + layout.refusals(get)


def _msd_refusals(get) -> list[str]:
    if get("decouple_visual", True) and (get("visual_offset") or "released") != "released":
        return [f"visual_offset={get('visual_offset')}: vLLM hands draft slot t the embedding of token t+1, "
                f"which is the 'released' offset only; {_KEEP}"]
    return []


def _msd3_refusals(get) -> list[str]:
    if layer_family(get("layer_family") or "llama").qkv_bias:
        return [f"layer_family={get('layer_family')} in an msd3 head: the plugin's EAGLE-3 layer has no q/k/v bias; "
                f"{_KEEP} (format=eagle3 writes it for SGLang, which skips the biases too)"]
    return []


def _dflash_refusals(get) -> list[str]:
    out = []
    if get("mrope_section") and get("draft_positions") != "1d":
        out.append(f"mrope_section={get('mrope_section')} in a dflash head: vLLM 0.32's parallel drafting refuses an "
                   f"M-RoPE draft (llm_base_proposer.py, _raise_if_mrope) and passes a 1-D one the target's temporal "
                   f"row, not the M-RoPE ids; {_KEEP}")
    if layer_family(get("layer_family") or "llama").qkv_bias:
        out.append(f"layer_family={get('layer_family')} in a dflash head: vLLM's DFlash layer (qwen3_dflash.py) has "
                   f"q/k/v biases only with an o_proj bias, and the plugin's has none; {_KEEP}")
    n = get("target_num_layers")
    if n is not None and list(get("feature_layers") or []) == [n]:
        out.append(f"feature_layers=[{n}] (the target's last, post-norm output, an msd head's feature): vLLM's DFlash "
                   f"proposer reads the target's captured layer inputs (gpu_model_runner.py: aux hidden states, "
                   f"before the final norm), never the normed output; {_KEEP}")
    if (get("hidden_act") or "silu") != "silu":
        out.append(f"hidden_act={get('hidden_act')}: vLLM's DFlash MLP runs SiLU only; {_KEEP}")
    return out


def _layer_config(c, num_layers: int, vocab_size: int, dtype: torch.dtype) -> dict:
    """The LlamaConfig fields vLLM's Llama layers read (``vllm/model_executor/models/llama.py``)."""
    rope = dict(c.rope_parameters or {})
    out = {"architectures": [EAGLE_ARCHITECTURE], "model_type": "llama",
           **{k: getattr(c, k) for k in _LAYER_FIELDS},
           "num_hidden_layers": num_layers, "vocab_size": vocab_size, "tie_word_embeddings": False,
           "attention_bias": False, "mlp_bias": False, "rope_theta": rope.get("rope_theta"),
           "torch_dtype": str(dtype).removeprefix("torch.")}
    if c.mrope_section or rope.get("rope_type", "default") != "default":
        out["rope_scaling"] = rope
    return out


def _msd_block(head: DraftHead) -> dict:
    """What the layout has no key for: the head config's ``layout_extras``."""
    c = head.config
    return {"architecture": head.architecture, "format_version": 1, **{k: getattr(c, k) for k in c.layout_extras},
            "extras": EXTRAS}


def _split_msd(head: MSDDraftModel) -> tuple[dict, dict, list[str]]:
    """(stock tensors, extras, what stock vLLM loses) of an msd head."""
    c = head.config
    stock, extras, lost = {}, {}, []
    for name, t in head.state_dict().items():
        if "rotary_emb" in name:
            continue
        t = t.detach().cpu().contiguous()
        layer_bias = name.startswith("layers.") and name.split(".", 2)[2] in _QWEN2_BIASES
        if name == "fc.bias" or name == "layers.0.input_layernorm.weight" or layer_bias:
            extras[name] = t
        else:
            stock[name] = t
    if "fc.bias" in extras:
        lost.append(f"the fc bias (norm {extras['fc.bias'].float().norm():.4g}; stock vLLM's EAGLE fc has none)")
    if "layers.0.input_layernorm.weight" in extras:
        lost.append("the first layer's input norm (stock vLLM's EAGLE layer 0 has none)")
    if any(k.endswith("proj.bias") for k in extras):
        lost.append("the Qwen2 layers' q/k/v biases (vLLM's Llama layers have none)")
    if c.decouple_visual:
        lost.append("the decoupled visual inputs (stock vLLM drafts from the image placeholder's embedding)")
    return stock, extras, lost


def _eagle_config(head: MSDDraftModel, dtype: torch.dtype, verifier: str | None) -> dict:
    c = head.config
    return _layer_config(c, c.num_hidden_layers, c.target_vocab_size, dtype)


def _speculators_config(head: MSD3DraftModel, dtype: torch.dtype, verifier: str | None) -> dict:
    c = head.config
    layer = _layer_config(c, 1, c.target_vocab_size, dtype)
    layer.pop("architectures")
    # vLLM sizes the EAGLE-3 fc from this field (else from an `eagle_config` block it does not
    # carry over from the speculators config), defaulting to 3 fused layers: a head fusing
    # another number of layers would not load without it
    layer["num_aux_hidden_states"] = len(c.feature_layers)
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": DEFAULT_SPECULATIVE_TOKENS,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier or c.target_name_or_path, "architectures": []},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size or c.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(c.feature_layers),
        "norm_before_residual": False,
        "norm_before_fc": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _split_msd3(head: MSD3DraftModel) -> tuple[dict, dict, list[str]]:
    c = head.config
    stock, extras, lost = {}, {}, []
    full_vocab = c.draft_vocab_size == c.target_vocab_size
    for name, t in head.state_dict().items():
        if "rotary_emb" in name:
            continue
        t = t.detach().cpu().contiguous()
        if name in ("d2t", "t2d") and full_vocab:
            # vLLM builds no draft-to-target map when the vocabularies are equal and raises on a d2t
            continue
        name = name.replace("midlayer.", "layers.0.")
        (extras if name.split(".", 2)[-1] in _QWEN2_BIASES else stock)[name] = t
    if full_vocab and bool(head.d2t.any()):
        raise ValueError("an msd3 head whose draft vocabulary is the whole target vocabulary must map draft id i "
                         "to target id i (d2t all zero); this one does not")
    if extras:
        lost.append("the Qwen2 layer's q/k/v biases (vLLM's EAGLE-3 Llama layer has none)")
    if c.decouple_visual:
        lost.append("the decoupled visual inputs (stock vLLM drafts from the image placeholder's embedding)")
    return stock, extras, lost


def captured_layers(block: dict) -> list[int]:
    """The target layers whose inputs vLLM captures for a dflash export (``block``: its
    ``"msd"`` block), in the order vLLM concatenates them (layer order, each once): the
    fused ``feature_layers``, and layer 0 (the target's input embeddings: projector outputs
    at image positions) for ``decouple_visual``."""
    return sorted(set(block["feature_layers"]) | ({0} if block.get("decouple_visual") else set()))


def _dflash_config(head, dtype: torch.dtype, verifier: str | None) -> dict:
    c = head.config
    out = _layer_config(c, c.num_hidden_layers, c.target_vocab_size, dtype)
    out["architectures"] = [DFLASH_ARCHITECTURE]
    out["block_size"] = c.block_size
    out["target_hidden_size"] = c.target_hidden_size or c.hidden_size
    block = {k: getattr(c, k) for k in ("feature_layers", "decouple_visual")}
    out["dflash_config"] = {"target_layer_ids": [j - 1 for j in captured_layers(block)],
                            "mask_token_id": c.target_vocab_size, "use_aux_hidden_state": True}
    return out


def _split_dflash(head) -> tuple[dict, dict, list[str]]:
    stock, extras = {}, {}
    for name, t in head.state_dict().items():
        if "rotary_emb" in name or name == "mask_embedding":  # the mask embedding: MASK_EMBEDDING
            continue
        t = t.detach().cpu().contiguous()
        (extras if name == "visual_norm.weight" else stock)[name] = t
    lost = [f"the whole head: stock vLLM registers no {DFLASH_ARCHITECTURE} (its DFlash draft is Qwen3's, with "
            f"per-head q/k norms this head's {head.config.layer_family} layers lack) and refuses the folder; this "
            "project's plugin serves it"]
    return stock, extras, lost


def _write_dflash(head, tmp: Path, dtype: torch.dtype | None) -> None:
    """The files beside the weights: the mask embedding (vLLM's own file) and the token counts."""
    mask = head.mask_embedding.detach().cpu().clone()
    torch.save({"mask_token_id": head.config.target_vocab_size, "embedding": mask if dtype is None else mask.to(dtype)},
               tmp / MASK_EMBEDDING)
    counts = getattr(head, "token_counts", None)
    if counts is not None:
        (tmp / COUNTS).parent.mkdir(parents=True, exist_ok=True)
        save_file({"counts": counts.to(torch.long).contiguous()}, str(tmp / COUNTS), metadata={"format": "pt"})


def _dflash_vocabulary(head) -> None:
    """A head trained over a draft vocabulary drafts over its token counts' most frequent
    ids (``decoding.build.use_draft_vocabulary``): the export carries the counts or stops."""
    size = head.config.train_vocab
    if size is not None and size < head.config.target_vocab_size and getattr(head, "token_counts", None) is None:
        raise ValueError(f"draft.train_vocab={size}: the head drafts over the {size} most frequent tokens of its "
                         f"token counts (token_counts.safetensors in its folder), and this head has none; write them "
                         f"with python scripts/count_tokens.py draft=HEAD_DIR data=... and export again")


def export_vllm(head, out: str | Path, dtype: torch.dtype | str | None = None, verifier: str | None = None) -> dict:
    """Write ``head`` (msd or msd3; or the head in a folder / Hub id ``load_head`` opens) in
    the layout vLLM serves, optionally cast to ``dtype``; returns a summary whose
    ``"stock_vllm_loses"`` lists what stock vLLM (without the plugin) will not use (each
    also logged)."""
    if not isinstance(head, DraftHead):
        from msd_train.hub.load import load_head

        head = load_head(head)
    if isinstance(dtype, str):
        dtype = resolve_dtype(dtype, "cpu")
    FORMAT.check_holds(head, "the head")
    refused = vllm_refusals(head.config)
    if refused:
        raise ValueError(f"format=vllm cannot serve this {head.architecture} head as it was trained: "
                         + "; ".join(refused))
    layout = _LAYOUTS[head.architecture]
    if layout.check is not None:
        layout.check(head)
    stock, extras, lost = layout.split(head)
    if dtype is not None:
        stock = {k: v.to(dtype) if v.is_floating_point() else v for k, v in stock.items()}
        extras = {k: v.to(dtype) if v.is_floating_point() else v for k, v in extras.items()}
    weight_dtype = next(v.dtype for v in stock.values() if v.is_floating_point())
    config = layout.config(head, weight_dtype, verifier)
    config["msd"] = _msd_block(head)
    if "transformer_layer_config" in config:
        # vLLM builds an EAGLE-3 draft's config from transformer_layer_config (plus a few named
        # speculators fields): the plugin finds the block only there
        config["transformer_layer_config"]["msd"] = config["msd"]

    def write(tmp: Path):
        save_file(stock, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if extras:
            (tmp / EXTRAS).parent.mkdir(parents=True, exist_ok=True)
            save_file(extras, str(tmp / EXTRAS), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if layout.write is not None:
            layout.write(head, tmp, dtype)

    atomic_dir(out, write)
    for x in lost:
        log.warning("stock vLLM (without this project's plugin) loses: %s", x)
    return {"out": str(out), "format": "vllm", "method": layout.method, "stock_vllm_loses": lost}


def is_vllm_export(config: dict) -> bool:
    return (config.get("msd") or {}).get("architecture") in _LAYOUTS and (
        "speculators_config" in config or config.get("architectures") in ([EAGLE_ARCHITECTURE], [DFLASH_ARCHITECTURE]))


def read_extras(folder: Path) -> dict[str, torch.Tensor]:
    path = folder / EXTRAS
    return load_file(str(path)) if path.is_file() else {}


def import_vllm(folder: str | Path) -> DraftHead:
    """The msd, msd3 or dflash head of a folder written by ``export_vllm``, tensors bit for
    bit (a dflash head's token counts too)."""
    folder = Path(folder)
    path = folder / "config.json"
    if not path.is_file() or not (folder / "model.safetensors").is_file():
        raise IncompleteHeadError(f"{folder}: a vLLM-layout head is config.json + model.safetensors")
    config = json.loads(path.read_text())
    msd = config.get("msd") or {}
    if not is_vllm_export(config):
        raise IncompleteHeadError(f"{path}: not a head exported with format=vllm (no \"msd\" block naming "
                                  f"architecture {', '.join(_LAYOUTS)})")
    layer = config.get("transformer_layer_config", config)
    state = {**load_file(str(folder / "model.safetensors")), **read_extras(folder)}
    if (folder / MASK_EMBEDDING).is_file():
        from msd_train.trust import torch_load

        state["mask_embedding"] = torch_load(folder / MASK_EMBEDDING, fix="export the head again")["embedding"]
    rope = dict(layer.get("rope_scaling") or {})
    rope.setdefault("rope_theta", layer.get("rope_theta"))
    rope.setdefault("rope_type", "default")
    rope.pop("mrope_section", None)
    fields = {k: layer[k] for k in _LAYER_FIELDS}
    fields.update({k: v for k, v in msd.items() if k in head_class(msd["architecture"]).config_class.layout_extras})
    fields["rope_parameters"] = rope
    head, state = _LAYOUTS[msd["architecture"]].build(config, layer, fields, state)
    dtype = next(v.dtype for v in state.values() if v.is_floating_point())
    head = head.to(dtype)
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        raise IncompleteHeadError(f"{folder}: the weights do not fit the head its config describes "
                                  f"(missing {missing[:6]}, unexpected {unexpected[:6]})")
    if (folder / COUNTS).is_file():
        head.token_counts = load_file(str(folder / COUNTS))["counts"]
    return head.eval()


def _build_msd(config: dict, layer: dict, fields: dict, state: dict) -> tuple[MSDDraftModel, dict]:
    return MSDDraftModel(MSDDraftConfig(num_hidden_layers=layer["num_hidden_layers"], **fields)), state


def _build_msd3(config: dict, layer: dict, fields: dict, state: dict) -> tuple[MSD3DraftModel, dict]:
    fields.update(feature_layers=list(config["eagle_aux_hidden_state_layer_ids"]),
                  target_vocab_size=layer["vocab_size"], draft_vocab_size=config["draft_vocab_size"])
    head = MSD3DraftModel(MSD3DraftConfig(**fields))
    state = {k.replace("layers.0.", "midlayer."): v for k, v in state.items()}
    for name in ("d2t", "t2d"):  # left out of a full-vocabulary export: the identity map
        state.setdefault(name, getattr(head, name).clone())
    return head, state


def _build_dflash(config: dict, layer: dict, fields: dict, state: dict) -> tuple[DraftHead, dict]:
    cls = head_class("dflash")
    fields.update(num_hidden_layers=layer["num_hidden_layers"], target_vocab_size=layer["vocab_size"])
    return cls(cls.config_class(**fields)), state


@dataclass(frozen=True)
class VllmLayout:
    """How the layout holds one head architecture: vLLM's ``method``, what the plugin serves
    beyond stock vLLM (for the model card), and the head's own refusals, split of its tensors
    into stock and extras, config.json and load-back. ``stock``: what stock vLLM does with the
    folder (the card says it); ``stock_mode``: whether it serves it at all (a "compatible"
    mode the serving check runs). ``speculative_tokens(config)``: the k vLLM must be given
    (None: any). ``check``/``write``: the head's own export checks and extra files."""

    method: str
    plugin_keeps: str
    refusals: Callable
    split: Callable
    config: Callable
    build: Callable
    stock: str = ("stock vLLM, without msd-train, serves the same folder in a compatible mode that drafts from the "
                  "image placeholder's embedding. Outputs are the target's either way")
    stock_mode: bool = True
    speculative_tokens: Callable = lambda config: None
    check: Callable | None = None
    write: Callable | None = None


def _block_tokens(config) -> int:
    """A dflash head's k in vLLM: its whole block after the root. vLLM's block is the root and
    k masks, attending to each other both ways, so only k = block_size - 1 is the block the
    head was trained on (this project's decoder runs the whole block for any k)."""
    return int(config["block_size"] if isinstance(config, dict) else config.block_size) - 1


_LAYOUTS = {
    "msd": VllmLayout("eagle", "the target's visual embeddings at image positions, the fc bias", _msd_refusals,
                      _split_msd, _eagle_config, _build_msd),
    "msd3": VllmLayout("eagle3", "the target's visual embeddings at image positions", _msd3_refusals, _split_msd3,
                       _speculators_config, _build_msd3),
    "dflash": VllmLayout(
        "dflash", "its Llama-family layers, its learned mask embedding and, where the head has them, the target's "
                  "visual embeddings at image positions of its context and its draft vocabulary", _dflash_refusals,
        _split_dflash, _dflash_config, _build_dflash,
        stock=f"stock vLLM, without msd-train, refuses the folder ({DFLASH_ARCHITECTURE} is the plugin's class: "
              "vLLM's own DFlash draft has Qwen3's q/k norms, which this head's layers lack). Outputs are the "
              "target's",
        stock_mode=False, speculative_tokens=_block_tokens, check=_dflash_vocabulary, write=_write_dflash),
}


def vllm_layout(config) -> VllmLayout | None:
    """How the layout holds heads of ``config`` (a head config or an export's ``"msd"`` block);
    None: it holds no such head."""
    return _LAYOUTS.get(_architecture(config))


def load_vllm(folder, target: TargetProtocol | None = None, source=None) -> DraftHead:
    return import_vllm(folder)


FORMAT = HeadFormat(
    name="vllm", heads=tuple(_LAYOUTS), write=export_vllm, detect=is_vllm_export, load=load_vllm, options=("dtype",),
    describe='vLLM\'s EAGLE (msd heads), speculators EAGLE-3 (msd3 heads) or DFlash (dflash heads) layout with an '
             '"msd" block',
)
