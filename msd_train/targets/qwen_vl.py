"""Qwen2-VL and Qwen2.5-VL: M-RoPE positions computed by the model's own rope index."""

from __future__ import annotations

import torch

from msd_train.targets.base import Target


class QwenVLTarget(Target):
    family = "qwen2_vl"

    def __init__(self, model, processor, name, chat_template):
        super().__init__(model, processor, name, chat_template)
        self.image_text = processor.image_token  # "<|image_pad|>"
        start = getattr(processor, "vision_start_token", "<|vision_start|>")
        end = getattr(processor, "vision_end_token", "<|vision_end|>")
        self.image_prompt_text = f"{start}{self.image_text}{end}"

    def add_bos(self) -> bool:
        return False  # ChatML has no BOS

    @property
    def end_of_turn(self) -> str:
        return "<|im_end|>"

    @property
    def merge_size(self) -> int:
        return self.config.vision_config.spatial_merge_size

    def image_inputs(self, images):
        out = self.processor.image_processor(images=images, return_tensors="pt")
        grid = out["image_grid_thw"]
        counts = (grid.prod(-1) // self.merge_size**2).tolist()
        return {"pixel_values": out["pixel_values"], "image_grid_thw": grid}, counts

    def image_grids(self, pixel):
        """From ``image_grid_thw``: (h, w) patches merged ``merge_size``-fold per axis."""
        grids = []
        for t, h, w in (pixel.get("image_grid_thw").tolist() if pixel else []):
            if t != 1:
                raise ValueError(f"an image grid with {t} frames (a video?): only still images have a 2-D grid")
            grids.append((h // self.merge_size, w // self.merge_size))
        return grids

    def visual_embeddings(self, pixel):
        out = self.model.model.get_image_features(
            pixel["pixel_values"].to(self.device, self.dtype),
            pixel["image_grid_thw"].to(self.device),
            return_dict=True,
        )
        return torch.cat(list(out.pooler_output), dim=0)

    def position_ids(self, input_ids, attention_mask, pixel):
        """M-RoPE positions from the model's own ``get_rope_index``, computed with the image."""
        pixel = pixel or {}
        types = (input_ids == self.image_token_id).int()
        grid = pixel.get("image_grid_thw")
        kwargs = {}
        if "second_per_grid_ts" in pixel:  # Qwen2.5-VL video timing; still images have none
            kwargs["second_per_grid_ts"] = pixel["second_per_grid_ts"]
        if grid is None:  # text only: all three axes are the plain 1-D positions
            if attention_mask is None:
                pos = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
            else:
                pos = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
            return pos.unsqueeze(0).expand(3, -1, -1).contiguous(), torch.zeros(
                input_ids.shape[0], dtype=torch.long, device=input_ids.device
            )
        pos, deltas = self.model.model.get_rope_index(
            input_ids, mm_token_type_ids=types, image_grid_thw=grid.to(input_ids.device),
            attention_mask=attention_mask, **kwargs,
        )
        return pos, deltas.reshape(-1)

    def continue_positions(self, start, n, rope_deltas):
        pos = torch.arange(start, start + n, device=self.device).unsqueeze(0)
        if rope_deltas is not None:
            pos = pos + rope_deltas.to(self.device).reshape(-1, 1)
        return pos.unsqueeze(0).expand(3, -1, -1)
