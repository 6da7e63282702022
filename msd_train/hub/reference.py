"""The layout of the released MSD heads, to and from this project's export folder.

Released layout (`lucylyn/MSD-LLaVA1.5-7B` and siblings)::

    config.json        Llama-like: hidden_size, ..., num_hidden_layers 1,
                       model_type "llava" | "qwen2_vl", optional "bias" (fc bias, default true)
    pytorch_model.bin  or model.safetensors:
                       embed_tokens.weight, fc.weight, fc.bias,
                       layers.0.self_attn.{q,k,v,o}_proj.weight (+ q/k/v .bias for Qwen2),
                       layers.0.mlp.{gate,up,down}_proj.weight,
                       layers.0.post_attention_layernorm.weight (+ input_layernorm for Qwen2)

This project's export folder (`MSDDraftModel.save_pretrained`) holds the same `fc.*` and
`layers.*` tensors under the same names, no embedding (the head uses the target's), and
a config that states the conventions the released code fixed implicitly: layer family,
no input norm on the first LLaVA layer, fc bias, decoupling with the released offset.
An import also writes `reference_import.json` (the original config.json verbatim, the
weight-file format, the embedding's shape and sha256, the embedding check), which lets
`export_reference` reproduce the original folder bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from msd_train.draft import MSDDraftConfig, MSDDraftModel, NonFiniteWeightsError, check_finite
from msd_train.draft.families import LayerFamily, layer_family
from msd_train.draft.head import DraftHead
from msd_train.hub.folders import (
    REFERENCE_MODEL_TYPES,
    REFERENCE_WEIGHT_FILES,
    IncompleteHeadError,
    load_export,
    read_config,
    resolve_folder,
)
from msd_train.hub.formats import HeadFormat
from msd_train.hub.target import PUBLISHED_TARGETS, TargetInfo
from msd_train.hub.vocab import EmbeddingCheck, VocabMap, check_embedding
from msd_train.paths import user_path
from msd_train.runtime import atomic_dir
from msd_train.targets import FAMILIES, head_family
from msd_train.targets.protocol import TargetProtocol
from msd_train.trust import torch_load

log = logging.getLogger(__name__)

IMPORT_RECORD = "reference_import.json"
EMBED_KEY = "embed_tokens.weight"

#: Buffers that older transformers / EAGLE code saved with the weights but that are not
#: weights: RoPE frequencies and caches, recomputed from config.json at load. The released
#: loader (`load_state_dict(strict=False)`) ignores them; so does the importer, with a note.
NON_WEIGHT_BUFFER = re.compile(r"(^|\.)rotary_emb\.(inv_freq|original_inv_freq|cos_cached|sin_cached)$")


def tensor_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


# --- reading the released layout -------------------------------------------------------------


@dataclass
class ReferenceHead:
    """A released-layout head as read from disk."""

    folder: Path
    config: dict
    state_dict: dict[str, torch.Tensor]
    weights_file: str  # "model.safetensors" or "pytorch_model.bin"

    @property
    def model_type(self) -> str:
        return self.config["model_type"]

    @property
    def family(self) -> str:
        return REFERENCE_MODEL_TYPES[self.model_type]

    @property
    def layers(self) -> LayerFamily:
        """The draft layer family of the released head (``msd_train.draft.families``)."""
        return layer_family(self.family)


def load_weights_file(path: Path) -> dict[str, torch.Tensor]:
    """safetensors, or a `pytorch_model.bin` of plain tensors (``msd_train.trust.torch_load``)."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(path)
    return torch_load(path, map_location="cpu", fix="Convert the weights to safetensors where they were made, "
                                                    "or use a head saved as plain tensors")


