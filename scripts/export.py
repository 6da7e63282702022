#!/usr/bin/env python
"""Export a head: this project's folder, or the released MSD layout.

    python scripts/export.py checkpoint=runs/tiny/stage2/final format=msd out=heads/tiny dtype=bf16
    python scripts/export.py checkpoint=heads/tiny format=reference target=tiny out=heads/tiny-reference
    python scripts/export.py checkpoint=runs/tiny/stage2/final format=eagle3 out=heads/tiny-eagle3  (msd3 heads)
    python scripts/export.py checkpoint=runs/tiny/stage2/final format=vllm out=heads/tiny-vllm  (docs/serving.md)

format=reference writes config.json + model.safetensors (weights=bin: pytorch_model.bin)
with embed_tokens.weight taken from embed_from=, target=, or the folder the head was
imported from. Arguments: conf/hub/export.yaml. See docs/hub.md.
"""

import json
import logging

import hydra
from omegaconf import DictConfig

from msd_train.config import CONF_DIR
from msd_train.hub.cli import require_arguments, target_info, user_error_kinds
from msd_train.paths import user_path
from msd_train.validate import ConfigError, user_errors


@hydra.main(config_path=str(CONF_DIR / "hub"), config_name="export", version_base=None)
def main(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with user_errors(*user_error_kinds()):  # a user's mistake: one paragraph, exit 1 (MSD_DEBUG=1: the traceback)
        require_arguments(cfg, "export")
        if cfg.format not in ("msd", "reference", "eagle3", "vllm"):
            raise ConfigError(f"format={cfg.format}: use msd, reference, eagle3 or vllm")
        from msd_train.hub import export_msd, export_reference

        target = target_info(cfg.target)
        checkpoint, out = user_path(cfg.checkpoint), user_path(cfg.out)
        if cfg.format == "msd":
            summary = export_msd(checkpoint, out, target=target, dtype=cfg.dtype)
        elif cfg.format == "eagle3":  # an msd3 head in the EAGLE-3 layout (msd_train/hub/eagle3.py)
            from msd_train.hub import load_head
            from msd_train.hub.eagle3 import export_eagle3

            head = load_head(checkpoint)
            if head.feature_layers is None:
                raise ConfigError(f"format=eagle3 holds msd3 heads; {checkpoint} is an {head.architecture} head "
                                  f"(use format=msd or format=reference)")
            summary = {"out": str(export_eagle3(head, out)), "format": "eagle3"}
        elif cfg.format == "vllm":  # vLLM's EAGLE (msd) or speculators EAGLE-3 (msd3) layout: msd_train/hub/vllm.py
            from msd_train.hub import load_head
            from msd_train.hub.vllm import export_vllm
            from msd_train.runtime import resolve_dtype

            summary = export_vllm(load_head(checkpoint), out, dtype=resolve_dtype(cfg.dtype, "cpu") if cfg.dtype else None)
            for lost in summary["stock_vllm_loses"]:
                print(f"stock vLLM (without this project's plugin) loses: {lost}")
        else:
            summary = export_reference(checkpoint, out, target=target, embed_from=cfg.embed_from,
                                       weights=cfg.weights, vocab_size=cfg.vocab_size)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
