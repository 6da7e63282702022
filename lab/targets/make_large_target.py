"""Write a random target of a real model's shape as an ordinary model folder.

    python -m lab.targets.make_large_target OUT_DIR                       # LLaVA-1.5-7B shape, bf16
    python -m lab.targets.make_large_target OUT_DIR --shape llava15_13b
    python -m lab.targets.make_large_target OUT_DIR --shape qwen2vl_7b
    python -m lab.targets.make_large_target OUT_DIR --layers 1 --scale small   # CPU-sized check

then ``train.py target.name_or_path=OUT_DIR`` / ``eval.py target.name_or_path=OUT_DIR``
(unchanged) load it like a downloaded checkpoint. For throughput work: timings do not
depend on weight values, and no Hub access is needed anywhere.

Shapes (the published ``config.json`` of each model):

- ``llava15_7b``: ``LlavaForConditionalGeneration``, Llama 32 x 4096, intermediate 11008,
  32 heads, vocabulary 32064; CLIP ViT-L/14 at 336 px (24 layers x 1024), 576 visual tokens.
- ``llava15_13b``: the same with Llama 40 x 5120, intermediate 13824, 40 heads.
- ``qwen2vl_7b``: ``Qwen2VLForConditionalGeneration``, Qwen2 28 x 3584, intermediate 18944,
  28 heads / 4 KV heads, vocabulary 152064; ViT 32 x 1280 with 2x2 merge (a 336x336 image
  gives 144 visual tokens).

``--scale small`` divides every width by 16 (heads by 8) and keeps the vocabulary, the
image size and the visual token count; ``--layers N`` sets the depth of both towers.

Tokenizer: the embedded tiny target's (``data/tiny-llava``: character level, its chat
template), padded with added tokens ``<|t12345|>`` up to the vocabulary size, so every id
the random model can emit decodes. Qwen's chat-template tokens are added as special tokens.

Weights are created on ``--device`` directly in ``--dtype`` (bf16 by default): no fp32 copy
and no CPU round trip of a 7B model before saving.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

from lab.cli import at_least
from msd_train.targets import chat, target_shapes

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "data" / "tiny-llava"

# The published shapes of the families this script builds, from their adapters (msd_train/targets).
SHAPES = {name: {"family": sh["family"], "text": sh["text"], "vision": sh["vision"]}
          for name, sh in target_shapes().items() if sh["family"] in ("llava", "qwen2_vl")}
QWEN_SPECIALS = ["<|endoftext|>", *chat.QWEN_SPECIALS]
QWEN_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def scaled(shape: dict, scale: str, layers: int | None) -> dict:
    """The shape at ``scale`` (``full`` or ``small``: widths / 16, heads / 8) and depth ``layers``."""
    s = copy.deepcopy(shape)
    t, v = s["text"], s["vision"]
    if scale == "small":
        # Text: 256 wide, 4 heads of 64 (half the KV heads where the shape has grouped queries),
        # the shape's MLP ratio.
        ratio = t["intermediate_size"] / t["hidden_size"]
        gqa = t["num_key_value_heads"] < t["num_attention_heads"]
        t.update(hidden_size=256, intermediate_size=int(256 * ratio) // 8 * 8, num_attention_heads=4,
                 num_key_value_heads=2 if gqa else 4)
        if s["family"] == "llava":
            for k in ("hidden_size", "intermediate_size", "projection_dim"):
                v[k] //= 16
            v["num_attention_heads"] = max(v["num_attention_heads"] // 8, 1)
        else:
            v["embed_dim"] //= 16
            v["num_heads"] = max(v["num_heads"] // 8, 1)
            v["hidden_size"] = t["hidden_size"]
            # M-RoPE sections sum to head_dim / 2 = 32, in the shape's 16:24:24 proportion
            t["rope_parameters"] = {**t["rope_parameters"], "mrope_section": [8, 12, 12]}
    elif scale != "full":
        raise SystemExit(f"--scale {scale}: use full or small")
    if layers is not None:
        t["num_hidden_layers"] = layers
        # LLaVA reads the second-to-last vision layer: keep at least two.
        v["num_hidden_layers" if s["family"] == "llava" else "depth"] = max(layers, 2)
    return s


def padded_tokenizer(vocab_size: int, specials: list[str] = ()):
    """The tiny target's tokenizer with added tokens up to ``vocab_size`` ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY)
    if specials:
        tok.add_special_tokens({"additional_special_tokens": list(specials)})
    n = len(tok)
    if n > vocab_size:
        raise SystemExit(f"the tiny tokenizer has {n} tokens, more than the vocabulary of {vocab_size}")
    tok.add_tokens([f"<|t{i}|>" for i in range(n, vocab_size)])
    assert len(tok) == vocab_size, (len(tok), vocab_size)
    return tok