def block_draft_sign(config: dict) -> str | None:
    """What marks a config.json as a DFlash-style block draft (z-lab's and vLLM's
    ``dflash_config``, a ``DFlash*`` architecture, this project's ``dflash_draft``), or None."""
    if "dflash_config" in config:
        return "its dflash_config"
    arch = next((a for a in config.get("architectures") or [] if "DFlash" in str(a)), None)
    if arch:
        return f"architectures {arch!r}"
    if config.get("model_type") == "dflash_draft":
        return "model_type 'dflash_draft'"
    return None


def read_reference(folder: str | Path) -> ReferenceHead:
    folder = Path(folder)
    config = read_config(folder)
    block = block_draft_sign(config)
    if block:
        raise IncompleteHeadError(
            f"{folder}/config.json describes a DFlash block draft ({block}), not a released MSD/EAGLE head, which "
            f"is all this import converts: a block draft trained with this project (head=dflash) loads as it is "
            f"(draft=FOLDER, decoding=block); one trained elsewhere has no import here: train one with head=dflash"
        )
    if config.get("model_type") not in REFERENCE_MODEL_TYPES:
        raise IncompleteHeadError(
            f"{folder}/config.json: model_type {config.get('model_type')!r} is not one of the released "
            f"heads' ({', '.join(REFERENCE_MODEL_TYPES)})"
        )
    for name in REFERENCE_WEIGHT_FILES:
        if (folder / name).is_file():
            state = load_weights_file(folder / name)
            break
    else:
        raise IncompleteHeadError(f"{folder}: no weights ({' or '.join(REFERENCE_WEIGHT_FILES)})")
    if "fc.weight" not in state:
        raise IncompleteHeadError(
            f"{folder}/{name}: no fc.weight; this is not an MSD/EAGLE draft head "
            f"(a full {config['model_type']} model folder, perhaps?)"
        )
    try:
        check_finite(state.items(), f"{folder}/{name}")
    except NonFiniteWeightsError as err:
        raise IncompleteHeadError(str(err)) from None
    return ReferenceHead(folder, config, state, name)


# --- released -> ours ------------------------------------------------------------------------


def _rope_from_reference(cfg: dict) -> tuple[dict, list[int] | None]:
    """(transformers-5 rope_parameters, mrope_section) from a released config, which
    uses the transformers-4 fields `rope_theta` and `rope_scaling`."""
    if cfg.get("rope_parameters"):
        rope = dict(cfg["rope_parameters"])
    else:
        scaling = dict(cfg.get("rope_scaling") or {})
        rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
        rope = {"rope_type": rope_type, "rope_theta": float(cfg.get("rope_theta", 10000.0)), **scaling}
    mrope = rope.pop("mrope_section", None)
    if rope.get("rope_type") == "mrope":  # Qwen2-VL's label for default frequencies split in sections
        rope["rope_type"] = "default"
    return rope, (list(mrope) if mrope is not None else None)


def _layer_count(state: dict) -> int:
    ids = {int(k.split(".")[1]) for k in state if k.startswith("layers.")}
    if ids != set(range(len(ids))) or not ids:
        raise IncompleteHeadError(f"decoder layers must be numbered 0..N-1, found {sorted(ids)}")
    return len(ids)


