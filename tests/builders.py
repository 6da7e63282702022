"""Random tiny targets built in-process for tests (no Hub access on test machines).

The trained tiny LLaVA under data/tiny-llava is the embedded default; these random
models exercise code paths it cannot (Qwen2-VL's M-RoPE, arbitrary shapes).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from PIL import Image

from msd_train.targets import wrap_target
from msd_train.targets.chat import CHATML_QWEN, QWEN_SPECIALS, VICUNA_V1
from msd_train.targets.random import char_tokenizer


def random_image(seed: int, size: int = 32) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))


def tiny_llava(seed: int = 0):
    """A random tiny LlavaForConditionalGeneration with a real processor (16 visual tokens)."""
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tok = char_tokenizer(["<unk>", "<s>", "</s>", "<image>"], "<s>", "</s>", VICUNA_V1)
    image_token_id = tok.convert_tokens_to_ids("<image>")
    text = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=0)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, image_size=16, patch_size=4, projection_dim=32)
    cfg = LlavaConfig(text_config=text, vision_config=vision, image_token_id=image_token_id,
                      vision_feature_layer=-2, vision_feature_select_strategy="default")
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg).eval()
    improc = CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    proc = LlavaProcessor(image_processor=improc, tokenizer=tok, patch_size=4,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          chat_template=VICUNA_V1)
    return model, proc


def _tiny_qwen(config_class, model_class, vision: dict, seed: int):
    """A random tiny Qwen-VL of ``model_class``: M-RoPE text model, the given vision tower,
    and the processor pieces the adapter reads (``Qwen2VLProcessor`` itself insists on a
    torchvision video processor; a namespace stands in for it here)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    specials = ["<unk>", *QWEN_SPECIALS]
    tok = char_tokenizer(specials, None, "<|im_end|>", CHATML_QWEN)
    ids = {s: tok.convert_tokens_to_ids(s) for s in specials}
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
                eos_token_id=ids["<|im_end|>"], bos_token_id=None, pad_token_id=0)
    cfg = config_class(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                       video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                       vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(seed)
    model = model_class(cfg).eval()
    improc = Qwen2VLImageProcessorPil(min_pixels=16 * 16, max_pixels=32 * 32, patch_size=4,
                                      temporal_patch_size=2, merge_size=2)
    return model, SimpleNamespace(image_processor=improc, tokenizer=tok, image_token="<|image_pad|>")


def tiny_qwen2vl(seed: int = 0):
    """A random tiny Qwen2VLForConditionalGeneration with M-RoPE and a real image processor."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    vision = dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    return _tiny_qwen(Qwen2VLConfig, Qwen2VLForConditionalGeneration, vision, seed)


def tiny_llava_target(seed: int = 0):
    model, proc = tiny_llava(seed)
    return wrap_target(model, proc, "tiny-random-llava")


def tiny_qwen2vl_target(seed: int = 0):
    model, proc = tiny_qwen2vl(seed)
    return wrap_target(model, proc, "tiny-random-qwen2vl")


def tiny_qwen25vl(seed: int = 0):
    """A random tiny Qwen2_5_VLForConditionalGeneration: M-RoPE text model and the
    window-attention vision tower (a window of 2x2 merged tokens, so a 32-pixel image's
    4x4 grid spans four windows; block 0 attends within windows, block 1 to the whole image)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    # window_size is in pixels: 16 px = 2 merged tokens of 2x2 patches of 4 px
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3, out_hidden_size=32,
                  window_size=16, fullatt_block_indexes=[1], tokens_per_second=2)
    return _tiny_qwen(Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, vision, seed)


def tiny_qwen25vl_target(seed: int = 0):
    model, proc = tiny_qwen25vl(seed)
    return wrap_target(model, proc, "tiny-random-qwen25vl")


def fit_head(head, target, batch, steps: int, lr: float = 3e-3):
    """Fit ``head`` to the target's own next tokens: ``batch`` holds (``head.target_inputs``
    of a target pass, the target's argmax after each position). A few hundred Adam steps
    give trees that accept several tokens, which the exactness tests need to be meaningful."""
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    for _ in range(steps):
        loss = sum(torch.nn.functional.cross_entropy(target.lm_head(head(**inputs).last_hidden_state[0]), y)
                   for inputs, y in batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval().requires_grad_(False)


def write_mini_data(root, n: int, n_heldout: int, image, words: tuple[int, int, int, int]) -> list[str]:
    """Text and image conversations of random words under ``root`` (train and held-out
    splits of each kind, images in ``root/img`` drawn by ``image(i)``), returned as the Hydra
    data overrides that read them. ``words``: words in the text question, text answer,
    image question, image answer."""
    import json
    import random

    from msd_train.targets.random import WORDS

    rng = random.Random(0)
    img = root / "img"
    img.mkdir()

    def say(k):
        return " ".join(rng.choices(WORDS, k=k))

    tq, ta, iq, ia = words
    text = [{"id": i, "conversations": [{"from": "human", "value": say(tq)}, {"from": "gpt", "value": say(ta)}]}
            for i in range(n)]
    mm = []
    for i in range(n):
        image(i).save(img / f"{i}.png")
        mm.append({"id": f"m{i}", "image": f"{i}.png",
                   "conversations": [{"from": "human", "value": "<image>\n" + say(iq)}, {"from": "gpt", "value": say(ia)}]})
    train = n - n_heldout
    for name, recs in {"t": text[:train], "th": text[train:], "m": mm[:train], "mh": mm[train:]}.items():
        (root / f"{name}.json").write_text(json.dumps(recs))
    return [f"data.text.0.path={root / 't.json'}", f"data.heldout_text.0.path={root / 'th.json'}",
            f"data.multimodal.0.path={root / 'm.json'}", f"data.multimodal.0.image_root={img}",
            f"data.heldout_multimodal.0.path={root / 'mh.json'}", f"data.heldout_multimodal.0.image_root={img}",
            f"data.cache_dir={root / 'cache'}"]
