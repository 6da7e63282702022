"""The one builder of randomly initialised targets (tests, benchmarks of published shapes):
nothing here downloads anything.

:func:`random_config` and :func:`random_model` build a random model of every supported family
(``FAMILY_NAMES``) from text and vision settings, on a device and in a dtype when asked (a
7B model never exists in fp32 on the host); :func:`random_target` adds the tiny defaults
(hidden 32, two layers, 16 px image tiles: a CPU runs every family's forward in
milliseconds) and the offline processor its adapter reads; :func:`save_random_target` lays one
out as a Hub folder that ``load_target`` loads.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from msd_train.targets.chat import CHATML_QWEN, QWEN_SPECIALS, VICUNA_V1

WORDS = (
    "the a an is are what colour shape red green blue circle square how many image "
    "describe this that there one two three four it of and in on to you assistant user "
    "system helpful hello world python function returns value"
).split()

#: the families :func:`random_target` builds: the names the contract test runs
FAMILY_NAMES = ("llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def _classes(family: str):
    """(composite config class, model class) of ``family``."""
    import transformers as tf

    names = {"llava": ("LlavaConfig", "LlavaForConditionalGeneration"),
             "llava_next": ("LlavaNextConfig", "LlavaNextForConditionalGeneration"),
             "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration"),
             "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
             "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration")}
    if family not in names:
        raise ValueError(f"no random builder for family {family!r}; known: {', '.join(FAMILY_NAMES)}")
    return tuple(getattr(tf, n) for n in names[family])


def random_config(family: str, text: dict, vision: dict, **top):
    """The composite config of ``family`` from exactly these text and vision settings; ``top``
    are its own entries (token ids, ``tie_word_embeddings``...). LLaVA families read the
    second-to-last vision layer with the CLS token dropped unless ``top`` says otherwise."""
    config_class, _ = _classes(family)
    if family in ("llava", "llava_next"):
        from transformers import CLIPVisionConfig, LlamaConfig

        top = dict(dict(vision_feature_layer=-2, vision_feature_select_strategy="default"), **top)
        return config_class(text_config=LlamaConfig(**text), vision_config=CLIPVisionConfig(**vision), **top)
    return config_class(text_config=text, vision_config=vision, **top)


def random_model(config, seed: int = 0, device=None, dtype=None):
    """A model of ``config``'s family with seeded random weights, in eval mode. With ``device``
    or ``dtype`` the weights are initialised there and in that dtype (no fp32 host copy)."""
    _, model_class = _classes(config.model_type)
    torch.manual_seed(seed)
    if device is None and dtype is None:
        return model_class(config).eval()
    with torch.device(device or "cpu"):
        return model_class._from_config(config, dtype=dtype, attn_implementation="sdpa").eval()


def char_tokenizer(specials: list[str], bos: str | None, eos: str, template: str) -> PreTrainedTokenizerFast:
    """A character-and-word level tokenizer: small, exact round trip of ASCII text."""
    vocab = {}
    for tok in specials + [chr(i) for i in range(32, 127)] + ["\n"] + ["Ġ" + w for w in WORDS] + WORDS:
        vocab.setdefault(tok, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=specials[0], ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token=specials[0], bos_token=bos, eos_token=eos,
        pad_token=specials[0], additional_special_tokens=[s for s in specials if s not in (specials[0], bos, eos)],
    )
    fast.chat_template = template
    return fast


def random_target(family: str, seed: int = 0, text: dict | None = None, vision: dict | None = None,
                  device=None, dtype=None, image_pixels: int | None = None):
    """(random ``*ForConditionalGeneration`` of ``family``, the processor its adapter reads).

    ``text`` / ``vision`` override entries of the tiny text and vision configs (a published
    shape's, for a benchmark); ``device`` / ``dtype`` as :func:`random_model`. The tokenizer is
    :func:`char_tokenizer` (ids beyond it decode to nothing). Qwen families get a namespace of
    tokenizer and PIL image processor in place of their processor, whose video half insists on
    torchvision (``load_processor`` does the same); their images are resized to between 16 and
    32 pixels squared, or to exactly ``image_pixels`` squared.
    """
    if family not in FAMILY_NAMES:
        raise ValueError(f"no random builder for family {family!r}; known: {', '.join(FAMILY_NAMES)}")
    build = _llava if family in ("llava", "llava_next") else _qwen
    return build(family, seed, text or {}, vision or {}, dict(device=device, dtype=dtype), image_pixels)


def _llava(family: str, seed: int, text_over: dict, vision_over: dict, where: dict, _pixels):
    tok = char_tokenizer(["<unk>", "<s>", "</s>", "<image>"], "<s>", "</s>", VICUNA_V1)
    text = {**dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=0), **text_over}
    vision = {**dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     image_size=16, patch_size=4, projection_dim=32), **vision_over}
    side, patch = vision["image_size"], vision["patch_size"]
    image_token_id = tok.convert_tokens_to_ids("<image>")
    if family == "llava":
        from transformers import CLIPImageProcessor, LlavaProcessor

        model = random_model(random_config(family, text, vision, image_token_id=image_token_id), seed, **where)
        improc = CLIPImageProcessor(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
        proc = LlavaProcessor(image_processor=improc, tokenizer=tok, patch_size=patch,
                              vision_feature_select_strategy="default", num_additional_image_tokens=1,
                              chat_template=VICUNA_V1)
        return model, proc
    from transformers import LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    # anyres as llava-v1.6: tiles of the tower's side, in the published pinpoints' 1x2, 2x1,
    # 2x2, 3x1 and 1x3 arrangements (336 px there, ``side`` here)
    pinpoints = [[side * a, side * b] for a, b in ((1, 2), (2, 1), (2, 2), (3, 1), (1, 3))]
    cfg = random_config(family, text, vision, image_token_id=image_token_id, image_grid_pinpoints=pinpoints,
                        image_seq_length=(side // patch) ** 2)
    model = random_model(cfg, seed, **where)
    improc = LlavaNextImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side},
                                        image_grid_pinpoints=pinpoints)
    proc = LlavaNextProcessor(image_processor=improc, tokenizer=tok, patch_size=patch,
                              vision_feature_select_strategy="default", num_additional_image_tokens=1,
                              chat_template=VICUNA_V1)
    return model, proc


def _qwen(family: str, seed: int, text_over: dict, vision_over: dict, where: dict, image_pixels: int | None):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    specials = ["<unk>", *QWEN_SPECIALS]
    tok = char_tokenizer(specials, None, "<|im_end|>", CHATML_QWEN)
    ids = {s: tok.convert_tokens_to_ids(s) for s in specials}
    text = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
                eos_token_id=ids["<|im_end|>"], bos_token_id=None, pad_token_id=0)
    patch = 4
    if family == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, patch_size=patch,
                      spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    elif family == "qwen2_5_vl":
        # window_size is in pixels: 16 px = 2 merged tokens of 2x2 patches of 4 px, so a
        # 32-pixel image's 4x4 grid spans four windows (block 0 within windows, block 1 whole)
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=patch,
                      spatial_merge_size=2, temporal_patch_size=2, in_channels=3, out_hidden_size=32,
                      window_size=16, fullatt_block_indexes=[1], tokens_per_second=2)
    else:
        # three text layers and two deepstack mergers (after vision blocks 0 and 1, added
        # after text layers 0 and 1): the last text layer sees no injection, as in Qwen3-VL-8B
        text = {**text, "num_hidden_layers": 3, "head_dim": 8}
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=patch,
                      spatial_merge_size=2, temporal_patch_size=2, in_channels=3, out_hidden_size=32,
                      num_position_embeddings=64, deepstack_visual_indexes=[0, 1])
    cfg = random_config(family, {**text, **text_over}, {**vision, **vision_over},
                        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    model = random_model(cfg, seed, **where)
    lo, hi = (image_pixels, image_pixels) if image_pixels else (16, 32)
    improc = Qwen2VLImageProcessorPil(min_pixels=lo * lo, max_pixels=hi * hi, patch_size=cfg.vision_config.patch_size,
                                      temporal_patch_size=2, merge_size=2)
    return model, SimpleNamespace(image_processor=improc, tokenizer=tok, image_token="<|image_pad|>")


def save_random_target(family: str, out_dir: str | Path, seed: int = 0) -> Path:
    """:func:`random_target` written as a Hub model folder (``load_target(out_dir)`` loads it).

    A Qwen folder names its full processor in preprocessor_config.json, as the Hub's do;
    without torchvision ``load_processor`` falls back to tokenizer and PIL image processor.
    """
    model, proc = random_target(family, seed)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    if not isinstance(proc, SimpleNamespace):
        proc.save_pretrained(out_dir)
        return out_dir
    proc.tokenizer.save_pretrained(out_dir)
    proc.image_processor.save_pretrained(out_dir)
    pre = out_dir / "preprocessor_config.json"
    names = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}
    pre.write_text(json.dumps({**json.loads(pre.read_text()), "processor_class": names[family]}, indent=2))
    return out_dir