def config_from_reference(ref: ReferenceHead, target: TargetInfo | None = None) -> MSDDraftConfig:
    """Translate a released config.json into an `MSDDraftConfig`.

    Sizes come from the config (a nested `text_config`, if any, wins), the layer count
    from the weights. Conventions the released code fixed without saying so are set
    explicitly: the family from model_type, no input norm on the first LLaVA layer (but
    one on the Qwen2-VL head's), the fc bias from `"bias"` (default true), and
    decoupling with the released offset (visual block at `p-1 .. p+N-2`).
    """
    cfg = {**ref.config, **(ref.config.get("text_config") or {})}
    heads = cfg["num_attention_heads"]
    rope, mrope = _rope_from_reference(cfg)
    if mrope is None and ref.layers.mrope and target is not None:
        mrope = target.mrope_section  # the target's positions are M-RoPE ids: the head must take them
    hidden = cfg["hidden_size"]
    if target is not None:
        target_name, target_vocab = target.name, target.vocab_size
    else:
        target_name, target_vocab = PUBLISHED_TARGETS.get((ref.model_type, hidden), (None, None))
    return MSDDraftConfig(
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        num_hidden_layers=_layer_count(ref.state_dict),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        hidden_act=cfg.get("hidden_act", "silu"),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        rope_parameters=rope,
        mrope_section=mrope,
        layer_family=ref.family,
        fc_bias=bool(ref.config.get("bias", True)),
        first_layer_input_norm=ref.layers.first_layer_input_norm,
        decouple_visual=True,
        visual_offset="released",
        draft_positions="1d",  # the released code drafts with arange positions (Qwen2-VL included)
        target_name_or_path=target_name,
        target_vocab_size=target_vocab,
        target_hidden_size=hidden,
        target_adapter=target.adapter if target is not None else None,
    )


def _inv_freq_check(key: str, saved: torch.Tensor, ours: torch.Tensor) -> str:
    """A saved `inv_freq` says which RoPE base the head was trained with: compare it with
    the one config.json gives, so a wrong `rope_theta` does not pass unnoticed."""
    if not key.endswith(".inv_freq"):
        return ""
    ours = ours.float()
    if saved.shape != ours.shape:
        return f"; its shape {list(saved.shape)} differs from the head's {list(ours.shape)}"
    diff = float(((saved.float() - ours).abs() / ours.abs().clamp_min(1e-30)).max())
    if diff > 1e-3:
        log.warning("%s differs from the frequencies config.json's rope settings give (max relative "
                    "difference %.3g): check rope_theta / rope_scaling in config.json", key, diff)
        return f"; WARNING: it differs from config.json's frequencies (max relative difference {diff:.3g})"
    return "; it equals config.json's frequencies"


@dataclass
class ImportReport:
    """What an import found and did; `notes` are worth reading, `embedding` is None when
    no target was given."""

    source: str
    weights_file: str
    model_type: str
    config: dict  # the translated MSDDraftConfig fields that matter
    dropped_keys: list[str]
    embed_rows: int
    embed_sha256: str
    embedding: EmbeddingCheck | None = None
    notes: list[str] = field(default_factory=list)

    def record(self, reference_config: dict) -> dict:
        """The `reference_import.json` an import writes next to the export."""
        return {
            "source": self.source,
            "weights_file": self.weights_file,
            "reference_config": reference_config,
            "embed_tokens": {"rows": self.embed_rows, "sha256": self.embed_sha256},
            "embedding_check": self.embedding.as_dict() if self.embedding else None,
            "dropped_keys": self.dropped_keys,
            "notes": self.notes,
        }


def convert_reference(ref: ReferenceHead, target: TargetInfo | None = None,
                      source: str | None = None) -> tuple[MSDDraftModel, ImportReport]:
    """Build an `MSDDraftModel` from a released head, with its weights bit for bit.

    `target`: when given, the released `embed_tokens` is compared with the target's table
    on the shared ids and the head's `target_*` fields name it.
    """
    config = config_from_reference(ref, target)
    state = dict(ref.state_dict)
    embed, notes = _take_embedding(ref, config, state)
    dropped, more = _fit_conventions(ref, config, state)
    model, ignored, buffer_notes = _load_head(ref, config, state)
    check, check_notes = _check_against_target(ref, config, embed, target)
    report = ImportReport(
        source=source or str(ref.folder), weights_file=ref.weights_file, model_type=ref.model_type,
        config={k: getattr(config, k) for k in ("layer_family", "num_hidden_layers", "fc_bias",
                                                "first_layer_input_norm", "decouple_visual", "visual_offset",
                                                "draft_positions", "mrope_section", "target_name_or_path")},
        dropped_keys=dropped + ignored, embed_rows=embed.shape[0], embed_sha256=tensor_sha256(embed),
        embedding=check, notes=notes + more + buffer_notes + check_notes,
    )
    return model.eval(), report


