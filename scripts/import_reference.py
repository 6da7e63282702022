#!/usr/bin/env python
"""Import a released MSD head into this project's export format.

    python scripts/import_reference.py src=lucylyn/MSD-LLaVA1.5-7B out=heads/msd-llava15-7b target=llava15_7b

Reads config.json + pytorch_model.bin (with torch.load(weights_only=True)) or
model.safetensors, writes OUT/config.json + OUT/model.safetensors (loadable with
MSDDraftModel.from_pretrained) and OUT/reference_import.json. Arguments:
conf/hub/import_reference.yaml. See docs/hub.md.
"""

import json
import logging

import hydra
from omegaconf import DictConfig

from msd_train.config import CONF_DIR
from msd_train.hub_cli import require_arguments, target_info, user_error_kinds
from msd_train.outputs import output_dir
from msd_train.paths import user_path
from msd_train.validate import user_errors


@hydra.main(config_path=str(CONF_DIR / "hub"), config_name="import_reference", version_base=None)
def main(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with user_errors(*user_error_kinds()):  # a user's mistake: one paragraph, exit 1 (MSD_DEBUG=1: the traceback)
        require_arguments(cfg, "import_reference")
        from msd_train.hub import import_reference

        target = target_info(cfg.target)
        out = user_path(cfg.out)
        with output_dir(out, "scripts/import_reference.py", overwrite=cfg.overwrite,
                        sources=[user_path(cfg.src)]) as tmp:  # renamed into place when whole
            report = import_reference(cfg.src, tmp, target=target, revision=cfg.revision)
    print(f"imported {cfg.src} -> {out}")
    print(json.dumps({"config": report.config, "dropped_keys": report.dropped_keys,
                      "embedding_check": report.embedding.as_dict() if report.embedding else None,
                      "notes": report.notes}, indent=1))


if __name__ == "__main__":
    main()
