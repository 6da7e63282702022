"""LLaVA family (llava-hf format): CLIP vision tower, MLP projector, Llama language model."""

from __future__ import annotations

import torch

from msd_train.targets.base import Target


class LlavaTarget(Target):
    family = "llava"

    def __init__(self, model, processor, name, chat_template):
        super().__init__(model, processor, name, chat_template)
        self.image_text = processor.image_token
        self.image_prompt_text = processor.image_token

    @property
    def tokens_per_image(self) -> int:
        """Visual tokens per image, from the vision config (576 for LLaVA-1.5 at 336 px)."""
        vc = self.config.vision_config
        n = (vc.image_size // vc.patch_size) ** 2
        if self.config.vision_feature_select_strategy == "full":
            n += 1  # the CLS token is kept
        return n

    @property
    def patch_grid(self) -> tuple[int, int]:
        side = self.config.vision_config.image_size // self.config.vision_config.patch_size
        return side, side

    def image_grids(self, pixel):
        return [self.patch_grid] * (pixel["pixel_values"].shape[0] if pixel else 0)

    def image_inputs(self, images):
        pixel = self.processor.image_processor(images=images, return_tensors="pt")
        return {"pixel_values": pixel["pixel_values"]}, [self.tokens_per_image] * len(images)

    def visual_embeddings(self, pixel):
        out = self.model.model.get_image_features(
            pixel_values=pixel["pixel_values"].to(self.device, self.dtype), return_dict=True
        )
        return torch.cat(list(out.pooler_output), dim=0)

    def position_ids(self, input_ids, attention_mask, pixel):
        if attention_mask is None:
            pos = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        else:  # right padding: real tokens count from 0, pads get 0
            pos = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        return pos, None
