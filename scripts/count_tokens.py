"""Write a head's token counts, for a head exported without them (``decoding.draft_vocab``).

    python scripts/count_tokens.py draft=HEAD_DIR [the target and data overrides you gave train.py]
    python scripts/count_tokens.py draft=runs/smol/stage1/final target=smollm2_llava \\
        "data.text=[{path: data/regen_train.jsonl}]" data.max_length=512 "splits=[text]"

Training writes ``token_counts.safetensors`` beside every export it makes; this script
counts the same thing (the assistant tokens of the data splits, tokenised and cut at
``data.max_length`` exactly as training does: ``msd_train.data.dataset.build_split``)
for a head that has none, reading the target's tokenizer and chat template, not its
weights. A Hydra entry point over conf/count_tokens.yaml.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from msd_train.config import CONF_DIR


def count(cfg: DictConfig) -> int:
    from msd_train.data.dataset import build_split
    from msd_train.draft.vocabulary import save_counts, token_counts
    from msd_train.features.generate import load_target_skeleton
    from msd_train.hub.folders import read_config
    from msd_train.paths import user_path

    folder = Path(user_path(str(cfg.draft)))
    read_config(folder)  # a head folder, or a clear error naming it
    logging.getLogger("datasets").setLevel(logging.WARNING)
    target = load_target_skeleton(cfg.target)
    d, datasets = cfg.data, []
    for name in cfg.splits:
        sources = [OmegaConf.to_container(s, resolve=True) for s in (d.get(name) or [])]
        if sources:
            datasets.append(build_split(sources, target, d.max_length, "skip", d.cache_dir, d.num_proc).dataset)
    n = sum(len(ds) for ds in datasets)
    if n == 0:
        print(f"error: no usable samples in data.{', data.'.join(cfg.splits)}; check them with scripts/check_data.py",
              file=sys.stderr)
        return 1
    counts = token_counts(datasets, target.vocab_size)
    path = save_counts(folder, counts)
    print(f"{int(counts.sum())} assistant tokens of {n} samples ({int((counts > 0).sum())} distinct ids) -> {path}")
    return 0


@hydra.main(config_path=str(CONF_DIR), config_name="count_tokens", version_base=None)
def main(cfg: DictConfig) -> None:
    from msd_train.hub_cli import user_error_kinds
    from msd_train.validate import user_errors

    with user_errors(*user_error_kinds()):  # a missing or wrong head folder: one paragraph, exit 1
        rc = count(cfg)
    if rc:
        sys.exit(rc)


if __name__ == "__main__":
    main()
