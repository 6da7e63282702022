"""Target adapters: one class per family (LLaVA-1.5, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL, Qwen3-VL)."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import torch

from msd_train.paths import user_path
from msd_train.runtime import resolve_dtype
from msd_train.targets.base import Encoded, Features, Target
from msd_train.targets.llava import LlavaNextTarget, LlavaTarget
from msd_train.targets.protocol import TargetProtocol
from msd_train.targets.qwen_vl import Qwen3VLTarget, Qwen25VLTarget, QwenVLTarget
from msd_train.trust import unsafe_file

log = logging.getLogger(__name__)

#: every adapter class; a new family is one more entry here
ADAPTERS: tuple[type[Target], ...] = (LlavaTarget, LlavaNextTarget, QwenVLTarget, Qwen25VLTarget, Qwen3VLTarget)
#: composite config model_type -> adapter class
FAMILIES = {mt: cls for cls in ADAPTERS for mt in cls.model_types}

__all__ = ["ADAPTERS", "Encoded", "Features", "Target", "TargetProtocol", "adapter_class", "load_processor", "load_target",
           "wrap_target", "resolve_dtype", "target_shapes"]


def adapter_class(config) -> type[Target]:
    """The adapter class of a target's config: a composite one (``LlavaConfig``,
    ``Qwen3VLConfig``, ...) by its model_type, or a text config by its text model_type
    (the first adapter that lists it: LLaVA and LLaVA-NeXT share Llama, alike for a head)."""
    model_type = getattr(config, "model_type", None)
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    for cls in ADAPTERS:
        if model_type in cls.text_model_types:
            return cls
    raise ValueError(
        f"model_type {model_type!r} is not a supported target; supported: {', '.join(sorted(FAMILIES))} "
        f"(text models: {', '.join(sorted({t for c in ADAPTERS for t in c.text_model_types}))})"
    )


def target_shapes() -> dict[str, dict]:
    """Every family's published shapes, by name (``llava15_7b``, ``qwen3vl_8b``, ...), each with
    its ``family`` (the composite model_type a random model of it is built as)."""
    return {name: {"family": cls.model_types[0], **shape} for cls in ADAPTERS for name, shape in cls.shapes.items()}


def wrap_target(model, processor, name: str, chat_template: str | None = None) -> Target:
    """Adapter for an already-loaded transformers model and its processor."""
    model_type = model.config.model_type
    if model_type not in FAMILIES:
        raise ValueError(
            f"target {name}: model_type {model_type!r} is not supported; "
            f"supported: {', '.join(sorted(FAMILIES))}"
        )
    cls = FAMILIES[model_type]
    if cls.min_transformers and not transformers_at_least(cls.min_transformers):
        import transformers

        raise ValueError(f"target {name}: {cls.display_name} targets need transformers >= {cls.min_transformers} "
                         f"(installed: {transformers.__version__}); pip install -U transformers")
    return cls(model, processor, name, chat_template)


def head_family(config) -> type[Target]:
    """The target adapter of a head's family: the one its config records, else (heads saved
    before they recorded it) the first family drafting with its layer family."""
    if config.target_model_type in FAMILIES:
        return FAMILIES[config.target_model_type]
    return next(c for c in ADAPTERS if c.draft_layer_family == config.layer_family)


def transformers_at_least(version: str) -> bool:
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) >= Version(version)


def load_processor(name_or_path: str, model_type: str, trust_remote_code: bool = False):
    """The target's processor (tokenizer + image processor), as its family's adapter loads it."""
    from transformers import AutoProcessor

    cls = FAMILIES.get(model_type)
    if cls is None:
        return AutoProcessor.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    return cls.load_processor(name_or_path, trust_remote_code)


def load_target(
    name_or_path: str,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    adapter: str | None = None,
    chat_template: str | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str = "auto",
    onednn_linears: bool = False,
) -> Target:
    """Load a frozen target by Hub id or local path, optionally merging a LoRA adapter.

    The adapter (a peft folder) is merged into the weights at load, so every later
    forward (features, verification) sees the tuned target at no extra cost.
    ``onednn_linears``: fp32 linear layers on the CPU run oneDNN over packed weights
    (``cpu_linear.pack_linears``; for decoding, inference only).
    """
    from transformers import AutoConfig, AutoModelForImageTextToText

    name_or_path = str(user_path(name_or_path))  # a Hub id is left as it is
    adapter = str(user_path(adapter)) if adapter else adapter
    torch_dtype = resolve_dtype(dtype, device)
    attn_implementation = "sdpa" if attn_implementation in (None, "auto") else attn_implementation
    config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    if config.model_type not in FAMILIES:
        raise ValueError(
            f"target {name_or_path}: model_type {config.model_type!r} is not supported; "
            f"supported: {', '.join(sorted(FAMILIES))}"
        )
    # The processor first: a missing piece fails in seconds, not after loading 7B weights.
    processor = load_processor(name_or_path, config.model_type, trust_remote_code)
    try:  # transformers reads .bin weights with torch.load(weights_only=True), refusing pickled code
        model = AutoModelForImageTextToText.from_pretrained(
            name_or_path, dtype=torch_dtype, trust_remote_code=trust_remote_code,
            attn_implementation=attn_implementation,
        )
    except pickle.UnpicklingError as err:
        raise unsafe_file(f"{name_or_path}/pytorch_model*.bin", err, "Use the target's safetensors weights, or "
                                                                      "convert them where they were made") from err
    if adapter:
        if not Path(adapter).exists() and "/" not in adapter:
            raise FileNotFoundError(f"target.adapter={adapter}: no such adapter folder")
        from peft import PeftModel

        log.info("merging LoRA adapter %s into %s", adapter, name_or_path)
        try:
            model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
        except pickle.UnpicklingError as err:
            raise unsafe_file(f"target.adapter={adapter} (adapter_model.bin)", err,
                              "Save the adapter as safetensors where it was made") from err
    model.to(device)
    if onednn_linears:
        from msd_train.targets.cpu_linear import pack_linears

        pack_linears(model)
    target = wrap_target(model, processor, name_or_path, chat_template)
    target.adapter = adapter
    return target
