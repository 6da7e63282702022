"""Target adapters: one interface over the LLaVA and Qwen2-VL / Qwen2.5-VL families."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from msd_train.paths import user_path
from msd_train.runtime import resolve_dtype
from msd_train.targets.base import Encoded, Features, Target
from msd_train.targets.llava import LlavaTarget
from msd_train.targets.qwen_vl import QwenVLTarget

log = logging.getLogger(__name__)

FAMILIES = {
    "llava": LlavaTarget,
    "qwen2_vl": QwenVLTarget,
    "qwen2_5_vl": QwenVLTarget,
}

__all__ = ["Encoded", "Features", "Target", "load_processor", "load_target", "wrap_target", "resolve_dtype"]


def wrap_target(model, processor, name: str, chat_template: str | None = None) -> Target:
    """Adapter for an already-loaded transformers model and its processor."""
    model_type = model.config.model_type
    if model_type not in FAMILIES:
        raise ValueError(
            f"target {name}: model_type {model_type!r} is not supported; "
            f"supported: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type](model, processor, name, chat_template)


def load_processor(name_or_path: str, model_type: str, trust_remote_code: bool = False):
    """The target's processor (tokenizer + image processor).

    Qwen2VLProcessor insists on building its video processor, which needs torchvision,
    although image prompts never touch it. Without torchvision, a Qwen2-VL / Qwen2.5-VL
    target gets the tokenizer and the PIL image processor (what the adapter reads), so
    torchvision stays optional.
    """
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except ImportError as e:
        if model_type not in ("qwen2_vl", "qwen2_5_vl") or "orchvision" not in str(e):
            raise
    from types import SimpleNamespace

    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    log.info("torchvision is not installed: %s gets its tokenizer and the PIL image processor "
             "(no video processor; image prompts need none)", name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    return SimpleNamespace(tokenizer=tokenizer, image_processor=Qwen2VLImageProcessorPil.from_pretrained(name_or_path),
                           image_token=getattr(tokenizer, "image_token", None) or "<|image_pad|>")


def load_target(
    name_or_path: str,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    adapter: str | None = None,
    chat_template: str | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str = "sdpa",
) -> Target:
    """Load a frozen target by Hub id or local path, optionally merging a LoRA adapter.

    The adapter (a peft folder) is merged into the weights at load, so every later
    forward (features, verification) sees the tuned target at no extra cost.
    """
    from transformers import AutoConfig, AutoModelForImageTextToText

    name_or_path = str(user_path(name_or_path))  # a Hub id is left as it is
    adapter = str(user_path(adapter)) if adapter else adapter
    torch_dtype = resolve_dtype(dtype, device)
    config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    if config.model_type not in FAMILIES:
        raise ValueError(
            f"target {name_or_path}: model_type {config.model_type!r} is not supported; "
            f"supported: {', '.join(sorted(FAMILIES))}"
        )
    # The processor first: a missing piece fails in seconds, not after loading 7B weights.
    processor = load_processor(name_or_path, config.model_type, trust_remote_code)
    model = AutoModelForImageTextToText.from_pretrained(
        name_or_path, dtype=torch_dtype, trust_remote_code=trust_remote_code,
        attn_implementation=attn_implementation,
    )
    if adapter:
        if not Path(adapter).exists() and "/" not in adapter:
            raise FileNotFoundError(f"target.adapter={adapter}: no such adapter folder")
        from peft import PeftModel

        log.info("merging LoRA adapter %s into %s", adapter, name_or_path)
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model.to(device)
    target = wrap_target(model, processor, name_or_path, chat_template)
    target.adapter = adapter
    return target
