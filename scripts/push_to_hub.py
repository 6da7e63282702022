#!/usr/bin/env python
"""Publish a head to the Hugging Face Hub with a generated model card.

    python scripts/push_to_hub.py checkpoint=runs/tiny/stage2/final repo_id=me/msd-tiny dry_run=true
    python scripts/push_to_hub.py checkpoint=runs/tiny/stage2/final repo_id=me/msd-tiny private=true
    python scripts/push_to_hub.py experiment=smollm2_llava repo_id=me/msd-smollm2-llava dry_run=true

Creates the repository if missing and uploads the export folder (weights, config.json,
training.json, local paths masked), report.json and README.md. The card carries the training commands, the
curriculum, the target (and its LoRA adapter) and the latest eval.py numbers. The token
comes from HF_TOKEN or `huggingface-cli login` and is never printed. Arguments:
conf/hub/push.yaml. See docs/hub.md.
"""

import logging

import hydra
from omegaconf import DictConfig

from msd_train.config import CONF_DIR
from msd_train.hub_cli import require_arguments, user_error_kinds
from msd_train.paths import check_repo_id
from msd_train.validate import hub_experiment, user_errors


@hydra.main(config_path=str(CONF_DIR / "hub"), config_name="push", version_base=None)
def main(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with user_errors(*user_error_kinds()):  # a refused head or id, no token, no network: one paragraph, exit 1
        hub_experiment(cfg, "push")  # experiment=NAME: the head its recipe ends with
        require_arguments(cfg, "push")
        check_repo_id(cfg.repo_id)  # before the hub stack loads
        from msd_train.hub import push_head

        push_head(cfg.checkpoint, cfg.repo_id, private=cfg.private, dry_run=cfg.dry_run, report=cfg.report,
                  license=cfg.license, datasets=list(cfg.datasets) if cfg.datasets else None,
                  commit_message=cfg.commit_message, base_model=cfg.base_model, staging=cfg.staging)


if __name__ == "__main__":
    main()
