"""Rows of a tokenised split -> a padded batch with the target's pixel inputs."""

from __future__ import annotations

from pathlib import Path

import torch

from msd_train.data.dataset import load_images


def sample_key(row: dict) -> str:
    """A stable name for a sample: its file's name and its position in that file."""
    return f"{Path(row['source']).name}#{row['index']}"


def collate(rows: list[dict], target, pad_id: int = 0, pixels: bool = True) -> dict:
    """Right-pad ``input_ids``/``loss_mask``; load images and run the image processor.

    Pixel tensors of all images of the batch are concatenated in sample order, which is
    the order the target's forward fills the image slots in. ``pixels=False`` skips the
    images (a feature store already holds their embeddings).
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
    images = [im for r in rows for im in load_images(r["images"])] if pixels else []
    pixel: dict[str, torch.Tensor] = {}
    if images:
        pixel, _ = target.image_inputs(images)
    return {"input_ids": ids, "loss_mask": loss, "attention_mask": attn, "pixel": pixel,
            "ids": [r["id"] for r in rows], "keys": [sample_key(r) for r in rows],
            "n_images": sum(len(r["images"]) for r in rows)}
