"""Who a target's LoRA adapter is, for the records that must name it (model card,
feature-store identity): its path, its peft settings, a digest of its weights."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

#: The peft settings that decide what the adapter does to the target.
ADAPTER_KEYS = ("peft_type", "base_model_name_or_path", "r", "lora_alpha", "target_modules", "revision")
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def adapter_identity(adapter: str | None) -> dict | None:
    """``{"adapter": path, <peft settings>, "weights_sha256": ...}`` of a peft folder, or
    None without an adapter. A Hub id (no local folder) is named as is, without settings
    or digest; lists are sorted so that the same adapter always reads the same."""
    if not adapter:
        return None
    ident = {"adapter": str(adapter)}
    folder = Path(adapter)
    config = folder / "adapter_config.json"
    if config.is_file():
        cfg = json.loads(config.read_text())
        for key in ADAPTER_KEYS:
            if cfg.get(key) is not None:
                ident[key] = sorted(cfg[key]) if isinstance(cfg[key], (list, set)) else cfg[key]
    for name in ADAPTER_WEIGHTS:
        if (folder / name).is_file():
            h = hashlib.sha256()
            with open(folder / name, "rb") as f:  # adapters can be GBs: read in 4 MiB chunks
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    h.update(chunk)
            ident["weights_sha256"] = h.hexdigest()
            break
    return ident
