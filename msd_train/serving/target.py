"""A target folder as vLLM reads it.

transformers (>= 5) writes a LLaVA folder's CLIP tower under ``vision_tower.*``; vLLM's
LLaVA loader (0.32, ``vllm/model_executor/models/llava.py``) maps only the older
``vision_tower.vision_model.*`` names, so it cannot load the folder as transformers saved
it. ``vllm_target`` writes a copy with the tower renamed into a cache folder (keyed by the
source weights' size and mtime) and returns it; folders vLLM reads as they are come back
unchanged. The installed vLLM is left alone: the fix lives in the files it is given.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from msd_train.runtime import atomic_dir

OLD, NEW = "vision_tower.", "vision_tower.vision_model."


def _needs_rename(keys) -> bool:
    tower = [k for k in keys if k.startswith(OLD)]
    return bool(tower) and not any(k.startswith(NEW) for k in tower)


def vllm_target(folder: str | Path, cache: str | Path) -> Path:
    """``folder``, or a converted copy under ``cache`` when vLLM cannot read it as is."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():  # a Hub id: vLLM downloads it (converted there or not)
        return folder
    config = json.loads((folder / "config.json").read_text())
    weights = sorted(folder.glob("*.safetensors"))
    if config.get("model_type") != "llava" or not weights:
        return folder
    keys = {}
    for w in weights:
        with safe_open(str(w), "pt") as f:
            keys[w] = list(f.keys())
    if not _needs_rename([k for ks in keys.values() for k in ks]):
        return folder
    stamp = hashlib.sha256(json.dumps([[str(w), w.stat().st_size, w.stat().st_mtime_ns] for w in weights])
                           .encode()).hexdigest()[:12]
    out = Path(cache) / f"{folder.name}-vllm-{stamp}"
    if (out / "config.json").is_file():
        return out

    def write(tmp: Path):
        for item in folder.iterdir():
            if item.is_file() and item.suffix != ".safetensors" and item.name != "model.safetensors.index.json":
                shutil.copy2(item, tmp / item.name)
        index = {}
        for w, names in keys.items():
            with safe_open(str(w), "pt") as f:
                state = {(NEW + k[len(OLD):] if k.startswith(OLD) else k): f.get_tensor(k) for k in names}
            save_file(state, str(tmp / w.name), metadata={"format": "pt"})
            index.update({k: w.name for k in state})
        if len(weights) > 1:
            (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))

    atomic_dir(out, write)
    return out
