"""Random tiny targets built in-process for tests (no Hub access on test machines).

The trained tiny LLaVA under data/tiny-llava is the embedded default; these random
models (``lab.targets.random.random_target``, the one builder of every family)
exercise code paths it cannot (Qwen2-VL's M-RoPE, arbitrary shapes).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file

from lab.targets.random import random_target
from msd_train.targets import wrap_target

ROOT = Path(__file__).resolve().parents[2]  # the checkout
TINY_TARGET = ROOT / "data" / "tiny-llava"  # the embedded default
# the embedded default's held-out image questions, three of each category, one turn (the vLLM tests' benchmark)
TINY_IMAGE_BENCH = {"name": "tiny-images", "kind": "conversations", "group_by": "category", "max_samples": 3,
                    "max_turns": 1, "sources": [{"path": str(ROOT / "data/tiny/llava_heldout.json"),
                                                 "image_root": str(ROOT / "data/tiny/images")}]}


def random_image(seed: int, size: int = 32) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))


def wide_image(seed: int) -> Image.Image:
    """24 x 40 pixels: another aspect ratio (a 2x1 anyres tiling, a 3 x 5 Qwen grid of
    merged visual tokens: height and width differ)."""
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (24, 40, 3), dtype=np.uint8))


def image_prompts(target) -> dict:
    """Prompts with one image and with two of different shapes (decoding tests)."""
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    return {
        "one_image": target.encode_prompt([user("<image>\nwhat colour is the circle?")], [random_image(1, 32)]),
        "two_images": target.encode_prompt([user("<image>\n<image>\nthere are two red circle")],
                                           [wide_image(2), random_image(3, 24)]),
    }


def tiny_llava(seed: int = 0):
    """A random tiny LlavaForConditionalGeneration with a real processor (16 visual tokens)."""
    return random_target("llava", seed)


def tiny_qwen2vl(seed: int = 0):
    """A random tiny Qwen2VLForConditionalGeneration with M-RoPE and a real image processor."""
    return random_target("qwen2_vl", seed)


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
    return random_target("qwen2_5_vl", seed)


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


def model_inputs(target, ids: torch.Tensor, pixel: dict, attention_mask=None) -> dict:
    """What the model's own forward / generate takes for these ids and images."""
    kwargs = dict(pixel, input_ids=ids)
    if target.uses_mrope:
        kwargs["mm_token_type_ids"] = (ids == target.image_token_id).int()
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    return kwargs


def padded(encs) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Right-padded batch of ``Encoded``, pixel tensors concatenated in sample order."""
    L = max(len(e.input_ids) for e in encs)
    ids = torch.zeros(len(encs), L, dtype=torch.long)
    att = torch.zeros(len(encs), L, dtype=torch.long)
    for i, e in enumerate(encs):
        ids[i, : len(e.input_ids)] = e.input_ids
        att[i, : len(e.input_ids)] = 1
    pixel = {k: torch.cat([e.pixel[k] for e in encs]) for k in encs[0].pixel}
    return ids, att, pixel


def write_mini_data(root, n: int, n_heldout: int, image, words: tuple[int, int, int, int]) -> list[str]:
    """Text and image conversations of random words under ``root`` (train and held-out
    splits of each kind, images in ``root/img`` drawn by ``image(i)``), returned as the Hydra
    data overrides that read them. ``words``: words in the text question, text answer,
    image question, image answer."""
    import json
    import random

    from lab.targets.random import WORDS

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

CONV = [
    {"role": "user", "content": "<image>\nwhat colour is the shape"},
    {"role": "assistant", "content": "it is red"},
]


def merged_by_hand(base, adapter, processor):
    """The base model with every adapted weight replaced by W + B @ A * (lora_alpha / r)."""
    from transformers import LlavaForConditionalGeneration

    cfg = json.loads((adapter / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / cfg["r"]
    lora = load_file(adapter / "adapter_model.safetensors")
    model = LlavaForConditionalGeneration.from_pretrained(base, dtype=torch.float32).eval()
    merged = []
    with torch.no_grad():
        for key in sorted(k for k in lora if k.endswith(".lora_A.weight")):
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            A, B = lora[key], lora[key.replace(".lora_A.", ".lora_B.")]
            weight = model.get_submodule(module).weight
            weight.copy_(weight + (B @ A) * scale)
            merged.append(module)
    return wrap_target(model, processor, "by-hand"), merged