def _take_embedding(ref: ReferenceHead, config: MSDDraftConfig, state: dict) -> tuple[torch.Tensor, list[str]]:
    """Remove the released `embed_tokens` from `state` (the head uses its target's) and
    return it, checked against the config, with a note when config.json miscounts it."""
    embed = state.pop(EMBED_KEY, None)
    if embed is None:
        raise IncompleteHeadError(f"{ref.folder}/{ref.weights_file}: no {EMBED_KEY}")
    if embed.shape[1] != config.hidden_size:
        raise IncompleteHeadError(f"{ref.folder}: {EMBED_KEY} is {list(embed.shape)}, hidden_size {config.hidden_size}")
    notes = []
    if ref.config.get("vocab_size") not in (None, embed.shape[0]):
        notes.append(f"config vocab_size {ref.config['vocab_size']} but {EMBED_KEY} has {embed.shape[0]} rows")
    return embed, notes


def _fit_conventions(ref: ReferenceHead, config: MSDDraftConfig, state: dict) -> tuple[list[str], list[str]]:
    """Check `state` against the conventions the released code fixed (first-layer input
    norm, fc bias, M-RoPE sections); drop the norm the LLaVA head never applies.
    Returns (dropped keys, notes)."""
    dropped, notes = [], []
    norm0 = "layers.0.input_layernorm.weight"
    family = layer_family(config.layer_family)
    if not family.first_layer_input_norm and norm0 in state:
        # The released LLaVA code keeps this module but never applies it to layer 0.
        state.pop(norm0)
        dropped.append(norm0)
        notes.append(f"{norm0} dropped: the released LLaVA head does not apply an input norm on its first layer")
    if family.first_layer_input_norm and norm0 not in state:
        raise IncompleteHeadError(f"{ref.folder}/{ref.weights_file}: a {family.released_code} head needs {norm0}")
    if config.fc_bias and "fc.bias" not in state:
        raise IncompleteHeadError(
            f"{ref.folder}/{ref.weights_file}: no fc.bias, but config.json does not say \"bias\": false"
        )
    if not config.fc_bias and "fc.bias" in state:
        raise IncompleteHeadError(f"{ref.folder}: config.json says \"bias\": false but the weights hold fc.bias")
    if family.mrope and "mrope_section" not in json.dumps(ref.config):
        origin = "from the target" if config.mrope_section else "1-D RoPE; pass target= to take the target's sections"
        notes.append(f"config.json names no M-RoPE sections; mrope_section={config.mrope_section} ({origin})")
    return dropped, notes


def _load_head(ref: ReferenceHead, config: MSDDraftConfig, state: dict) -> tuple[MSDDraftModel, list[str], list[str]]:
    """The head with `state` loaded strictly, in the weights' dtype. RoPE buffers saved
    with the weights are not weights: ignored (and compared with config.json's rope).
    Returns (model, ignored keys, notes)."""
    buffers = {k: state.pop(k) for k in sorted(state) if NON_WEIGHT_BUFFER.search(k)}
    notes = []
    dtypes = {t.dtype for t in state.values()}
    dtype = state["fc.weight"].dtype
    if len(dtypes) > 1:
        notes.append(f"mixed dtypes {sorted(map(str, dtypes))} cast to {dtype}")
    # Built in the weights' dtype as from_pretrained does: the RoPE buffers stay fp32.
    model = MSDDraftModel._from_config(config, dtype=dtype)
    for key, buffer in buffers.items():
        notes.append(f"{key} ignored: a RoPE buffer, not a weight (recomputed from config.json's rope settings)"
                     + _inv_freq_check(key, buffer, model.rotary_emb.inv_freq))
    expected = set(model.state_dict())
    unexpected, missing = sorted(set(state) - expected), sorted(expected - set(state))
    if unexpected or missing:
        raise IncompleteHeadError(
            f"{ref.folder}/{ref.weights_file}: keys do not match an MSD head with config.json's sizes "
            f"(unexpected: {unexpected or 'none'}; missing: {missing or 'none'})"
        )
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise IncompleteHeadError(f"{ref.folder}: weight shapes do not match config.json: {err}") from err
    return model, list(buffers), notes


