"""The tiny target's model and its training: a ``LlavaForConditionalGeneration`` (CLIP
vision tower, 2-layer GELU projector, Llama language model), the vision tower pretrained on
what is drawn where, then the whole model trained end to end on assistant tokens only."""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from lab.tiny.images import COLOURS, IMAGE_SIZE, IMAGE_TOKEN, KINDS, PATCH_SIZE, TOKENS_PER_IMAGE
from lab.tiny.tokenizer import (
    VOCAB_SIZE,
    build_processor,
    build_tokenizer,
    conversation_texts,
    encode_item,
    render_item,
    to_messages,
)


def build_model(tokenizer):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    text_config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=704,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    vision_config = CLIPVisionConfig(
        hidden_size=64, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
        image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=64, hidden_act="quick_gelu")
    config = LlavaConfig(
        vision_config=vision_config, text_config=text_config, image_token_index=image_token_id,
        image_seq_length=TOKENS_PER_IMAGE, projector_hidden_act="gelu",
        vision_feature_select_strategy="default", vision_feature_layer=-2,
        tie_word_embeddings=False)
    config.pad_token_id = tokenizer.pad_token_id
    model = LlavaForConditionalGeneration(config)
    gc = model.generation_config
    gc.bos_token_id, gc.eos_token_id, gc.pad_token_id = (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    return model


def load_pixels(processor, image_dir: Path, paths: list[str]) -> dict[str, torch.Tensor]:
    out = {}
    uniq = sorted(set(paths))
    for i in range(0, len(uniq), 256):
        chunk = uniq[i:i + 256]
        imgs = [Image.open(image_dir / p).convert("RGB") for p in chunk]
        pv = processor.image_processor(imgs, return_tensors="pt")["pixel_values"]
        for p, v in zip(chunk, pv):
            out[p] = v
    return out


def collate(batch: list[dict], pad_id: int, pixels: dict[str, torch.Tensor]):
    n = max(len(b["ids"]) for b in batch)
    ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), n), dtype=torch.long)
    attn = torch.zeros((len(batch), n), dtype=torch.long)
    images = []
    for i, b in enumerate(batch):
        L = len(b["ids"])
        ids[i, :L] = b["ids"]
        mask[i, :L] = b["mask"]
        attn[i, :L] = 1
        images.extend(b["images"])
    pv = torch.stack([pixels[p] for p in images]) if images else None
    return ids, attn, mask, pv


def lm_loss(model, ids, attn, mask, pv, reduction="mean"):
    out = model(input_ids=ids, attention_mask=attn, pixel_values=pv)
    logits = out.logits[:, :-1].float()
    target = ids[:, 1:]
    m = mask[:, 1:].bool()
    ce = torch.nn.functional.cross_entropy(logits[m], target[m], reduction="sum")
    if reduction == "sum":
        return ce, int(m.sum())
    return ce / m.sum().clamp(min=1)


COLOUR_INDEX = {c: i for i, c in enumerate(COLOURS)}
KIND_INDEX = {k: i for i, k in enumerate(KINDS)}


def image_labels(meta: dict) -> tuple[list[int], int, int]:
    """Ground truth of one image for vision pretraining: per grid cell 0 (empty) or
    1 + colour * len(KINDS) + kind, -100 everywhere for digits; digit class and ink colour
    (-100 for shapes)."""
    if meta["type"] == "digit":
        return [-100] * 9, meta["digit"], COLOUR_INDEX[meta["colour"]]
    cells = [0] * 9
    for s in meta["shapes"]:
        cells[s["cell"]] = 1 + COLOUR_INDEX[s["colour"]] * len(KINDS) + KIND_INDEX[s["kind"]]
    return cells, -100, -100


def pretrain_vision(model, pixels: dict[str, torch.Tensor], meta: dict, steps: int,
                    batch_size: int, lr: float, seed: int) -> None:
    """Give the vision tower a head start, as LLaVA starts from a pretrained CLIP: train it
    (with throw-away linear probes) to say what is drawn in each cell of the 3x3 grid, and
    which digit in which ink, from the features the projector will read
    (``vision_feature_layer``). Only the vision tower's weights are kept."""
    from tqdm import tqdm

    tower = model.model.vision_tower
    layer = model.config.vision_feature_layer
    h = model.config.vision_config.hidden_size
    paths = sorted(p for p in pixels if p in meta)
    labels = [image_labels(meta[p]) for p in paths]
    cells = torch.tensor([lab[0] for lab in labels])
    digit = torch.tensor([lab[1] for lab in labels])
    ink = torch.tensor([lab[2] for lab in labels])
    pv_all = torch.stack([pixels[p] for p in paths])
    gen = torch.Generator().manual_seed(seed)
    probes = torch.nn.ModuleDict({
        "cell": torch.nn.Linear(h, 1 + len(COLOURS) * len(KINDS)),
        "digit": torch.nn.Linear(h, 10),
        "ink": torch.nn.Linear(h, len(COLOURS)),
    })
    params = list(tower.parameters()) + list(probes.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * (0.5 * (1 + math.cos(math.pi * s / steps))))
    ce = torch.nn.CrossEntropyLoss(ignore_index=-100)
    tower.train()
    bar = tqdm(range(steps), desc="vision pretraining", mininterval=2.0)
    for _ in bar:
        idx = torch.randint(len(paths), (batch_size,), generator=gen)
        feats = tower(pixel_values=pv_all[idx], output_hidden_states=True).hidden_states[layer][:, 1:]
        grid = int(math.isqrt(feats.shape[1]))
        f = feats.reshape(len(idx), grid, grid, h)
        # mean over the patches of each of the 3x3 cells
        k = grid // 3
        cell_f = f.reshape(len(idx), 3, k, 3, k, h).mean(dim=(2, 4)).reshape(len(idx), 9, h)
        mean_f = feats.mean(dim=1)
        loss = (ce(probes["cell"](cell_f).flatten(0, 1), cells[idx].flatten())
                + ce(probes["digit"](mean_f), digit[idx]) + ce(probes["ink"](mean_f), ink[idx]))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")


