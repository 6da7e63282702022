"""The tiny target's tokenizer and processor, and its conversations as model inputs.

A byte-level BPE tokenizer trained on the rendered training conversations, a CLIP image
processor at the model's image size, and the project's own formatting
(``msd_train.targets.chat.render_segments`` with the Vicuna-v1 template, then
``msd_train.targets.tokenize.encode_segments``), exactly as training formats conversations.
"""

from __future__ import annotations

import warnings

from lab.tiny.images import IMAGE_SIZE, IMAGE_TOKEN, PATCH_SIZE, TOKENS_PER_IMAGE
from msd_train.targets.chat import VICUNA_V1, Segment, render_prompt, render_segments
from msd_train.targets.tokenize import encode_segments

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", IMAGE_TOKEN]
TEMPLATE = "vicuna_v1"
VOCAB_SIZE = 2048


def to_messages(item: dict) -> tuple[list[dict], list[str]]:
    roles = {"human": "user", "gpt": "assistant"}
    messages = [{"role": roles[t["from"]], "content": t["value"]} for t in item["conversations"]]
    images = item.get("image") or []
    if isinstance(images, str):
        images = [images]
    return messages, images


def render_item(messages: list[dict]) -> list[Segment]:
    return render_segments(messages, TEMPLATE, image_text=IMAGE_TOKEN, eos_token="</s>")


def encode_item(tokenizer, image_token_id: int, messages: list[dict], n_images: int,
                segments: list[Segment] | None = None):
    if segments is None:
        segments = render_item(messages)
    return encode_segments(tokenizer, segments, IMAGE_TOKEN, image_token_id,
                           tokens_per_image=[TOKENS_PER_IMAGE] * n_images)


def encode_prompt(tokenizer, image_token_id: int, messages: list[dict], n_images: int):
    """Token ids of the generation prompt for the next assistant turn."""
    text = render_prompt(messages, TEMPLATE, image_text=IMAGE_TOKEN, eos_token="</s>")
    ids, _ = encode_segments(tokenizer, [Segment(text, False)], IMAGE_TOKEN, image_token_id,
                             tokens_per_image=[TOKENS_PER_IMAGE] * n_images)
    return ids


def conversation_texts(segment_lists: list[list[Segment]]) -> list[str]:
    """Tokenizer training text: the rendered conversations without the special tokens."""
    texts = []
    for segments in segment_lists:
        for seg in segments:
            for part in seg.text.replace("</s>", "\n").split(IMAGE_TOKEN):
                if part:
                    texts.append(part)
    return texts


def build_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>", extra_special_tokens={"image_token": IMAGE_TOKEN},
        model_max_length=2048, padding_side="right", clean_up_tokenization_spaces=False)
    hf.chat_template = VICUNA_V1
    return hf


def build_processor(tokenizer):
    from transformers import CLIPImageProcessor, LlavaProcessor

    warnings.filterwarnings("ignore", message=".*torchvision.*")
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        do_center_crop=True, do_resize=True, do_convert_rgb=True)
    return LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        chat_template=VICUNA_V1, image_token=IMAGE_TOKEN)
