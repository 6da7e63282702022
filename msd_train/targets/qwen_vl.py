"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: M-RoPE positions computed by the model's own rope index."""

from __future__ import annotations

import logging

import torch

from msd_train.targets.base import Target, eagle3_layers

log = logging.getLogger(__name__)

# Published shapes (the checkpoints' config.json sizes, transformers' config keywords).
_QWEN2_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                 num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]})
_QWEN2_VISION = dict(depth=32, embed_dim=1280, hidden_size=3584, num_heads=16, mlp_ratio=4, patch_size=14,
                     spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
_QWEN25_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, in_channels=3, out_hidden_size=3584,
                      window_size=112, fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2)


class QwenVLTarget(Target):
    family = "qwen2_vl"
    model_types = ("qwen2_vl",)
    text_model_types = ("qwen2_vl_text", "qwen2")
    draft_layer_family = "qwen2"
    uses_mrope = True
    display_name = "Qwen2-VL"
    hub_tags = ("qwen2-vl",)
    reference_model_type = "qwen2_vl"
    published_targets = {3584: ("Qwen/Qwen2-VL-7B-Instruct", 152064)}
    #: visual: tokens of a 672 x 672 image (patch 14, 2x2 merge: 24 x 24)
    shapes = {"qwen2vl_7b": dict(text=_QWEN2_7B, vision=_QWEN2_VISION, image_side=672, visual=576)}

    def __init__(self, model, processor, name, chat_template):
        super().__init__(model, processor, name, chat_template)
        self.image_text = processor.image_token  # "<|image_pad|>"
        start = getattr(processor, "vision_start_token", "<|vision_start|>")
        end = getattr(processor, "vision_end_token", "<|vision_end|>")
        self.image_prompt_text = f"{start}{self.image_text}{end}"

    @classmethod
    def load_processor(cls, name_or_path, trust_remote_code=False):
        """The processor; without torchvision, the tokenizer and the PIL image processor.

        The Qwen-VL processors insist on building their video processor, which needs
        torchvision, although image prompts never touch it: without torchvision the adapter
        gets what it reads, so torchvision stays optional.
        """
        try:
            return super().load_processor(name_or_path, trust_remote_code)
        except ImportError as e:
            if "orchvision" not in str(e):
                raise
        from types import SimpleNamespace

        from transformers import AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        log.info("torchvision is not installed: %s gets its tokenizer and the PIL image processor "
                 "(no video processor; image prompts need none)", name_or_path)
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
        return SimpleNamespace(tokenizer=tokenizer, image_processor=Qwen2VLImageProcessorPil.from_pretrained(name_or_path),
                               image_token=getattr(tokenizer, "image_token", None) or "<|image_pad|>")

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

    def image_token_counts(self, sizes):
        # the image processor's own patch arithmetic (smart_resize to its pixel bounds)
        ip = self.processor.image_processor
        return [ip.get_number_of_image_patches(h, w, {}) // self.merge_size**2 for w, h in sizes]

    def image_grids(self, pixel):
        """From ``image_grid_thw``: (h, w) patches merged ``merge_size``-fold per axis."""
        grids = []
        for t, h, w in (pixel.get("image_grid_thw").tolist() if pixel else []):
            if t != 1:
                raise ValueError(f"an image grid with {t} frames (a video?): only still images have a 2-D grid")
            grids.append((h // self.merge_size, w // self.merge_size))
        return grids

    def _image_features(self, pixel):
        return self.model.model.get_image_features(
            pixel["pixel_values"].to(self.device, self.dtype),
            pixel["image_grid_thw"].to(self.device),
            return_dict=True,
        )

    def visual_embeddings(self, pixel):
        return torch.cat(list(self._image_features(pixel).pooler_output), dim=0)

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


class Qwen25VLTarget(QwenVLTarget):
    """Qwen2.5-VL: Qwen2-VL's text model and positions; a window-attention vision tower."""

    # the same family as Qwen2-VL: feature stores made before the families were told apart
    # recorded "qwen2_vl", and every fact a store depends on is the same
    family = "qwen2_vl"
    model_types = ("qwen2_5_vl",)
    text_model_types = ("qwen2_5_vl_text",)
    display_name = "Qwen2.5-VL"
    hub_tags = ("qwen2.5-vl",)
    reference_model_type = "qwen2_5_vl"  # the released layout's config.json may name either
    published_targets = {}  # the released Qwen heads are Qwen2-VL's
    shapes = {"qwen25vl_7b": dict(text=_QWEN2_7B, vision=_QWEN25_VISION, image_side=672, visual=576)}


class Qwen3VLTarget(QwenVLTarget):
    """Qwen3-VL: interleaved M-RoPE, and deepstack: the vision tower's merger outputs of a
    few intermediate vision blocks are added at the image positions to the outputs of the
    first text layers (one per ``vision_config.deepstack_visual_indexes`` entry).

    A forward over a prompt with images passes those features (``prompt_inputs``);
    verification forwards hold no image tokens and need none. The draft head is a
    ``qwen2`` layer with sectioned M-RoPE over the same position ids: the head's own rotary
    layout, trained from scratch, need not be the target's interleaved one.
    """

    family = "qwen3_vl"
    model_types = ("qwen3_vl",)
    text_model_types = ("qwen3_vl_text",)
    display_name = "Qwen3-VL"
    hub_tags = ("qwen3-vl",)
    reference_model_type = None
    published_targets = {}
    # tested on 5.19 and 5.24; 5.6 (the project's floor) adds the deepstack features with
    # other shapes and its forward fails on them
    min_transformers = "5.19"
    #: Qwen3-VL-8B: Qwen3 36 x 4096, head_dim 128; visual: a 768 x 768 image (patch 16, 2x2 merge)
    shapes = {"qwen3vl_8b": dict(
        text=dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                  rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                                      "mrope_section": [24, 20, 20], "mrope_interleaved": True}),
        vision=dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                    spatial_merge_size=2, temporal_patch_size=2, in_channels=3, out_hidden_size=4096,
                    num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24]),
        image_side=768, visual=576)}

    @classmethod
    def mrope_section_of(cls, text_config):
        # Qwen3VLTextRotaryEmbedding's default when the config names none
        return super().mrope_section_of(text_config) or [24, 20, 20]

    @classmethod
    def default_feature_layers(cls, config):
        """EAGLE-3's 2, N/2, N-3 with the low layer moved past deepstack: k+1 for k injections.

        ``hidden_states[i]`` (i >= 1) is text layer i-1's output as transformers records
        it, before that layer's deepstack addition; the first one whose image positions have
        been through every injection is the output of layer k (index k+1). Earlier states
        carry the image only partly: a head reading them sees the picture the target's later
        layers no longer see. Qwen3-VL-8B (36 layers, 3 injections): [4, 18, 33].
        """
        n = config.get_text_config(decoder=True).num_hidden_layers
        # a text config alone does not say: Qwen3-VL's published models inject 3
        k = len(config.vision_config.deepstack_visual_indexes or []) if hasattr(config, "vision_config") else 3
        return eagle3_layers(n, low=max(2, k + 1))

    def prompt_inputs(self, input_ids, pixel=None):
        if not pixel:
            return self.embed_tokens(input_ids), {}
        out = self._image_features(pixel)
        embeds = self.embed_tokens(input_ids)
        visual = torch.cat(list(out.pooler_output), dim=0).to(embeds.dtype)
        mask = input_ids == self.image_token_id
        if int(mask.sum()) != visual.shape[0]:
            raise ValueError(f"{int(mask.sum())} image tokens in the ids but the vision tower "
                             f"produced {visual.shape[0]} visual embeddings")
        embeds = embeds.masked_scatter(mask.unsqueeze(-1).expand_as(embeds), visual)
        deepstack = [torch.cat(list(f), dim=0).to(embeds.dtype) for f in out.deepstack_features]
        return embeds, {"visual_pos_masks": mask, "deepstack_visual_embeds": deepstack}
