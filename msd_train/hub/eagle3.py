"""The EAGLE-3 layout that EAGLE-3 and SpecForge release and SGLang serves
(`LlamaForCausalLMEagle3`), for msd3 heads.

A folder holds config.json (`architectures: ["LlamaForCausalLMEagle3"]`, the layer's
sizes, `vocab_size` of the target, `draft_vocab_size`) and model.safetensors with
`fc.weight [H, kH]`, `midlayer.*` (q/k/v take 2H; `midlayer.hidden_norm`), `norm.weight`,
`lm_head.weight [N, H]`, `d2t` (int64, target id = i + d2t[i]) and `t2d` (bool over the
target vocabulary); no embedding. An msd3 head's parameters already carry these names, so
export and import copy tensors without renaming: the round trip is bit-exact.

`eagle_config.eagle_aux_hidden_state_layer_ids` names the fused target layers the way
SGLang reads it: SGLang captures the OUTPUT of each named layer (it adds 1 and takes that
layer's input), while a head here names the layers whose INPUT it reads
(`feature_layers`, HF `hidden_states[i]`), so the ids written are `feature_layers - 1`.
(vLLM reads the same key as inputs, unshifted: serve this folder with SGLang; vLLM has
`format=vllm`.) What the layout has no field for is kept under `"msd"` in config.json
(decoupling, draft positions, the training-time test, the target, the exact
`feature_layers`, draft-side visual compression, which SGLang does not do: the export
warns). A third-party head without the `"msd"` block imports with
`decouple_visual=False` (such heads were trained on placeholder embeddings).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from msd_train.draft import MSD3DraftConfig, MSD3DraftModel
from msd_train.draft.config import default_feature_layers
from msd_train.draft.families import family_with_qkv_bias
from msd_train.draft.head import DraftHead
from msd_train.hub.folders import IncompleteHeadError
from msd_train.hub.formats import HeadFormat
from msd_train.hub.load import load_head
from msd_train.hub.target import cast_head
from msd_train.runtime import atomic_dir
from msd_train.targets import resolve_dtype
from msd_train.targets.protocol import TargetProtocol

log = logging.getLogger(__name__)

ARCHITECTURE = "LlamaForCausalLMEagle3"


def is_eagle3(config: dict) -> bool:
    """An EAGLE-3 head in this layout (any `*Eagle3*` architecture), but not one in the
    speculators layout (`Eagle3Speculator`, with its `speculators_config`), which vLLM reads."""
    return any("Eagle3" in a for a in config.get("architectures") or []) and "speculators_config" not in config


def sglang_layer_ids(feature_layers: list[int]) -> list[int]:
    """SGLang's `eagle_aux_hidden_state_layer_ids` for a head reading the inputs of these
    target layers (SGLang names the layer whose output it captures)."""
    return [i - 1 for i in feature_layers]


def eagle3_config(head: MSD3DraftModel) -> tuple[dict, list[str]]:
    """(config.json, warnings): the warnings name what SGLang does differently with this head."""
    c = head.config
    rope = {k: v for k, v in (c.rope_parameters or {}).items() if k != "rope_theta"}
    if c.draft_positions != "mrope":
        # SGLang switches the draft to the target's M-RoPE ids whenever rope_scaling names
        # sections; a head drafting with 1-D positions must not name them there.
        rope.pop("mrope_section", None)
    scaled = "mrope_section" in rope or rope.get("rope_type", "default") != "default"
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
        "rope_theta": (c.rope_parameters or {}).get("rope_theta"),
        "rope_scaling": rope if scaled else None,
        "vocab_size": c.target_vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": str(head.lm_head.weight.dtype).removeprefix("torch."),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_layer_ids(c.feature_layers)},
        "msd": {"feature_layers": list(c.feature_layers), **{k: getattr(c, k) for k in c.layout_extras}},
    }
    warnings = []
    if len(c.feature_layers) != 3:
        warnings.append(f"this head fuses {len(c.feature_layers)} target layers ({c.feature_layers}); SGLang's "
                        f"LlamaForCausalLMEagle3 builds fc for 3, so SGLang will not load this fc.weight")
    if c.visual_compression != "none":
        # kept in the "msd" block (load_head and eval.py draft as trained), not read by SGLang
        warnings.append(f"this head keeps {c.visual_compression_tokens} slots per image (visual_compression="
                        f"{c.visual_compression}); SGLang drafts over every visual token, so acceptance on images may "
                        f"differ there (the \"msd\" block keeps the setting for this project's decoder)")
    biases = [k for k, _ in head.midlayer.self_attn.named_parameters() if k.endswith(".bias")]
    if biases:
        warnings.append(f"SGLang's EAGLE-3 layer has no q/k/v bias and silently skips midlayer.self_attn."
                        f"{{{','.join(biases)}}}: served there, this {c.layer_family} head drafts differently")
    return config, warnings


def export_eagle3(head, out: str | Path, dtype: str | None = None) -> dict:
    """Write an msd3 head (or the head in a folder / Hub id ``load_head`` opens) to ``out``
    in the EAGLE-3 layout (config.json + model.safetensors), written atomically,
    optionally cast to ``dtype``. Returns a summary (files, dtype, warnings)."""
    where = "the head"
    if not isinstance(head, DraftHead):
        where, head = head, load_head(head)
    FORMAT.check_holds(head, where)
    if dtype:
        head = cast_head(head, dtype=resolve_dtype(dtype, "cpu"))
    config, warnings = eagle3_config(head)
    state = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}

    def write(tmp: Path):
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    atomic_dir(Path(out), write)
    for w in warnings:
        log.warning("%s", w)
    return {"out": str(out), "files": ["config.json", "model.safetensors"], "dtype": config["torch_dtype"],
            "warnings": warnings}


def _fused_layers(config: dict, path: Path, target_num_layers: int | None) -> list[int]:
    """The head's `feature_layers`: the exact list an export of ours records; else the
    ids SGLang reads, shifted to inputs; else EAGLE-3's default for the target's depth."""
    msd = config.get("msd")
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if msd and msd.get("feature_layers") is not None:
        return _layer_ids(msd["feature_layers"], path, "msd.feature_layers", 0)
    if ids is not None:
        # exports of ours from before the ids were written SGLang's way carry an "msd"
        # block without feature_layers; their ids already are the inputs read
        key = "eagle_config.eagle_aux_hidden_state_layer_ids"
        return _layer_ids(ids, path, key, 0) if msd else [i + 1 for i in _layer_ids(ids, path, key, 0)]
    n_layers = (msd or {}).get("target_num_layers") or target_num_layers
    if n_layers is None:
        raise IncompleteHeadError(f"{path} names no fused target layers (eagle_config."
                                  f"eagle_aux_hidden_state_layer_ids); give the target's layer count")
    return default_feature_layers(n_layers)


def _layer_ids(ids, path: Path, key: str, lo: int) -> list[int]:
    """The fused target layers a config names: a non-empty list of integers of at least ``lo``
    (a negative id would read a layer counted from the end, and fail only inside the target)."""
    ok = isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    if not ok or min(ids) < lo:
        raise IncompleteHeadError(f"{path}: {key}={ids!r} is not a list of target layer ids of at least {lo}; "
                                  f"fix the config.json (the layers whose outputs the head fuses, e.g. [1, 15, 28])")
    return list(ids)


def _field(config: dict, key: str, path: Path):
    if config.get(key) is None:
        raise IncompleteHeadError(f"{path}: no {key!r}; an EAGLE-3 config.json names the draft layer's sizes "
                                  f"(hidden_size, intermediate_size, num_attention_heads, rms_norm_eps, vocab_size, "
                                  f"draft_vocab_size): add it, or get the folder again")
    return config[key]


def _check_sizes(config: dict, path: Path) -> None:
    """Refuse sizes that make no draft layer for the target, before any weight is read: a
    size that is not a positive whole number, heads that do not divide the width (or the
    key/value heads the heads), a draft vocabulary larger than the target's."""
    sizes = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "vocab_size", "draft_vocab_size")
    for key in sizes:
        v = config.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise IncompleteHeadError(f"{path}: {key}={v!r} is not a positive whole number; fix config.json "
                                      f"(the folder's own sizes), or get the folder again")
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    if config.get("head_dim") is None and hidden % heads:
        raise IncompleteHeadError(f"{path}: num_attention_heads={heads} does not divide hidden_size={hidden}; the "
                                  f"sizes come from different heads or were edited: fix config.json or get it again")
    if heads % kv:
        raise IncompleteHeadError(f"{path}: num_key_value_heads={kv} does not divide num_attention_heads={heads}; "
                                  f"fix config.json or get it again")
    if config["draft_vocab_size"] > config["vocab_size"]:
        raise IncompleteHeadError(f"{path}: draft_vocab_size={config['draft_vocab_size']} is larger than the target's "
                                  f"vocab_size={config['vocab_size']}; a draft vocabulary is a part of the target's: "
                                  f"fix config.json or get the folder again")