def batches_for_epoch(n: int, batch_size: int, lengths: list[int], g: torch.Generator):
    """A seeded epoch order: shuffle, sort by length within chunks of 16 batches (less
    padding), then shuffle the batches."""
    perm = torch.randperm(n, generator=g).tolist()
    chunk = batch_size * 16
    batches = []
    for i in range(0, n, chunk):
        part = sorted(perm[i:i + chunk], key=lambda j: lengths[j])
        batches.extend(part[k:k + batch_size] for k in range(0, len(part), batch_size))
    order = torch.randperm(len(batches), generator=g).tolist()
    return [batches[k] for k in order]


@dataclass
class TrainSettings:
    """How the committed data/tiny-llava was trained (lab/targets/make_tiny_target.py's flags)."""

    steps: int = 1000
    batch_size: int = 24
    lr: float = 2e-3  # peak learning rate of the LM
    vision_lr_mult: float = 0.1  # vision tower and projector learning rate, relative to lr
    vision_steps: int = 400  # vision tower pretraining steps before the LLaVA training
    vocab_size: int = VOCAB_SIZE
    seed: int = 0
    # bf16 autocast for the LLaVA forward (fp32 weights and optimizer state): quality alike,
    # little faster here, slow on CPUs without BF16 instructions; the committed weights are fp32
    bf16: bool = False
    # torch threads: 1 is faster than 2 on a shared 2-core machine; the committed weights used 1
    threads: int = 1


def train(data_dir: Path, out: Path, args: TrainSettings) -> None:
    """Tokenizer, processor and model from the training conversations in ``data_dir``,
    trained and saved to ``out`` (replaced atomically)."""
    from tqdm import tqdm

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)

    data_dir = Path(data_dir)
    text_train = json.loads((data_dir / "sharegpt_train.json").read_text())
    llava_train = json.loads((data_dir / "llava_train.json").read_text())

    items = text_train + llava_train
    rendered = []
    for item in tqdm(items, desc="render", mininterval=2.0):
        messages, images = to_messages(item)
        rendered.append((render_item(messages), images))
    tokenizer = build_tokenizer(conversation_texts([r[0] for r in rendered]), args.vocab_size)
    processor = build_processor(tokenizer)
    torch.manual_seed(args.seed)
    model = build_model(tokenizer)
    image_token_id = model.config.image_token_id
    n_params = sum(p.numel() for p in model.parameters())
    print(f"vocab {len(tokenizer)}, image token id {image_token_id}, {n_params / 1e6:.2f}M parameters")

    encoded = []
    for segments, images in rendered:
        ids, mask = encode_item(tokenizer, image_token_id, None, len(images), segments)
        encoded.append({"ids": ids, "mask": mask, "images": images})
    pixels = load_pixels(processor, data_dir / "images", [p for e in encoded for p in e["images"]])
    lengths = [len(e["ids"]) for e in encoded]
    print(f"{len(encoded)} training conversations, {sum(lengths)} tokens, "
          f"max length {max(lengths)}")

    if args.vision_steps:
        meta = json.loads((data_dir / "images" / "meta.json").read_text())
        train_paths = sorted({p for e in encoded for p in e["images"]})
        pretrain_vision(model, {p: pixels[p] for p in train_paths}, meta, args.vision_steps,
                        64, 3e-3, args.seed)

    # The LM learns fast; a lower rate for the vision side keeps it from being turned
    # into a constant "memory" the LM reads instead of the image.
    groups = []
    for vision in (False, True):
        named = [(n, p) for n, p in model.named_parameters()
                 if ("vision_tower" in n or "multi_modal_projector" in n) == vision]
        lr = args.lr * (args.vision_lr_mult if vision else 1.0)
        groups.append({"params": [p for n, p in named if p.dim() >= 2 and "embed" not in n],
                       "weight_decay": 0.05, "lr": lr})
        groups.append({"params": [p for n, p in named if not (p.dim() >= 2 and "embed" not in n)],
                       "weight_decay": 0.0, "lr": lr})
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    warmup = min(100, args.steps // 10)

    def lr_at(step):
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, args.steps - warmup)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    g = torch.Generator().manual_seed(args.seed)
    model.train()
    queue: list[list[int]] = []
    t0 = time.time()
    ema = None
    bar = tqdm(range(args.steps), desc="train", mininterval=2.0)
    for _ in bar:
        if not queue:
            queue = batches_for_epoch(len(encoded), args.batch_size, lengths, g)
        batch = [encoded[j] for j in queue.pop()]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss = lm_loss(model, *collate(batch, tokenizer.pad_token_id, pixels))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        ema = float(loss) if ema is None else 0.98 * ema + 0.02 * float(loss)
        bar.set_postfix(loss=f"{ema:.3f}", lr=f"{sched.get_last_lr()[0]:.2e}")
    train_s = time.time() - t0
    print(f"training: {args.steps} steps in {train_s / 60:.1f} min, final loss (EMA) {ema:.3f}")

    model.eval()
    save(model, processor, Path(out))


def save(model, processor, out: Path) -> None:
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    processor.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"saved {out} ({size / 1e6:.1f} MB)")
