"""The EAGLE-3 layout that EAGLE-3 and SpecForge release (and SGLang serves), for msd3 heads.

A folder holds config.json (`architectures: ["LlamaForCausalLMEagle3"]`, the layer's
sizes, `vocab_size` of the target, `draft_vocab_size`) and model.safetensors with
`fc.weight [H, kH]`, `midlayer.*` (q/k/v take 2H; `midlayer.hidden_norm`), `norm.weight`,
`lm_head.weight [N, H]`, `d2t` (int64, target id = i + d2t[i]) and `t2d` (bool over the
target vocabulary); no embedding. An msd3 head's parameters already carry these names, so
export and import copy tensors without renaming: the round trip is bit-exact.

What the layout has no field for is kept under `"msd"` in config.json (decoupling, draft
positions, the training-time test, the target); `eagle_config.eagle_aux_hidden_state_layer_ids`
names the fused layers as SGLang reads them. A third-party head without the `"msd"` block
imports with `decouple_visual=False` (such heads were trained on placeholder embeddings).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from msd_train.draft import MSD3DraftConfig, MSD3DraftModel
from msd_train.draft.config import default_feature_layers
from msd_train.hub.folders import IncompleteHeadError

ARCHITECTURE = "LlamaForCausalLMEagle3"
#: MSD3DraftConfig fields the EAGLE-3 config has no key for
_MSD_FIELDS = ("decouple_visual", "draft_positions", "ttt_steps", "ttt_decay", "layer_family", "mrope_section",
               "target_name_or_path", "target_num_layers", "target_adapter", "target_hidden_size",
               "visual_compression", "visual_compression_tokens")


def is_eagle3(config: dict) -> bool:
    return any("Eagle3" in a for a in config.get("architectures") or [])


def export_eagle3(head: MSD3DraftModel, out: str | Path) -> Path:
    """Write ``head`` to ``out`` in the EAGLE-3 layout (config.json + model.safetensors)."""
    if not isinstance(head, MSD3DraftModel):
        raise ValueError(f"the EAGLE-3 layout holds msd3 heads; this is an {getattr(head, 'architecture', '?')} head")
    c = head.config
    rope = dict(c.rope_parameters or {})
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": c.rms_norm_eps,
        "hidden_act": c.hidden_act,
        "max_position_embeddings": c.max_position_embeddings,
        "rope_theta": rope.get("rope_theta"),
        "rope_scaling": rope if c.mrope_section or rope.get("rope_type", "default") != "default" else None,
        "vocab_size": c.target_vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": str(head.lm_head.weight.dtype).removeprefix("torch."),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.feature_layers)},
        "msd": {k: getattr(c, k) for k in _MSD_FIELDS},
    }
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def import_eagle3(folder: str | Path, target_num_layers: int | None = None) -> MSD3DraftModel:
    """An msd3 head from an EAGLE-3-layout folder, its tensors bit for bit.

    ``target_num_layers`` (the target's layer count) is needed only when the folder names
    no fused layers (then EAGLE-3's default 2, N/2, N-3 applies)."""
    folder = Path(folder)
    path = folder / "config.json"
    if not path.is_file() or not (folder / "model.safetensors").is_file():
        raise IncompleteHeadError(f"{folder}: an EAGLE-3 head is config.json + model.safetensors")
    config = json.loads(path.read_text())
    if not is_eagle3(config):
        raise IncompleteHeadError(f"{path}: architectures {config.get('architectures')} is not {ARCHITECTURE}")
    msd = config.get("msd") or {}
    layers = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    n_layers = msd.get("target_num_layers") or target_num_layers
    if layers is None:
        if n_layers is None:
            raise IncompleteHeadError(f"{path} names no fused target layers (eagle_config."
                                      f"eagle_aux_hidden_state_layer_ids); give the target's layer count")
        layers = default_feature_layers(n_layers)
    state = load_file(str(folder / "model.safetensors"))
    rope = dict(config.get("rope_scaling") or {})
    if config.get("rope_theta") is not None:
        rope.setdefault("rope_theta", config["rope_theta"])
    rope.setdefault("rope_type", rope.pop("type", "default"))
    rope.pop("mrope_section", None)
    family = msd.get("layer_family") or ("qwen2" if "midlayer.self_attn.q_proj.bias" in state else "llama")
    fields = dict(
        hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        head_dim=config.get("head_dim"), rms_norm_eps=config["rms_norm_eps"],
        hidden_act=config.get("hidden_act", "silu"),
        max_position_embeddings=config.get("max_position_embeddings", 4096), rope_parameters=rope,
        mrope_section=msd.get("mrope_section") or (config.get("rope_scaling") or {}).get("mrope_section"),
        layer_family=family, feature_layers=list(layers), target_vocab_size=config["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"], target_num_layers=n_layers,
        target_hidden_size=config["hidden_size"], decouple_visual=False,
    )
    fields.update({k: v for k, v in msd.items() if k in _MSD_FIELDS and v is not None})
    head = MSD3DraftModel(MSD3DraftConfig(**fields))
    dtype = state["lm_head.weight"].dtype
    head = head.to(dtype)
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise IncompleteHeadError(f"{folder}: the weights do not fit an EAGLE-3 head of its config "
                                  f"(missing {missing[:6]}, unexpected {unexpected[:6]})")
    return head.eval()


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit-exact equality of two state dicts."""
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
