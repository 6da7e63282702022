"""A tiny Qwen2-VL target folder for experiments on the CPU (``lab/studies/draft_positions.py``).

A fully random Qwen2-VL gives near-uniform logits, so a draft head has little to learn and
position conventions barely show. This builder instead moves the *trained* language model
of the embedded tiny LLaVA (``data/tiny-llava``: Llama, 4 layers, hidden 256, trained on
``data/tiny``) into a ``Qwen2VLForConditionalGeneration``, whose text model is the same
architecture plus q/k/v biases (set to zero) and M-RoPE. With equal position rows M-RoPE
is plain RoPE, so on text the Qwen model computes what the LLaVA language model computes;
on and after an image its own M-RoPE positions apply. The vision tower and merger are
random (seeded): image tokens carry features the language model was not trained on, as
for any freshly attached encoder.

The folder is laid out as a Hub Qwen2-VL folder without the video processor (no
torchvision needed): ``load_target(DIR, chat_template="chatml_qwen")`` loads it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lab.targets.random import random_config, random_model
from msd_train.targets.chat import CHATML_QWEN, QWEN_SPECIALS


def save_tiny_qwen2vl(out_dir: str | Path, lm_from: str | Path, seed: int = 0, image_pixels: int = 48) -> Path:
    """Write a tiny Qwen2-VL folder to ``out_dir`` and return its path.

    Args:
        lm_from: a LLaVA folder (Llama language model) whose tokenizer and language model
            are reused, e.g. ``data/tiny-llava``.
        seed: seeds the vision tower, the merger and the embeddings of the added ChatML tokens.
        image_pixels: images are resized to at most ``image_pixels`` squared pixels
            (48: a 48x48 image gives a 6x6 grid of 36 image tokens).
    """
    from transformers import AutoTokenizer, LlavaForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    lm_from, out_dir = Path(lm_from), Path(out_dir)
    if not (lm_from / "config.json").is_file():
        raise FileNotFoundError(f"{lm_from} holds no config.json; pass a LLaVA folder such as data/tiny-llava")
    llava = LlavaForConditionalGeneration.from_pretrained(lm_from, dtype=torch.float32)
    lm_cfg = llava.config.text_config
    if lm_cfg.model_type != "llama":
        raise ValueError(f"{lm_from}: the language model is {lm_cfg.model_type!r}; this builder moves a Llama one")
    tok = AutoTokenizer.from_pretrained(lm_from)
    tok.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = CHATML_QWEN
    ids = {s: tok.convert_tokens_to_ids(s) for s in QWEN_SPECIALS}

    head_dim = lm_cfg.head_dim
    # M-RoPE splits the head's head_dim/2 frequencies into (temporal, height, width) parts,
    # in Qwen2-VL-7B's proportions (16, 24, 24 of 64) scaled to this head_dim.
    half = head_dim // 2
    section = [half // 2, half // 4, half - half // 2 - half // 4]
    text = dict(vocab_size=len(tok), hidden_size=lm_cfg.hidden_size, intermediate_size=lm_cfg.intermediate_size,
                num_hidden_layers=lm_cfg.num_hidden_layers, num_attention_heads=lm_cfg.num_attention_heads,
                num_key_value_heads=lm_cfg.num_key_value_heads, head_dim=head_dim,
                max_position_embeddings=lm_cfg.max_position_embeddings, rms_norm_eps=lm_cfg.rms_norm_eps,
                rope_parameters={"rope_type": "default", "rope_theta": lm_cfg.rope_parameters["rope_theta"],
                                 "mrope_section": section},
                eos_token_id=ids["<|im_end|>"], bos_token_id=None, pad_token_id=tok.pad_token_id)
    vision = dict(depth=2, embed_dim=64, hidden_size=lm_cfg.hidden_size, num_heads=4, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    cfg = random_config("qwen2_vl", text, vision, image_token_id=ids["<|image_pad|>"],
                        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    model = random_model(cfg, seed)

    src = llava.model.language_model.state_dict()
    n_old = src["embed_tokens.weight"].shape[0]
    with torch.no_grad():
        dst = model.model.language_model
        state = dst.state_dict()
        for key, value in src.items():
            if key == "embed_tokens.weight":
                state[key][:n_old] = value
                # the ChatML tokens: the mean embedding plus a little seeded noise, so they differ
                state[key][n_old:] = value.mean(0) + 0.02 * torch.randn(len(tok) - n_old, value.shape[1])
            else:
                state[key].copy_(value)
        for key in state:
            if key.endswith("_proj.bias"):  # Qwen2 has q/k/v biases, Llama none: zero keeps the maths
                state[key].zero_()
        dst.load_state_dict(state)
        lm_head = llava.lm_head.weight
        model.lm_head.weight[:n_old] = lm_head
        model.lm_head.weight[n_old:] = lm_head.mean(0)

    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    Qwen2VLImageProcessorPil(min_pixels=16 * 16, max_pixels=image_pixels * image_pixels, patch_size=4,
                             temporal_patch_size=2, merge_size=2).save_pretrained(out_dir)
    # as on the Hub, the preprocessor names the full processor (whose video half needs
    # torchvision; load_target falls back to tokenizer + image processor without it)
    pre = out_dir / "preprocessor_config.json"
    pre.write_text(json.dumps({**json.loads(pre.read_text()), "processor_class": "Qwen2VLProcessor"}, indent=2))
    return out_dir
