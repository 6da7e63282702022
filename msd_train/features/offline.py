"""Training from a feature store: ``features=offline features.path=DIR``.

``OfflineFeatures(cfg, target)(batch) -> Features`` stands in for the online target
forward. The batch comes from the same curriculum and collator as online training (with
``pixels=False``); for each sample the store's rows are looked up by the batch's stable
key, checked against the batch's token ids, padded to the batch length, and moved to the
target's device and dtype. Text embeddings come from the configured target's frozen table;
the stored projector outputs are scattered in at the image positions.

Two halves: ``host(batch)`` reads the shards and checks them against the batch on the
host; the training DataLoader runs it in its worker processes (``StepBatches(features=)``),
so the disk reads and checks overlap the steps and the training thread only embeds and
copies to the device. A batch without that part (validation) has it read in place.
"""

from __future__ import annotations

import logging

import torch

from msd_train.config import stage_splits
from msd_train.features.generate import data_fingerprint, manifest_differences
from msd_train.features.store import FeatureStore, FeatureStoreError
from msd_train.targets import Features, TargetProtocol
from msd_train.targets.identity import target_identity

log = logging.getLogger("msd_train.features")


class OfflineFeatures:
    def __init__(self, cfg, target: TargetProtocol, layers: list[int] | None = None):
        fc = cfg.features
        self.target = target
        self.store = FeatureStore(fc.path, verify=fc.get("verify", "quick"))
        #: the layer inputs stored before each row's last output (what an msd3 head reads)
        stored = self.store.manifest.get("layers")
        #: what this head reads of them: an msd head (``layers`` None) takes each row's last output
        #: only, so one store made for msd3 trains both heads (one target pass, not two)
        self.layers = None if layers is None else stored
        if layers is None and stored:
            log.info("feature store %s also holds target layers %s: this head reads the last output only",
                     fc.path, stored)
        if layers is not None and stored != list(layers):
            raise FeatureStoreError(
                f"the feature store {fc.path} holds the inputs of target layers {stored or 'none'}, and the head "
                f"reads layers {list(layers)}; generate a store with features.layers={list(layers)} "
                f"(python scripts/generate_features.py features.path=NEW_DIR features.layers={list(layers)})")
        names = stage_splits(cfg)  # the splits this stage reads must match the store's
        diffs = manifest_differences(self.store.manifest, target_identity(target, cfg.target.adapter),
                                     data_fingerprint(cfg, names))
        if diffs:
            raise FeatureStoreError(
                f"the feature store {fc.path} does not match this configuration:\n  " + "\n  ".join(diffs)
                + "\nregenerate it (python scripts/generate_features.py features.path=NEW_DIR with the same "
                  "target and data overrides) or point features.path at a matching store")
        if self.store.manifest["target"]["name"] != target.name:
            log.info("feature store %s was made from %s; same weights as %s", fc.path,
                     self.store.manifest["target"]["name"], target.name)
        log.info("offline features: %s (%d samples, %s)", fc.path, len(self.store), self.store.manifest["dtype"])

    @torch.no_grad()
    def host(self, batch: dict) -> dict:
        """The store's rows for ``batch`` (CPU tensors), checked against its tokens: the padded
        hidden states, the visual embeddings in image-token order, stored M-RoPE ids."""
        target = self.target
        ids, attn = batch["input_ids"], batch["attention_mask"]
        B, L = ids.shape
        width = target.hidden_size * (1 + len(self.layers or []))
        hidden = torch.zeros(B, L, width, dtype=self.store.dtype)
        top = torch.full((B, L), -1, dtype=torch.long)  # -1: not stored (the loss computes it)
        visual, stored_pos = [], {}
        for i, key in enumerate(batch["keys"]):
            s = self.store.read(key)
            n = int(attn[i].sum())
            if len(s.input_ids) != n or not torch.equal(s.input_ids, ids[i, :n].cpu()):
                raise FeatureStoreError(
                    f"sample {key}: the token ids stored in {self.store.path} differ from this run's tokenisation "
                    f"({len(s.input_ids)} stored tokens, {n} now); the data, chat template or data.max_length "
                    f"changed since the store was generated: regenerate it")
            if "loss_mask" in batch and not torch.equal(s.loss_mask, batch["loss_mask"][i, :n].cpu().long()):
                raise FeatureStoreError(f"sample {key}: the stored loss mask differs from this run's; regenerate the store")
            P = len(s.prefix)
            hidden[i, :P] = s.prefix[..., -width:]
            hidden[i, P:P + len(s.rows)] = s.rows[..., -width:]
            if s.top is not None:
                top[i, :len(s.top)] = s.top
            # a shard without images stores its empty visual block at the rows' width (k+1 layers
            # wide in a store with layers); image rows are always the embedding's width
            visual.append(s.visual if len(s.visual) else s.visual.new_zeros(0, target.hidden_size))
            if s.position_ids is not None:
                stored_pos[i] = (s.position_ids, s.rope_delta)
        vis = torch.cat(visual)
        n_image = int((ids == target.image_token_id).sum())
        if n_image != len(vis):
            raise FeatureStoreError(f"batch {batch['keys']}: {n_image} image tokens but the store "
                                    f"holds {len(vis)} visual embeddings for these samples; regenerate the store")
        return {"hidden": hidden, "visual": vis, "stored_pos": stored_pos, "top": top}

    @torch.no_grad()
    def __call__(self, batch: dict) -> Features:
        target = self.target
        part = batch.get("offline") or self.host(batch)
        device = target.device
        nb = device.type == "cuda"  # from the loader's pinned memory: asynchronous copies
        ids = batch["input_ids"].to(device, non_blocking=nb)
        attn = batch["attention_mask"].to(device, non_blocking=nb)
        embeds = target.embed_tokens(ids)
        visual_mask = ids == target.image_token_id
        vis = part["visual"]
        if len(vis):
            embeds = embeds.masked_scatter(visual_mask.unsqueeze(-1).expand_as(embeds),
                                           vis.to(device, embeds.dtype, non_blocking=nb))
        pos, deltas = target.position_ids(ids, attn, {})
        for i, (p, d) in part["stored_pos"].items():
            n = p.shape[-1]
            pos[:, i, :n] = p.to(device, non_blocking=nb)
            deltas[i] = d
        rows = part["hidden"].to(device, target.dtype, non_blocking=nb)
        H = target.hidden_size
        top = part.get("top")
        top = None if top is None else top.to(device, non_blocking=nb)
        return Features(embeds, rows[..., -H:], visual_mask, pos, deltas, rows[..., :-H] if self.layers else None,
                        target_top=top)
