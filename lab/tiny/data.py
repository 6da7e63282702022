"""The data recipe of the tiny target: how data/tiny/ is made, in one place.

``make_data`` writes, deterministically from ``seed`` (byte-identical files for a Python
version: the text comes from that version's standard library docstrings):

* ``sharegpt_train.json`` / ``sharegpt_heldout.json``: text conversations about stdlib
  objects (``lab.tiny.text``); held-out objects have docstrings never seen in
  training;
* ``images/shapes/*.png``, ``images/digits/*.png`` and ``images/meta.json`` (what is drawn
  where, for vision pretraining and captions; ``lab.tiny.images``);
* ``llava_train.json`` / ``llava_heldout.json``: image conversations in four categories
  (single-image questions, a second question on the same image, a text-only follow-up
  turn, two-image comparisons); held-out items use held-out images only;
* ``captions_heldout.json``: a caption per held-out image (the ensemble's variant C).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from PIL import Image

from lab.tiny.images import (
    COLOURS,
    IMAGE_TOKEN,
    caption,
    image_question,
    make_digit_image,
    make_shapes_image,
    two_image_question,
)
from lab.tiny.text import collect_stdlib, sharegpt_conversation, text_conversation

# The recipe's sizes. Training: N_TEXT text and N_IMAGE image conversations (the script's
# --n-text / --n-image); of the image ones, TRAIN_MIX_IN_20THS are second questions on the
# same image, text-only follow-ups and two-image comparisons, the rest single questions.
N_TEXT, N_IMAGE = 3200, 3600
TRAIN_MIX_IN_20THS = {"image_multiturn": 2, "image_followup": 3, "multi_image": 3}
SHAPES_TRAIN, DIGITS_TRAIN = 1500, 1200  # training images (digits: of scikit-learn's 1797)
# Held-out: objects whose docstrings training never sees, and images of their own; each
# held-out single-image question gets its own image.
HELDOUT_DOCS, HELDOUT_TEXT = 160, 150
SHAPES_HELDOUT, DIGITS_HELDOUT = 200, 120
HELDOUT_IMAGE = {"image_question": 150, "image_followup": 50, "multi_image": 50}


def make_data(data_dir: Path, seed: int = 0, n_text: int = N_TEXT, n_image: int = N_IMAGE) -> None:
    """Write data/tiny/ (replacing ``data_dir``): every random choice comes from one
    ``random.Random(seed)``, in the order below."""
    from sklearn.datasets import load_digits

    rng = random.Random(seed)
    if data_dir.exists():
        shutil.rmtree(data_dir)
    (data_dir / "images" / "shapes").mkdir(parents=True)
    (data_dir / "images" / "digits").mkdir(parents=True)

    # ---- text -------------------------------------------------------------------
    objs = collect_stdlib()
    docs = sorted({o["doc"] for o in objs})
    rng.shuffle(docs)
    held_docs = set(docs[:HELDOUT_DOCS])  # held-out objects have docstrings never seen in training
    train_objs = [o for o in objs if o["doc"] not in held_docs]
    held_objs = [o for o in objs if o["doc"] in held_docs]
    held_objs = rng.sample(held_objs, min(len(held_objs), HELDOUT_TEXT))

    def text_items(pool, n, prefix, held):
        items = []
        order = []
        while len(order) < n:  # every object once before any twice
            batch = list(pool)
            rng.shuffle(batch)
            order.extend(batch)
        for i, o in enumerate(order[:n]):
            item = {"id": f"{prefix}-{i}", "conversations": sharegpt_conversation(text_conversation(o, rng))}
            if held:
                item["category"] = "text"
            items.append(item)
        return items

    text_train = text_items(train_objs, n_text, "stdlib", False)
    text_held = text_items(held_objs, len(held_objs), "stdlib-heldout", True)

    # ---- images -----------------------------------------------------------------
    digits = load_digits()
    didx = list(range(len(digits.target)))
    rng.shuffle(didx)
    held_didx, train_didx = didx[:DIGITS_HELDOUT], didx[DIGITS_HELDOUT:DIGITS_HELDOUT + DIGITS_TRAIN]

    def make_images(n_shapes, digit_ids, tag):
        metas = []
        for i in range(n_shapes):
            n = 1 if rng.random() < 0.4 else rng.randint(2, 4)
            img, shapes = make_shapes_image(n, rng)
            rel = f"shapes/{tag}_{i:05d}.png"
            img.quantize(colors=64, dither=Image.Dither.NONE).save(
                data_dir / "images" / rel, optimize=True)
            metas.append({"type": "shapes", "path": rel, "shapes": shapes})
        for k, j in enumerate(digit_ids):
            colour = rng.choice(list(COLOURS))
            img = make_digit_image(digits.images[j], colour)
            rel = f"digits/{tag}_{k:05d}.png"
            img.quantize(colors=16, dither=Image.Dither.NONE).save(
                data_dir / "images" / rel, optimize=True)
            metas.append({"type": "digit", "path": rel, "digit": int(digits.target[j]),
                          "colour": colour})
        rng.shuffle(metas)
        return metas

    train_imgs = make_images(SHAPES_TRAIN, train_didx, "train")
    held_imgs = make_images(SHAPES_HELDOUT, held_didx, "heldout")

    def follow_up_turn(pool_objs):
        o = rng.choice(pool_objs)
        return text_conversation(o, rng)[0]

    def image_items(metas, pool_objs, counts: dict, id_prefix, held):
        items = []
        cursor = 0

        def next_meta():
            nonlocal cursor
            m = metas[cursor % len(metas)]
            cursor += 1
            return m

        for category, n in counts.items():
            for _ in range(n):
                idx = len(items)
                # ids: sometimes ints, sometimes strings, as in real LLaVA-Instruct files
                iid = idx if idx % 3 == 0 else f"{id_prefix}{idx:06d}"
                if category == "multi_image":
                    m1, m2 = next_meta(), next_meta()
                    q, a = two_image_question(m1, m2, rng)
                    turns = [(f"{IMAGE_TOKEN}\n{IMAGE_TOKEN}\n{q}", a)]
                    image = [m1["path"], m2["path"]]
                else:
                    m = next_meta()
                    q, a = image_question(m, rng)
                    first = f"{IMAGE_TOKEN}\n{q}" if rng.random() < 0.8 else f"{q}\n{IMAGE_TOKEN}"
                    turns = [(first, a)]
                    if category == "image_followup":
                        turns.append(follow_up_turn(pool_objs))
                    elif category == "image_multiturn":
                        q2, a2 = image_question(m, rng)
                        if q2 != q:
                            turns.append((q2, a2))
                    image = m["path"]
                item = {"id": iid, "image": image, "conversations": sharegpt_conversation(turns)}
                if held:
                    item["category"] = category
                items.append(item)
        return items

    mix = {category: n_image * twentieths // 20 for category, twentieths in TRAIN_MIX_IN_20THS.items()}
    llava_train = image_items(
        train_imgs, train_objs, {"image_question": n_image - sum(mix.values()), **mix}, "img", False)
    rng.shuffle(llava_train)
    llava_held = image_items(held_imgs, held_objs, HELDOUT_IMAGE, "heldout", True)

    def dump(obj, name):
        with open(data_dir / name, "w") as f:
            json.dump(obj, f, indent=1, ensure_ascii=True)
            f.write("\n")

    # Per-image ground truth (what is drawn where), used to pretrain the vision tower.
    meta = {m["path"]: {k: v for k, v in m.items() if k != "path"} for m in train_imgs + held_imgs}
    with open(data_dir / "images" / "meta.json", "w") as f:
        json.dump(meta, f, separators=(",", ":"), sort_keys=True)
        f.write("\n")
    write_captions(data_dir)
    dump(text_train, "sharegpt_train.json")
    dump(text_held, "sharegpt_heldout.json")
    dump(llava_train, "llava_train.json")
    dump(llava_held, "llava_heldout.json")
    print(f"data: {len(text_train)} + {len(text_held)} text, {len(llava_train)} + "
          f"{len(llava_held)} image conversations, "
          f"{len(train_imgs) + len(held_imgs)} images -> {data_dir}")


def write_captions(data_dir: Path) -> Path:
    """data/tiny/captions_heldout.json: {image path: caption} for the held-out images, the
    captions that the ensemble variant C splices in place of the image (benchmark only)."""
    meta = json.loads((data_dir / "images" / "meta.json").read_text())
    caps = {path: caption(m) for path, m in sorted(meta.items()) if "heldout" in path}
    out = data_dir / "captions_heldout.json"
    out.write_text(json.dumps(caps, indent=1) + "\n")
    return out