def _check_against_target(ref: ReferenceHead, config: MSDDraftConfig, embed: torch.Tensor,
                          target: TargetInfo | None) -> tuple[EmbeddingCheck | None, list[str]]:
    """Compare the released `embed_tokens` with the target's table and refuse a head of
    another width; without a target, say which published target the head now names."""
    if target is None:
        if not config.target_name_or_path:
            return None, []
        return None, [f"no target given; target_name_or_path set to {config.target_name_or_path}, the target "
                      f"the published {ref.model_type} heads of hidden size {config.hidden_size} were trained for"]
    check = check_embedding(embed, target.embedding)
    (log.info if check.ok else log.warning)("%s: %s", ref.folder, check.message())
    if target.hidden_size != config.hidden_size:
        raise ValueError(f"{ref.folder}: hidden size {config.hidden_size} does not fit target {target.name} "
                         f"(hidden size {target.hidden_size})")
    return check, [] if check.ok else [check.message()]


def import_reference(src: str | Path, out: str | Path, target: TargetInfo | None = None,
                     revision: str | None = None) -> ImportReport:
    """Released-layout folder (or Hub repo id) -> an export folder `out` that loads with
    `MSDDraftModel.from_pretrained(out)`. Written atomically (temp folder, then rename)."""
    folder = resolve_folder(src, revision)
    ref = read_reference(folder)
    model, report = convert_reference(ref, target, source=source_name(src))
    out = user_path(out)

    def write(tmp: Path):
        model.save_pretrained(tmp)
        (tmp / IMPORT_RECORD).write_text(json.dumps(report.record(ref.config), indent=1))

    atomic_dir(out, write)
    return report


def source_name(src) -> str:
    """A local folder as an absolute path (so a later export finds it from any cwd), a repo id as is."""
    return str(Path(src).resolve()) if Path(src).exists() else str(src)


# --- ours -> released ------------------------------------------------------------------------


def released_model_type(config: MSDDraftConfig) -> str:
    """The released layout's ``model_type`` for this head: its target family's (the adapter's
    ``reference_model_type``); heads saved before they recorded their family go by layer family."""
    family = head_family(config)
    if family.reference_model_type is None:
        raise ValueError(f"the released MSD layout has no model_type for {family.display_name} heads (the released "
                         f"code runs {', '.join(REFERENCE_MODEL_TYPES)}); export with format=msd")
    return family.reference_model_type


def reference_config(config: MSDDraftConfig, vocab_size: int, dtype: torch.dtype) -> dict:
    """A released-style config.json for a head trained here (Llama field names)."""
    rope = dict(config.rope_parameters or {})
    theta = rope.pop("rope_theta", 10000.0)
    rope_type = rope.pop("rope_type", "default")
    rope.pop("mrope_section", None)
    if config.mrope_section is not None:
        scaling = {"type": "mrope", "mrope_section": list(config.mrope_section)}
    elif rope_type != "default":
        scaling = {"type": rope_type, **rope}
    else:
        scaling = None
    return {
        "model_type": released_model_type(config),
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": config.num_hidden_layers,
        "hidden_act": config.hidden_act,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "vocab_size": vocab_size,
        "bias": config.fc_bias,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).replace("torch.", ""),
    }


