"""The training loop over a DeepSpeed engine (see recipe.py)."""

from __future__ import annotations

import logging
import sys


def run(cfg) -> None:
    """Set up, train and export one stage; user-facing failures exit with their message."""
    from msd_train.features.store import FeatureStoreError
    from msd_train.training.recipe import TrainingError, TrainRecipe

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "datasets", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    recipe = TrainRecipe(cfg)
    try:
        recipe.setup()
        recipe.train()
    except (TrainingError, FeatureStoreError) as e:
        logging.getLogger("msd_train").error("%s", e)
        sys.exit(1)
    finally:
        recipe.cleanup() if hasattr(recipe, "dist") else None
