"""Rows of a tokenised split -> a padded batch with the target's pixel inputs."""

from __future__ import annotations

import torch

from msd_train.data.dataset import load_images


def collate(rows: list[dict], target, pad_id: int = 0) -> dict:
    """Right-pad ``input_ids``/``loss_mask``; load images and run the image processor.

    Pixel tensors of all images of the batch are concatenated in sample order, which is
    the order the target's forward fills the image slots in.
    """
    length = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    loss = torch.zeros((len(rows), length), dtype=torch.long)
    attn = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"])
        loss[i, :n] = torch.tensor(r["loss_mask"])
        attn[i, :n] = 1
    images = [im for r in rows for im in load_images(r["images"])]
    pixel: dict[str, torch.Tensor] = {}
    if images:
        pixel, _ = target.image_inputs(images)
    return {"input_ids": ids, "loss_mask": loss, "attention_mask": attn, "pixel": pixel,
            "ids": [r["id"] for r in rows], "n_images": len(images)}
