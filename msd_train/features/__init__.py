"""Where target features come from during training.

``online``: the frozen target runs inside each training step (this module). An offline
store of precomputed shards plugs in behind the same call: ``source(batch) -> Features``.
"""

from __future__ import annotations

import torch

from msd_train.targets import Features, TargetProtocol


class OnlineFeatures:
    """Runs the frozen target on each batch; no gradients, the target's dtype."""

    def __init__(self, target: TargetProtocol, layers: list[int] | None = None):
        self.target = target
        self.layers = layers  # the target layers whose inputs the head reads (None: the last output only)

    @torch.no_grad()
    def __call__(self, batch: dict) -> Features:
        return self.target.features(batch["input_ids"], batch["attention_mask"], batch["pixel"], layers=self.layers)


def make_feature_source(cfg, target: TargetProtocol, layers: list[int] | None = None):
    """The configured source: ``features.mode=online`` or ``offline`` (a feature store).
    ``layers``: the head's ``feature_layers``."""
    mode = cfg.features.mode
    if mode == "online":
        return OnlineFeatures(target, layers)
    if mode == "offline":
        from msd_train.features.offline import OfflineFeatures

        return OfflineFeatures(cfg, target, layers)
    raise ValueError(f"features.mode={mode}: use online or offline")
