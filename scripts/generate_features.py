"""Write a feature store: the frozen target's features over the configured data.

    python scripts/generate_features.py features.path=DIR [target=... data=...]
    torchrun --nproc_per_node 8 scripts/generate_features.py features.path=DIR ...
    deepspeed scripts/generate_features.py features.path=DIR ...
    python scripts/generate_features.py features.path=DIR dry_run=true   # count and size only

Re-running the same command resumes: finished shards are verified and skipped. Train
from the store with ``train.py features=offline features.path=DIR`` and the same target
and data overrides. See docs/features.md.
"""


from msd_train.config import CONF_DIR, strip_launcher_args

strip_launcher_args()

import hydra  # noqa: E402  (after strip_launcher_args: Hydra must not see launcher flags)
from omegaconf import DictConfig  # noqa: E402


@hydra.main(config_path=str(CONF_DIR), config_name="generate_features", version_base=None)
def main(cfg: DictConfig) -> None:
    import logging
    import os

    from omegaconf import OmegaConf

    from msd_train.validate import check_generate, user_errors

    with user_errors():  # before torch and the target load: a bad value or path is one message, exit 1
        check_generate(OmegaConf.to_container(cfg, resolve=True))
    from msd_train import runtime
    from msd_train.data.dataset import UnusableImage
    from msd_train.features.generate import generate
    from msd_train.features.store import FeatureStoreError
    from msd_train.outputs import FolderLock
    from msd_train.paths import user_path

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)
    for noisy in ("datasets", "httpx", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    with user_errors():  # taken here, just before the `try` that releases it (not before the imports)
        # one launch per store (the other ranks of a refused launch are stopped by its launcher)
        lock = FolderLock(user_path(cfg.features.path), "features.path") if int(os.environ.get("RANK", 0)) == 0 else None
        if lock is not None:
            lock.acquire()
    try:
        # Joins the launcher's group (torchrun / deepspeed set WORLD_SIZE), NCCL on CUDA, gloo on CPU.
        with user_errors(runtime.JoinError):  # a node that never started: one message
            group = runtime.setup_group(runtime.local_device(cfg.target.device),
                                        timeout_minutes=cfg.dist.timeout_minutes)
        kept = (f"every finished shard in {cfg.features.path} is kept (progress/rank-*.jsonl lists them); relaunch "
                "the same command to resume")
        try:
            with user_errors(FeatureStoreError, runtime.SharedPathError, UnusableImage, kept=kept):  # a full disk, Ctrl-C, a bad store: one message
                generate(cfg, group)
        finally:
            group.destroy(barrier=False)
    finally:
        if lock is not None:
            lock.release()


if __name__ == "__main__":
    main()