def import_eagle3(folder: str | Path, target_num_layers: int | None = None) -> MSD3DraftModel:
    """An msd3 head from an EAGLE-3-layout folder, its tensors bit for bit.

    ``target_num_layers`` (the target's layer count) is needed only when the folder names
    no fused layers (then EAGLE-3's default 2, N/2, N-3 applies)."""
    folder = Path(folder)
    path = folder / "config.json"
    if not path.is_file() or not (folder / "model.safetensors").is_file():
        raise IncompleteHeadError(f"{folder}: an EAGLE-3 head is config.json + model.safetensors")
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise IncompleteHeadError(f"{path}: not valid JSON ({e})") from e
    if not is_eagle3(config):
        raise IncompleteHeadError(f"{path}: architectures {config.get('architectures')} is not {ARCHITECTURE}")
    msd = config.get("msd") or {}
    layers = _fused_layers(config, path, target_num_layers)
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "rms_norm_eps", "vocab_size",
                "draft_vocab_size"):
        _field(config, key, path)
    _check_sizes(config, path)
    try:
        state = load_file(str(folder / "model.safetensors"))
    except Exception as e:  # cut short, not safetensors
        raise IncompleteHeadError(f"{folder / 'model.safetensors'}: unreadable ({type(e).__name__}: {e}); the "
                                  f"file is damaged or half-written: get it again") from e
    if "lm_head.weight" not in state:
        raise IncompleteHeadError(f"{folder / 'model.safetensors'}: no lm_head.weight; not an EAGLE-3 head's weights")
    rope = dict(config.get("rope_scaling") or {})
    if config.get("rope_theta") is not None:
        rope.setdefault("rope_theta", config["rope_theta"])
    rope.setdefault("rope_type", rope.pop("type", "default"))
    rope.pop("mrope_section", None)
    family = msd.get("layer_family") or family_with_qkv_bias("midlayer.self_attn.q_proj.bias" in state).name
    fields = dict(
        hidden_size=config["hidden_size"], intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        head_dim=config.get("head_dim"), rms_norm_eps=config["rms_norm_eps"],
        hidden_act=config.get("hidden_act", "silu"),
        max_position_embeddings=config.get("max_position_embeddings", 4096), rope_parameters=rope,
        mrope_section=msd.get("mrope_section") or (config.get("rope_scaling") or {}).get("mrope_section"),
        layer_family=family, feature_layers=layers, target_vocab_size=config["vocab_size"],
        draft_vocab_size=config["draft_vocab_size"], target_num_layers=msd.get("target_num_layers") or target_num_layers,
        target_hidden_size=config["hidden_size"], decouple_visual=False,
    )
    fields.update({k: v for k, v in msd.items() if k in MSD3DraftConfig.layout_extras and v is not None})
    try:
        head = MSD3DraftModel(MSD3DraftConfig(**fields))
    except (TypeError, ValueError) as e:  # a size of the wrong type, heads that do not divide the width
        raise IncompleteHeadError(f"{path}: its sizes do not make a draft layer ({type(e).__name__}: {e})") from e
    dtype = state["lm_head.weight"].dtype
    head = head.to(dtype)
    own = head.state_dict()
    wrong = [f"{k} {tuple(v.shape)} (the config makes {tuple(own[k].shape)})" for k, v in state.items()
             if k in own and own[k].shape != v.shape]
    if wrong:
        raise IncompleteHeadError(f"{folder}/model.safetensors does not fit its config.json: {'; '.join(wrong[:4])}"
                                  f"{' ...' if len(wrong) > 4 else ''}; the two come from different heads, or one was "
                                  f"edited: get the folder again")
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise IncompleteHeadError(f"{folder}: the weights do not fit an EAGLE-3 head of its config "
                                  f"(missing {missing[:6]}, unexpected {unexpected[:6]})")
    return head.eval()


def load_eagle3(folder: Path, target: TargetProtocol | None = None, source=None) -> MSD3DraftModel:
    """`import_eagle3`, with the fused layers' default taken from a loaded `target`."""
    layers = target.config.get_text_config(decoder=True).num_hidden_layers if target is not None else None
    return import_eagle3(folder, layers)


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bit-exact equality of two state dicts."""
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


FORMAT = HeadFormat(
    name="eagle3", heads=("msd3",), write=export_eagle3, detect=is_eagle3, load=load_eagle3, options=("dtype",),
    describe=f"the EAGLE-3 layout (SpecForge, SGLang), architectures [{ARCHITECTURE!r}]",
)
