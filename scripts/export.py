#!/usr/bin/env python
"""Export a head to any head format of msd_train/hub/formats.py.

    python scripts/export.py checkpoint=runs/tiny/stage2/final format=msd out=heads/tiny dtype=bf16
    python scripts/export.py checkpoint=heads/tiny format=reference target=tiny out=heads/tiny-reference
    python scripts/export.py checkpoint=runs/tiny/stage2/final format=eagle3 out=heads/tiny-eagle3  (msd3 heads)
    python scripts/export.py checkpoint=runs/tiny/stage2/final format=vllm out=heads/tiny-vllm  (docs/serving.md)
    python scripts/export.py experiment=smollm2_llava format=vllm   # its head, into work/smollm2_llava/export/vllm

format=reference writes config.json + model.safetensors (weights=bin: pytorch_model.bin)
with embed_tokens.weight taken from embed_from=, target=, or the folder the head was
imported from. Each format takes only its own options. Arguments: conf/hub/export.yaml.
See docs/hub.md.
"""

import json
import logging

import hydra
from omegaconf import DictConfig

from msd_train.config import CONF_DIR
from msd_train.hub_cli import require_arguments, target_info, user_error_kinds
from msd_train.outputs import output_dir, relocate
from msd_train.paths import user_path
from msd_train.validate import hub_experiment, user_errors

#: the keys of conf/hub/export.yaml that are options of some format's export
OPTIONS = ("target", "dtype", "embed_from", "weights", "vocab_size")


@hydra.main(config_path=str(CONF_DIR / "hub"), config_name="export", version_base=None)
def main(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with user_errors(*user_error_kinds()):  # a user's mistake: one paragraph, exit 1 (MSD_DEBUG=1: the traceback)
        recipe = hub_experiment(cfg, "export")  # experiment=NAME: its head, its exports folder, its target
        require_arguments(cfg, "export")
        from msd_train import hub  # fills the format registry

        fmt = hub.formats.get(cfg.format)
        # every option the format takes, and any other one the user set (null and
        # weights=auto are the defaults): fmt.export refuses those rather than ignore them
        options = {k: cfg[k] for k in OPTIONS if k in fmt.options or cfg[k] not in (None, "auto")}
        if "target" in fmt.options:
            target = cfg.target if cfg.target is not None or recipe is None else recipe["target"]
            options["target"] = target_info(target)
        out = user_path(cfg.out)
        # written beside out= and renamed into place; a folder this command did not make is refused
        # (overwrite=true replaces it), a run or the checkpoint itself never
        with output_dir(out, "scripts/export.py", overwrite=cfg.overwrite,
                        sources=[user_path(cfg.checkpoint), cfg.embed_from and user_path(cfg.embed_from)]) as tmp:
            summary = relocate(fmt.export(user_path(cfg.checkpoint), tmp, **options), tmp, out)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