def _reference_embedding(folder: Path, record: dict | None, target: TargetInfo | None, embed_from,
                         vocab_size: int | None):
    """The `embed_tokens.weight` a released-layout folder needs, and where it came from.

    In order: `embed_from` (a released-layout folder, e.g. the one a head was imported
    from), the target's table cut to the released vocabulary, or the folder the head was
    imported from (recorded in reference_import.json) when it is still reachable.
    """
    if embed_from is not None:
        return read_reference(resolve_folder(embed_from)).state_dict[EMBED_KEY], f"{embed_from}"
    if target is not None:
        rows = vocab_size or (record or {}).get("embed_tokens", {}).get("rows")
        if rows is None:
            # The original LLaVA vocabulary ends where llava-hf appended <image> and padding.
            appended = getattr(FAMILIES.get(target.model_type), "vocab_appended", False)
            rows = target.original_vocab_size if appended and target.original_vocab_size else None
            rows = rows or target.embedding.shape[0]
        return VocabMap(rows, target.embedding.shape[0]).rows_to_released(target.embedding), f"target {target.name}"
    if record is not None:
        try:
            source = resolve_folder(record["source"])
        except (FileNotFoundError, IncompleteHeadError) as err:
            raise FileNotFoundError(
                f"{folder}: was imported from {record['source']}, which is not reachable now ({err}); pass "
                f"embed_from=<the released folder> or target=<the target> to supply embed_tokens.weight"
            ) from err
        return read_reference(source).state_dict[EMBED_KEY], f"{record['source']} (recorded at import)"
    raise ValueError(
        f"{folder}: the released layout stores embed_tokens.weight, which this export does not hold (the head "
        f"uses its target's); pass target=<target name or path> or embed_from=<a released-layout folder>"
    )


def export_reference(
    checkpoint,
    out: str | Path,
    target: TargetInfo | None = None,
    embed_from: str | Path | None = None,
    weights: str = "auto",
    vocab_size: int | None = None,
) -> dict:
    """Write an export folder in the released layout, for tools written for the reference.

    `checkpoint`: an export folder (or Hub id) or a head. Weights are copied bit for bit; `embed_tokens.weight` comes from `embed_from`, the
    target, or the recorded import source (see `_reference_embedding`), in the head's
    dtype. `weights`: "safetensors", "bin", or "auto" (the imported file's format when
    round-tripping, else safetensors). Returns a summary dict (files, embedding source,
    warnings).
    """
    if isinstance(checkpoint, DraftHead):
        folder, model, record = "the head", checkpoint, None
    else:
        folder = resolve_folder(checkpoint)
        model = load_export(folder)
        record_path = folder / IMPORT_RECORD
        record = json.loads(record_path.read_text()) if record_path.is_file() else None
    FORMAT.check_holds(model, folder)
    if target is not None:
        target.refuse_misfit(model.config, folder)
    warnings = _check_released_layout(folder, model.config)
    embed, embed_source = _reference_embedding(folder, record, target, embed_from, vocab_size)
    embed = embed.to(model.dtype)
    if record is not None and tensor_sha256(embed) != record["embed_tokens"]["sha256"]:
        warnings.append(f"embed_tokens from {embed_source} differs from the one the head was imported with")
    weights = _weights_format(weights, record)
    state = {EMBED_KEY: embed}
    state.update({k: v.detach().contiguous() for k, v in model.state_dict().items()})
    filename = _write_released(Path(out), state, _released_config(record, model.config, embed, model.dtype), weights)
    for w in warnings:
        log.warning("%s", w)
    return {"out": str(out), "files": ["config.json", filename], "embed_tokens_from": embed_source,
            "embed_rows": embed.shape[0], "warnings": warnings}


