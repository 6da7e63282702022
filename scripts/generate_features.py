"""Write a feature store: the frozen target's features over the configured data.

    python scripts/generate_features.py features.path=DIR [target=... data=...]
    torchrun --nproc_per_node 8 scripts/generate_features.py features.path=DIR ...
    deepspeed scripts/generate_features.py features.path=DIR ...
    python scripts/generate_features.py features.path=DIR dry_run=true   # count and size only

Re-running the same command resumes: finished shards are verified and skipped. Train
from the store with ``train.py features=offline features.path=DIR`` and the same target
and data overrides. See docs/features.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from msd_train.config import CONF_DIR, strip_launcher_args  # noqa: E402

strip_launcher_args()

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402


def init_distributed():
    """Join the launcher's process group (torchrun / deepspeed set WORLD_SIZE), if any."""
    import os

    import torch
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    return dist


@hydra.main(config_path=str(CONF_DIR), config_name="generate_features", version_base=None)
def main(cfg: DictConfig) -> None:
    import logging

    from msd_train.features.generate import generate
    from msd_train.features.store import FeatureStoreError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)
    for noisy in ("datasets", "httpx", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from omegaconf import OmegaConf

    from msd_train.validate import check_generate, user_errors

    with user_errors():  # before the target loads: a bad value or path is one message, exit 1
        check_generate(OmegaConf.to_container(cfg, resolve=True))
    dist = init_distributed()
    try:
        generate(cfg, dist)
    except FeatureStoreError as e:
        logging.getLogger("msd_train.features").error("%s", e)
        sys.exit(1)
    finally:
        if dist is not None and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
