"""LLaVA family (llava-hf format): CLIP vision tower, MLP projector, Llama language model.

``LlavaTarget``: LLaVA-1.5, a fixed number of visual tokens per image (one square patch
grid). ``LlavaNextTarget``: LLaVA-NeXT (v1.6), anyres tiling, so the number of visual
tokens varies with each image's size and aspect ratio, and an image-newline embedding ends
every row of the tiled grid.
"""

from __future__ import annotations

import torch

from msd_train.targets.base import Target

# Published shapes (the checkpoints' config.json sizes, transformers' config keywords):
# Llama-2 text models with the llava-hf vocabulary (32000 + <image> + padding), CLIP ViT-L/14-336.
_LLAMA_7B = dict(vocab_size=32064, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5)
_LLAMA_13B = dict(_LLAMA_7B, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                  num_key_value_heads=40)
CLIP_L_336 = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                  image_size=336, patch_size=14, projection_dim=768, hidden_act="quick_gelu", layer_norm_eps=1e-5)


class LlavaTarget(Target):
    family = "llava"
    model_types = ("llava",)
    text_model_types = ("llama",)
    draft_layer_family = "llama"
    display_name = "LLaVA"
    hub_tags = ("llava",)
    reference_model_type = "llava"
    vocab_appended = True  # llava-hf: <image> and padding after Vicuna's 32000 tokens
    published_targets = {4096: ("llava-hf/llava-1.5-7b-hf", 32064), 5120: ("llava-hf/llava-1.5-13b-hf", 32064)}
    #: visual: tokens per image (336 px, patch 14: 24 x 24)
    shapes = {"llava15_7b": dict(text=_LLAMA_7B, vision=CLIP_L_336, image_side=336, visual=576),
              "llava15_13b": dict(text=_LLAMA_13B, vision=CLIP_L_336, image_side=336, visual=576)}

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

    def image_token_counts(self, sizes):
        return [self.tokens_per_image] * len(sizes)

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


class LlavaNextTarget(LlavaTarget):
    """LLaVA-NeXT: per image, the base tile's grid, then the anyres tiles' grid with its
    padding removed and an image-newline embedding closing each row; the count depends on
    the image's size (the processor's own count, checked against the tower in ``embed``)."""

    family = "llava_next"
    model_types = ("llava_next",)
    display_name = "LLaVA-NeXT"
    hub_tags = ("llava-next",)
    reference_model_type = None  # no MSD heads were released in the original layout
    published_targets = {}
    #: visual: tokens of a 672 x 672 image (576 base + 48 rows x (48 + 1 newline))
    shapes = {"llava16_7b": dict(text=_LLAMA_7B, vision=CLIP_L_336, image_side=672, visual=576 + 48 * 49,
                                 image_grid_pinpoints=[[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]])}

    @property
    def tokens_per_image(self) -> int:
        raise ValueError(f"{self.name}: a LLaVA-NeXT image has no fixed token count (anyres tiling); "
                         "image_inputs gives each image's")

    def image_grids(self, pixel):
        raise ValueError(f"{self.name}: a LLaVA-NeXT image's tokens are a base grid plus unpadded tiles with "
                         "newline tokens, not one grid; decoding.variants P and C need one grid per image")

    def image_token_counts(self, sizes):
        # the processor's own count from (height, width), as image_inputs uses it
        return list(self.processor._get_num_multimodal_tokens(image_sizes=[(h, w) for w, h in sizes]).num_image_tokens)

    def image_inputs(self, images):
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        out = self.processor.image_processor(images=images, return_tensors="pt")
        sizes = out["image_sizes"]
        # The processor pads every image to the most tiles in the call; keeping each image's
        # own tiles (4-D, as the tower also takes them) lets batches concatenate images
        # processed in different calls.
        tiles = [image_size_to_num_patches(s.tolist(), self.config.image_grid_pinpoints,
                                           self.config.vision_config.image_size) for s in sizes]
        pixel_values = torch.cat([pv[:n] for pv, n in zip(out["pixel_values"], tiles)])
        counts = self.processor._get_num_multimodal_tokens(image_sizes=sizes.tolist()).num_image_tokens
        return {"pixel_values": pixel_values, "image_sizes": sizes}, list(counts)

    def visual_embeddings(self, pixel):
        out = self.model.model.get_image_features(
            pixel_values=pixel["pixel_values"].to(self.device, self.dtype),
            image_sizes=pixel["image_sizes"].to(self.device), return_dict=True,
        )
        return torch.cat(list(out.pooler_output), dim=0)