def _check_released_layout(folder: Path, config: MSDDraftConfig) -> list[str]:
    """Refuse a head the released code would draft with otherwise than it was trained: the
    released layout has no field for these settings and its code fixes them (decoupling with
    the released offset, 1-D positions, every visual token, no input norm on a LLaVA head's
    first layer), so the folder would be served, and would import back, as another head.
    Each setting is named with the format that keeps it. Returns the warnings (none now)."""
    family = layer_family(config.layer_family)
    if config.first_layer_input_norm != family.first_layer_input_norm:
        raise ValueError(
            f"{folder}: first_layer_input_norm={config.first_layer_input_norm} cannot be expressed in the released "
            f"layout, whose {family.released_code} code {'always' if family.first_layer_input_norm else 'never'} "
            f"applies an input norm on the first layer"
        )
    keep = "format=msd keeps it (eval.py, load_head)"
    refused = []
    if not config.decouple_visual or config.visual_offset != "released":
        refused.append(f"decouple_visual={config.decouple_visual}, visual_offset={config.visual_offset!r}: the "
                       f"released code decouples with the released offset; {keep}")
    if config.uses_mrope and config.draft_positions != "1d":
        refused.append(f"draft_positions={config.draft_positions!r}: the released code drafts with 1-D positions; "
                       f"{keep}")
    if getattr(config, "visual_compression", "none") != "none":
        refused.append(f"visual_compression={config.visual_compression} (visual_compression_tokens="
                       f"{config.visual_compression_tokens}): the released code drafts over every visual token; "
                       f"{keep}")
    if refused:
        raise ValueError(f"{folder}: format=reference cannot keep what this head drafts with: " + "; ".join(refused))
    return []


def _released_config(record: dict | None, config: MSDDraftConfig, embed: torch.Tensor, dtype: torch.dtype) -> dict:
    """The config.json to write: the imported original verbatim (vocab_size following the
    embedding actually written), else one made from the head's config."""
    if record is None:
        return reference_config(config, embed.shape[0], dtype)
    ref_config = dict(record["reference_config"])
    if ref_config.get("vocab_size") not in (None, embed.shape[0]):
        ref_config["vocab_size"] = embed.shape[0]
    return ref_config


def _weights_format(weights: str, record: dict | None) -> str:
    """"safetensors" or "bin"; "auto": the imported file's format, else safetensors."""
    if weights == "auto":
        weights = "bin" if record is not None and record["weights_file"].endswith(".bin") else "safetensors"
    if weights not in ("safetensors", "bin"):
        raise ValueError(f"weights={weights!r}: use safetensors, bin or auto")
    return weights


def _write_released(out: Path, state: dict, ref_config: dict, weights: str) -> str:
    """Write `out` (atomically) as a released-layout folder; returns the weights file name."""
    filename = "model.safetensors" if weights == "safetensors" else "pytorch_model.bin"

    def write(tmp: Path):
        if weights == "safetensors":
            from safetensors.torch import save_file

            save_file(state, tmp / filename, metadata={"format": "pt"})
        else:
            torch.save({k: v.clone() for k, v in state.items()}, tmp / filename)
        (tmp / "config.json").write_text(json.dumps(ref_config, indent=2) + "\n")

    atomic_dir(out, write)
    return filename


# --- the format ------------------------------------------------------------------------------


def load_reference(folder: Path, target: TargetProtocol | None = None, source=None) -> MSDDraftModel:
    """A released-layout folder as a head, converted in memory exactly as the importer
    does (its notes logged); `target`: a loaded `Target`, whose embedding the released
    one is checked against."""
    info = TargetInfo.of(target) if target is not None else None
    model, report = convert_reference(read_reference(folder), info, source=source or str(folder))
    for note in report.notes:
        log.info("%s: %s", source or folder, note)
    return model


def is_reference(config: dict) -> bool:
    return config.get("model_type") in REFERENCE_MODEL_TYPES


FORMAT = HeadFormat(
    name="reference", heads=("msd",), write=export_reference, detect=is_reference, load=load_reference,
    options=("target", "embed_from", "weights", "vocab_size"),
    describe=f"the released MSD layout, model_type {' or '.join(map(repr, REFERENCE_MODEL_TYPES))}",
)