def build_config(s: dict, tok):
    from lab.targets.random import random_config

    if s["family"] == "llava":
        text = dict(s["text"], bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                    pad_token_id=tok.pad_token_id)
        n_vis = (s["vision"]["image_size"] // s["vision"]["patch_size"]) ** 2
        return random_config("llava", text, s["vision"], image_token_id=tok.convert_tokens_to_ids("<image>"),
                             projector_hidden_act="gelu", image_seq_length=n_vis, pad_token_id=tok.pad_token_id,
                             tie_word_embeddings=False)
    ids = {name: tok.convert_tokens_to_ids(name) for name in QWEN_SPECIALS}
    text = dict(s["text"], model_type="qwen2_vl_text", bos_token_id=ids["<|endoftext|>"],
                eos_token_id=ids["<|im_end|>"], tie_word_embeddings=False)
    return random_config("qwen2_vl", text, s["vision"], image_token_id=ids["<|image_pad|>"],
                         video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                         vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)


def save_processor(s: dict, tok, out: Path) -> None:
    if s["family"] == "llava":
        from transformers import AutoProcessor

        proc = AutoProcessor.from_pretrained(TINY)  # the tiny target's chat template and CLIP preprocessing
        side = s["vision"]["image_size"]
        proc.image_processor.size = {"shortest_edge": side}
        proc.image_processor.crop_size = {"height": side, "width": side}
        proc.patch_size = s["vision"]["patch_size"]
        proc.tokenizer = tok
        proc.save_pretrained(out)
        return
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok.chat_template = QWEN_TEMPLATE
    tok.save_pretrained(out)
    # Images are resized to 336x336: 24x24 patches, 144 visual tokens after the 2x2 merge.
    side = 336
    Qwen2VLImageProcessorPil(min_pixels=side * side, max_pixels=side * side).save_pretrained(out)
    (out / "chat_template.jinja").write_text(QWEN_TEMPLATE)


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llava15_7b")
    ap.add_argument("--scale", default="full", help="full (the published shape) or small (CPU checks)")
    ap.add_argument("--layers", type=at_least(1), default=None, help="depth of both towers (default: the shape's)")
    ap.add_argument("--device", default="auto", help="where the weights are generated (auto: cuda if present)")
    ap.add_argument("--dtype", default="bf16", help="bf16 (default), fp16 or fp32")
    ap.add_argument("--seed", type=at_least(0), default=0)
    args = ap.parse_args(argv)

    from lab.targets.random import random_model
    from msd_train.runtime import pick_device, resolve_dtype

    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty; choose a new folder")
    s = scaled(SHAPES[args.shape], args.scale, args.layers)
    device, dtype = torch.device(pick_device(args.device)), resolve_dtype(args.dtype, "cpu")
    t0 = time.time()
    tok = padded_tokenizer(s["text"]["vocab_size"], QWEN_SPECIALS if s["family"] == "qwen2_vl" else ())
    config = build_config(s, tok)
    # Made on the device in the target dtype: a 7B model never exists in fp32 or on the host
    # before save_pretrained streams it out tensor by tensor.
    model = random_model(config, args.seed, device=device, dtype=dtype)
    n = sum(p.numel() for p in model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    save_processor(s, tok, out)
    info = {"shape": args.shape, "scale": args.scale, "layers": args.layers, "dtype": str(dtype).replace("torch.", ""),
            "params": n, "weights": "random (transformers' initialisation)", "seed": args.seed,
            "tokenizer": "data/tiny-llava's, padded with added tokens to the vocabulary size",
            "command": "python -m lab.targets.make_large_target " + " ".join(sys.argv[1:] if argv is None else argv)}
    (out / "msd_shape.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"wrote {out}: {args.shape} ({args.scale}, {n / 1e9:.2f} B parameters, {info['dtype']}) "
          f"in {time.time() - t0:.0f} s")
    return out


if __name__ == "__main__":
    from msd_train.errors import run_main

    run_main(main)  # a known failure (a missing path, a full disk, Ctrl-C): one line, exit non-zero
