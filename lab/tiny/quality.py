"""The tiny target's quality bar (the numbers tests/lab_tools/test_tiny_target.py asserts): held-out
assistant-token cross-entropy, and the share of held-out single-image questions whose
greedy answer changes when the image is swapped for another."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import torch

from lab.tiny.model import collate, lm_loss, load_pixels
from lab.tiny.tokenizer import encode_item, encode_prompt, to_messages


@torch.no_grad()
def heldout_ce(model, processor, data_dir: Path) -> dict[str, float]:
    """Mean assistant-token cross-entropy (nats) on the held-out sets, per set and overall."""
    tok = processor.tokenizer
    image_token_id = model.config.image_token_id
    items = {"text": json.loads((data_dir / "sharegpt_heldout.json").read_text()),
             "image": json.loads((data_dir / "llava_heldout.json").read_text())}
    res, tot, tot_n = {}, 0.0, 0
    for name, data in items.items():
        encoded = []
        for item in data:
            messages, images = to_messages(item)
            ids, mask = encode_item(tok, image_token_id, messages, len(images))
            encoded.append({"ids": ids, "mask": mask, "images": images})
        pixels = load_pixels(processor, data_dir / "images", [p for e in encoded for p in e["images"]])
        s, n = 0.0, 0
        for i in range(0, len(encoded), 32):
            ce, k = lm_loss(model, *collate(encoded[i:i + 32], tok.pad_token_id, pixels), reduction="sum")
            s, n = s + float(ce), n + k
        res[name] = s / n
        tot, tot_n = tot + s, tot_n + n
    res["all"] = tot / tot_n
    return res


@torch.no_grad()
def greedy(model, ids: torch.Tensor, pv, max_new_tokens: int = 16) -> list[int]:
    out = model.generate(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None],
                         pixel_values=pv, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(ids):].tolist()


@torch.no_grad()
def image_swap_rate(model, processor, data_dir: Path, max_new_tokens: int = 16):
    """Share of held-out single-image questions whose greedy answer changes when the image
    is replaced with the next held-out question's image."""
    tok = processor.tokenizer
    items = [x for x in json.loads((data_dir / "llava_heldout.json").read_text())
             if x["category"] == "image_question"]
    pixels = load_pixels(processor, data_dir / "images", [x["image"] for x in items])
    changed, examples = 0, []
    for i, item in enumerate(items):
        other = items[(i + 1) % len(items)]["image"]
        messages, images = to_messages(item)
        ids = encode_prompt(tok, model.config.image_token_id, messages[:1], 1)
        a = tok.decode(greedy(model, ids, pixels[images[0]][None], max_new_tokens), skip_special_tokens=True)
        b = tok.decode(greedy(model, ids, pixels[other][None], max_new_tokens), skip_special_tokens=True)
        changed += a != b
        if len(examples) < 3:
            examples.append((messages[0]["content"], a, b))
    return changed / len(items), examples


def evaluate(out: Path, data_dir: Path) -> dict:
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    warnings.filterwarnings("ignore", message=".*torchvision.*")
    processor = AutoProcessor.from_pretrained(out)
    model = LlavaForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    ce = heldout_ce(model, processor, data_dir)
    bound = 0.5 * math.log(model.config.text_config.vocab_size)
    rate, examples = image_swap_rate(model, processor, data_dir)
    print(f"held-out assistant-token CE (nats): text {ce['text']:.3f}, image {ce['image']:.3f}, "
          f"all {ce['all']:.3f} (bar: <= 0.5*log(V) = {bound:.3f})")
    print(f"image-swap answer change rate: {rate:.3f} (bar: >= 0.8)")
    for q, a, b in examples:
        print(f"  {q!r}: {a!r} | swapped: {b!r}")
    return {"ce": ce, "ce_bound": bound, "swap_rate": rate}
