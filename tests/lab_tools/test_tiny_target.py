"""The embedded default target (data/tiny-llava) and its data (data/tiny).

Checks that the committed folder loads with the standard transformers APIs, that its
tokenizer and processor behave as the rest of the project assumes, that the bundled
datasets have the promised shape, and that the target has actually learnt both text and
images:

* mean assistant-token cross-entropy on the held-out conversations <= 0.5 * log(vocab);
* replacing the image of a held-out single-image question with another held-out image
  changes the greedy answer in at least 80% of cases.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from msd_train.targets.chat import VICUNA_V1, Segment, render_prompt, render_segments
from msd_train.targets.tokenize import encode_segments

REPO = Path(__file__).resolve().parents[2]

MODEL_DIR = REPO / "data" / "tiny-llava"
DATA_DIR = REPO / "data" / "tiny"
IMAGE = "<image>"
ROLES = {"human": "user", "gpt": "assistant"}

pytestmark = pytest.mark.skipif(not (MODEL_DIR / "config.json").exists(), reason="data/tiny-llava missing")


def _load(name):
    return json.loads((DATA_DIR / name).read_text())


def _messages(item):
    msgs = [{"role": ROLES[t["from"]], "content": t["value"]} for t in item["conversations"]]
    images = item.get("image") or []
    return msgs, [images] if isinstance(images, str) else list(images)


@pytest.fixture(scope="module")
def target():
    import warnings

    from transformers import AutoProcessor, LlavaForConditionalGeneration

    warnings.filterwarnings("ignore", message=".*torchvision.*")
    # A 4.5M-parameter model is bound by Python overhead: one thread is as fast, and much
    # faster than two when the CPU is shared.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    processor = AutoProcessor.from_pretrained(MODEL_DIR)
    model = LlavaForConditionalGeneration.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    yield model, processor
    torch.set_num_threads(threads)


def _tokens_per_image(model):
    vc = model.config.vision_config
    return (vc.image_size // vc.patch_size) ** 2  # "default" strategy drops CLS


def _pixels(processor, paths):
    from PIL import Image

    paths = sorted(set(paths))
    imgs = [Image.open(DATA_DIR / "images" / p).convert("RGB") for p in paths]
    pv = processor.image_processor(imgs, return_tensors="pt")["pixel_values"]
    return dict(zip(paths, pv))


# ----- the folder ---------------------------------------------------------------------


def test_folder_is_small_and_standard(target):
    size = sum(f.stat().st_size for f in MODEL_DIR.rglob("*") if f.is_file())
    assert size <= 25e6, f"data/tiny-llava is {size / 1e6:.1f} MB"
    assert (MODEL_DIR / "model.safetensors").exists()
    model, processor = target
    cfg = model.config
    assert cfg.model_type == "llava"
    assert cfg.text_config.model_type == "llama"
    assert cfg.vision_config.model_type == "clip_vision_model"
    assert cfg.vision_feature_select_strategy == "default"
    assert cfg.vision_feature_layer == -2
    assert cfg.image_token_id == processor.tokenizer.convert_tokens_to_ids(IMAGE)
    n = _tokens_per_image(model)
    side = int(math.isqrt(n))
    assert side * side == n and 16 <= n <= 64
    assert cfg.image_seq_length == n


def test_tokenizer(target):
    _, processor = target
    tok = processor.tokenizer
    for attr, text in [("bos_token", "<s>"), ("eos_token", "</s>"), ("unk_token", "<unk>"),
                       ("pad_token", "<pad>")]:
        assert getattr(tok, attr) == text
    assert len({tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.pad_token_id,
                tok.convert_tokens_to_ids(IMAGE)}) == 5
    assert tok.chat_template == VICUNA_V1
    assert 1024 <= len(tok) <= 4096
    assert tok.model_max_length == 2048
    image_id = tok.convert_tokens_to_ids(IMAGE)
    assert tok.encode(IMAGE, add_special_tokens=False) == [image_id]
    ids = tok.encode("It is red.</s>USER: <image>\nHi", add_special_tokens=False)
    assert ids.count(tok.eos_token_id) == 1 and ids.count(image_id) == 1
    # decode(encode(text)) is the identity on every conversation text and on odd text
    texts = ["  two  spaces\tand a tab\n\nnewlines ", "ünïcödé 漢字 and emoji \U0001f600",
             " USER: <image>\nWhat? ASSISTANT: It is red.</s>"]
    for name in ["sharegpt_heldout.json", "llava_heldout.json", "sharegpt_train.json"]:
        for item in _load(name)[:400]:
            texts.extend(t["value"] for t in item["conversations"])
    for text in texts:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text, text


def test_processor_expansion_matches_model(target):
    from PIL import Image

    model, processor = target
    tok = processor.tokenizer
    item = next(x for x in _load("llava_heldout.json") if x["category"] == "multi_image")
    images = [Image.open(DATA_DIR / "images" / p).convert("RGB") for p in item["image"]]
    text = render_prompt(_messages(item)[0][:1], VICUNA_V1, eos_token=tok.eos_token)
    batch = processor(text=text, images=images, return_tensors="pt")
    n_image_tokens = int((batch["input_ids"] == model.config.image_token_id).sum())
    with torch.no_grad():
        feats = model.model.get_image_features(pixel_values=batch["pixel_values"], return_dict=True)
        per_image = [f.shape[0] for f in feats.pooler_output]
        model(**batch)  # the forward accepts the processor's output as is
    assert per_image == [_tokens_per_image(model)] * 2
    assert n_image_tokens == sum(per_image)
    # and the project's own encoding yields the same ids as the processor
    ids, _ = encode_segments(tok, [Segment(text, False)], IMAGE, model.config.image_token_id,
                             [_tokens_per_image(model)] * 2)
    assert ids.tolist() == batch["input_ids"][0].tolist()


# ----- the data -----------------------------------------------------------------------


def test_datasets_shape():
    text_train, text_held = _load("sharegpt_train.json"), _load("sharegpt_heldout.json")
    img_train, img_held = _load("llava_train.json"), _load("llava_heldout.json")
    assert len(text_train) >= 2000 and len(img_train) >= 2000
    assert 100 <= len(text_held) <= 300 and 100 <= len(img_held) <= 300
    for item in text_train + text_held + img_train + img_held:
        conv = item["conversations"]
        assert conv and len(conv) % 2 == 0
        assert [t["from"] for t in conv] == ["human", "gpt"] * (len(conv) // 2)
        images = _messages(item)[1]
        assert sum(t["value"].count(IMAGE) for t in conv) == len(images)
        for p in images:
            assert (DATA_DIR / "images" / p).is_file(), p
    assert {x["category"] for x in text_held} == {"text"}
    assert {x["category"] for x in img_held} == {"image_question", "image_followup", "multi_image"}
    assert any(isinstance(x["id"], int) for x in img_train)
    assert any(isinstance(x["id"], str) for x in img_train)
    assert any(len(x["conversations"]) > 2 for x in text_train)
    assert any(isinstance(x["image"], list) and len(x["image"]) == 2 for x in img_train)
    for x in img_held:  # follow-up turns are text-only
        if x["category"] == "image_followup":
            assert len(x["conversations"]) == 4 and IMAGE not in x["conversations"][2]["value"]
    # held-out items are disjoint from training: other images, other objects and docstrings
    train_images = {p for x in img_train for p in _messages(x)[1]}
    assert not train_images & {p for x in img_held for p in _messages(x)[1]}

    def answers(items):
        return {t["value"] for x in items for t in x["conversations"][1::2]}

    def asked(items):
        return {t["value"].split("`")[1] for x in items for t in x["conversations"][0::2]
                if t["value"].count("`") >= 2}

    docs_held = {a for a in answers(text_held) if "`" not in a}
    assert docs_held and not docs_held & answers(text_train)
    assert not asked(text_held) & asked(text_train)


# ----- the quality bar ----------------------------------------------------------------


def _encode(tok, model, messages, n_images):
    segments = render_segments(messages, "vicuna_v1", image_text=IMAGE, eos_token=tok.eos_token)
    return encode_segments(tok, segments, IMAGE, model.config.image_token_id,
                           [_tokens_per_image(model)] * n_images)


@torch.no_grad()
def _heldout_ce(model, processor, items):
    """(sum of assistant-token cross-entropies in nats, number of assistant tokens)."""
    tok = processor.tokenizer
    enc = []
    for item in items:
        msgs, images = _messages(item)
        enc.append((*_encode(tok, model, msgs, len(images)), images))
    pixels = _pixels(processor, [p for e in enc for p in e[2]])
    total, count = 0.0, 0
    for i in range(0, len(enc), 32):
        chunk = enc[i:i + 32]
        n = max(len(e[0]) for e in chunk)
        ids = torch.full((len(chunk), n), tok.pad_token_id)
        mask = torch.zeros((len(chunk), n), dtype=torch.long)
        attn = torch.zeros_like(mask)
        for j, (x, m, _) in enumerate(chunk):
            ids[j, :len(x)], mask[j, :len(x)], attn[j, :len(x)] = x, m, 1
        imgs = [p for e in chunk for p in e[2]]
        pv = torch.stack([pixels[p] for p in imgs]) if imgs else None
        logits = model(input_ids=ids, attention_mask=attn, pixel_values=pv).logits[:, :-1]
        sel = mask[:, 1:].bool()
        total += float(torch.nn.functional.cross_entropy(logits[sel], ids[:, 1:][sel], reduction="sum"))
        count += int(sel.sum())
    return total, count


@torch.no_grad()
def _image_swap_rate(model, processor, max_new_tokens=16):
    """Greedy answers to held-out single-image questions, with each question's own image
    and with the next question's image. Prompts with the same ids share one batch (no
    padding), so batching does not change what greedy decoding sees."""
    tok = processor.tokenizer
    items = [x for x in _load("llava_heldout.json") if x["category"] == "image_question"]
    pixels = _pixels(processor, [x["image"] for x in items])
    groups = defaultdict(list)
    for i, item in enumerate(items):
        msgs, _ = _messages(item)
        text = render_prompt(msgs[:1], "vicuna_v1", image_text=IMAGE, eos_token=tok.eos_token)
        ids, _ = encode_segments(tok, [Segment(text, False)], IMAGE, model.config.image_token_id,
                                 [_tokens_per_image(model)])
        groups[tuple(ids.tolist())].append(i)
    answers = {}
    for key, idx in groups.items():
        own = [items[i]["image"] for i in idx]
        other = [items[(i + 1) % len(items)]["image"] for i in idx]
        pv = torch.stack([pixels[p] for p in own + other])
        ids = torch.tensor([key] * len(pv))
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pv,
                             max_new_tokens=max_new_tokens, do_sample=False)
        texts = tok.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
        for k, i in enumerate(idx):
            answers[i] = (texts[k], texts[len(idx) + k])
    changed = sum(a != b for a, b in answers.values())
    return changed / len(items), [answers[i] for i in range(3)]


@pytest.mark.slow
def test_target_learnt_text_and_images(target):
    model, processor = target
    vocab = model.config.text_config.vocab_size
    bound = 0.5 * math.log(vocab)
    text_items, image_items = _load("sharegpt_heldout.json"), _load("llava_heldout.json")
    (s_text, n_text), (s_image, n_image) = (_heldout_ce(model, processor, text_items),
                                            _heldout_ce(model, processor, image_items))
    ce_text, ce_image, ce_all = s_text / n_text, s_image / n_image, (s_text + s_image) / (n_text + n_image)
    rate, examples = _image_swap_rate(model, processor)
    print(f"\nheld-out assistant-token CE (nats): text {ce_text:.3f}, image {ce_image:.3f}, "
          f"all {ce_all:.3f}; bound 0.5*log({vocab}) = {bound:.3f}")
    print(f"image swap changes the greedy answer in {rate:.1%} of held-out questions")
    for a, b in examples:
        print(f"  {a!r} -> swapped: {b!r}")
    assert ce_text <= bound, f"text CE {ce_text:.3f} > {bound:.3f}"
    assert ce_image <= bound, f"image CE {ce_image:.3f} > {bound:.3f}"
    assert ce_all <= bound, f"CE {ce_all:.3f} > {bound:.3f}"
    assert rate >= 0.8, f"image swap changed only {rate:.1%} of answers"


def test_captions_are_the_images_ground_truth(tmp_path):
    """data/tiny/captions_heldout.json is what `make_tiny_target.py --captions-only` writes
    from images/meta.json: one caption per held-out image, naming what is drawn."""
    from lab.tiny.data import write_captions

    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "meta.json").write_bytes((DATA_DIR / "images" / "meta.json").read_bytes())
    written = write_captions(tmp_path)
    assert written.read_bytes() == (DATA_DIR / "captions_heldout.json").read_bytes()
    caps = json.loads(written.read_text())
    meta = json.loads((DATA_DIR / "images" / "meta.json").read_text())
    assert set(caps) == {p for p in meta if "heldout" in p}
    digit = next(p for p in caps if meta[p]["type"] == "digit")
    assert str(meta[digit]["digit"]) in caps[digit] and meta[digit]["colour"] in caps[digit]
