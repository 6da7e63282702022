#!/usr/bin/env python
"""Build the embedded default target: a tiny, *trained* LLaVA, and the small datasets it
was trained on.

Everything is made on a CPU from material present on any machine, deterministically:

* text conversations (ShareGPT format) about Python's standard library: what an object
  does (the first sentence of its docstring), which module or class it belongs to, what
  its parameters are (from ``inspect.signature``), single- and multi-turn;
* image conversations (LLaVA-Instruct format) about small rendered PNGs: coloured shapes
  on a 3x3 grid and scikit-learn's handwritten digits (``load_digits``, no download),
  including follow-up turns that ignore the image and two-image comparisons;
* a byte-level BPE tokenizer trained on the training text;
* a ``LlavaForConditionalGeneration`` (CLIP vision tower, 2-layer GELU projector, Llama
  language model) trained end to end on assistant tokens only.

Conversations are formatted exactly as the rest of the project formats them
(``msd_train.targets.chat.render_segments`` with the Vicuna-v1 template, then
``msd_train.targets.tokenize.encode_segments``).

Usage::

    python scripts/make_tiny_target.py                 # data (if missing) + tokenizer + model
    python scripts/make_tiny_target.py --remake-data   # regenerate data/tiny/ too
    python scripts/make_tiny_target.py --eval-only     # just print the quality numbers

At the end it prints the held-out assistant-token cross-entropy and the image-swap rate
(the share of held-out single-image questions whose greedy answer changes when the image
is replaced by another one); ``tests/test_tiny_target.py`` checks both.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import os
import random
import re
import shutil
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image, ImageDraw  # noqa: E402

from msd_train.targets.chat import VICUNA_V1, Segment, render_prompt, render_segments  # noqa: E402
from msd_train.targets.tokenize import encode_segments  # noqa: E402

IMAGE_TOKEN = "<image>"
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", IMAGE_TOKEN]
TEMPLATE = "vicuna_v1"

# Model geometry. 48 px images cut into 8 px patches: a 6x6 grid, 36 visual tokens per
# image once CLIP's class token is dropped (vision_feature_select_strategy="default").
IMAGE_SIZE = 48
PATCH_SIZE = 8
GRID = IMAGE_SIZE // PATCH_SIZE
TOKENS_PER_IMAGE = GRID * GRID
VOCAB_SIZE = 2048

# --------------------------------------------------------------------------------------
# Text data: Python's standard library
# --------------------------------------------------------------------------------------

STDLIB_MODULES = """
abc argparse array ast base64 bisect builtins calendar cmath cmd codecs collections
colorsys configparser contextlib copy csv dataclasses datetime decimal difflib dis
email.utils enum filecmp fnmatch fractions ftplib functools getopt gettext glob graphlib
gzip hashlib heapq hmac html html.parser http.client http.cookies imaplib inspect io
ipaddress itertools json keyword linecache locale logging lzma mailbox math mimetypes
netrc numbers operator optparse pathlib pickle platform plistlib poplib pprint queue
quopri random re reprlib sched secrets selectors shelve shlex shutil smtplib socket
sqlite3 stat statistics string struct subprocess sysconfig tarfile tempfile textwrap
threading time timeit tokenize traceback types typing unittest urllib.parse
urllib.request uuid warnings wave weakref xml.dom.minidom xml.etree.ElementTree zipfile
zlib zoneinfo asyncio concurrent.futures multiprocessing doctest pdb profile pstats
trace tomllib
""".split()


def _first_sentence(doc: str) -> str | None:
    para = doc.strip().split("\n\n")[0]
    para = " ".join(line.strip() for line in para.splitlines())
    m = re.match(r"(.+?[.!?])(\s+[A-Z(`]|$)", para)
    if not m:
        return None
    s = m.group(1)
    words = s.split()
    if "->" in s or not s[0].isupper() or not s.isascii() or not 4 <= len(words) <= 40:
        return None
    return s


def _params(obj) -> list[str] | None:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    names = []
    for p in sig.parameters.values():
        if p.name in ("self", "cls") and not names:
            continue
        if p.kind is p.VAR_POSITIONAL:
            names.append("*" + p.name)
        elif p.kind is p.VAR_KEYWORD:
            names.append("**" + p.name)
        else:
            names.append(p.name)
    return names


def collect_stdlib() -> list[dict]:
    """Public functions, classes and methods of a fixed list of stdlib modules that have
    a usable one-sentence docstring. Sorted, hence deterministic for a Python version."""
    warnings.filterwarnings("ignore")
    out: dict[str, dict] = {}
    for mod_name in dict.fromkeys(STDLIB_MODULES):
        try:
            mod = importlib.import_module(mod_name)
        except Exception:  # pragma: no cover - a module missing on this platform
            continue
        short = mod_name.split(".")[-1]
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_"):
                continue
            if mod_name != "builtins" and getattr(obj, "__module__", None) not in (
                mod_name,
                "_" + short,
            ):
                continue
            if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
                continue
            items = [(f"{mod_name}.{name}", obj, None)]
            if inspect.isclass(obj):
                for mname, mobj in sorted(vars(obj).items()):
                    if mname.startswith("_"):
                        continue
                    if callable(mobj) or isinstance(mobj, (classmethod, staticmethod)):
                        items.append((f"{mod_name}.{name}.{mname}", getattr(obj, mname, mobj), name))
            for qual, o, cls in items:
                doc = o.__dict__.get("__doc__") if inspect.isclass(o) else o.__doc__
                if not isinstance(doc, str):
                    continue
                sentence = _first_sentence(inspect.cleandoc(doc))
                if sentence is None:
                    continue
                out[qual] = {
                    "qual": qual,
                    "module": mod_name,
                    "cls": cls,
                    "name": qual.rsplit(".", 1)[-1],
                    "kind": "class" if inspect.isclass(o) else ("method" if cls else "function"),
                    "doc": sentence,
                    "params": _params(o),
                }
    return [out[k] for k in sorted(out)]


ASK_DOES = [
    "What does `{q}` do?",
    "Explain `{q}` in one sentence.",
    "What is `{q}` for?",
    "Describe `{q}` briefly.",
]
ASK_WHERE = ["Which module is `{q}` in?", "Where is `{q}` defined?"]
ASK_PARAMS = ["What are the parameters of `{q}`?", "Which arguments does `{q}` take?"]
FOLLOW_WHERE = ["Which module is it in?", "Where is it defined?"]
FOLLOW_PARAMS = ["What are its parameters?", "And which arguments does it take?"]
FOLLOW_DOES = ["What does it do?", "And what is it for?"]
FOLLOW_REPEAT = ["Can you repeat that?", "Say that again, please."]


def _join(words: list[str]) -> str:
    if len(words) == 1:
        return words[0]
    return ", ".join(words[:-1]) + " and " + words[-1]


def answer_where(o: dict) -> str:
    if o["cls"]:
        return f"`{o['name']}` is a method of the `{o['cls']}` class in the `{o['module']}` module."
    what = "class" if o["kind"] == "class" else "function"
    return f"`{o['name']}` is a {what} in the `{o['module']}` module."


def answer_params(o: dict) -> str:
    ps = o["params"]
    if not ps:
        return f"`{o['qual']}` takes no parameters."
    if len(ps) == 1:
        return f"`{o['qual']}` takes one parameter, `{ps[0]}`."
    return f"`{o['qual']}` takes the parameters " + _join([f"`{p}`" for p in ps]) + "."


def text_conversation(o: dict, rng: random.Random) -> list[tuple[str, str]]:
    """One conversation about a stdlib object, as (question, answer) turns."""
    q = o["qual"]
    has_params = o["params"] is not None
    kinds = ["does", "does", "where", "params", "does+where", "does+where+params",
             "params+does", "does+repeat"]
    if not has_params:
        kinds = [k for k in kinds if "params" not in k]
    kind = rng.choice(kinds)
    turns: list[tuple[str, str]] = []
    for j, step in enumerate(kind.split("+")):
        if step == "does":
            ask = rng.choice(ASK_DOES if j == 0 else FOLLOW_DOES)
            turns.append((ask.format(q=q), o["doc"]))
        elif step == "where":
            ask = rng.choice(ASK_WHERE if j == 0 else FOLLOW_WHERE)
            turns.append((ask.format(q=q), answer_where(o)))
        elif step == "params":
            ask = rng.choice(ASK_PARAMS if j == 0 else FOLLOW_PARAMS)
            turns.append((ask.format(q=q), answer_params(o)))
        elif step == "repeat":
            turns.append((rng.choice(FOLLOW_REPEAT), turns[-1][1]))
    return turns


def _sharegpt(turns: list[tuple[str, str]]) -> list[dict]:
    conv = []
    for question, answer in turns:
        conv.append({"from": "human", "value": question})
        conv.append({"from": "gpt", "value": answer})
    return conv


# --------------------------------------------------------------------------------------
# Image data: rendered shapes and scikit-learn digits
# --------------------------------------------------------------------------------------

COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 160, 40),
    "blue": (30, 60, 220),
    "yellow": (230, 200, 0),
    "purple": (140, 40, 170),
    "orange": (245, 130, 0),
    "black": (20, 20, 20),
}
KINDS = ["circle", "square", "triangle", "cross"]
CELLS = ["top left", "top", "top right", "left", "centre", "right",
         "bottom left", "bottom", "bottom right"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
CELL = IMAGE_SIZE // 3


def draw_shape(d: ImageDraw.ImageDraw, kind: str, colour, cell: int, rng: random.Random) -> None:
    r0, c0 = divmod(cell, 3)
    size = rng.randint(9, 13)
    x0 = c0 * CELL + rng.randint(1, CELL - size - 1)
    y0 = r0 * CELL + rng.randint(1, CELL - size - 1)
    x1, y1 = x0 + size, y0 + size
    if kind == "circle":
        d.ellipse([x0, y0, x1, y1], fill=colour)
    elif kind == "square":
        d.rectangle([x0 + 1, y0 + 1, x1 - 1, y1 - 1], fill=colour)
    elif kind == "triangle":
        d.polygon([(x0 + size / 2, y0), (x0, y1), (x1, y1)], fill=colour)
    else:
        t = max(2, size // 4)
        mid = size // 2
        d.rectangle([x0 + mid - t // 2, y0, x0 + mid - t // 2 + t, y1], fill=colour)
        d.rectangle([x0, y0 + mid - t // 2, x1, y0 + mid - t // 2 + t], fill=colour)


def make_shapes_image(n: int, rng: random.Random):
    cells = sorted(rng.sample(range(9), n))
    shapes = [{"cell": c, "pos": CELLS[c], "colour": rng.choice(list(COLOURS)),
               "kind": rng.choice(KINDS)} for c in cells]
    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (255, 255, 255))
    d = ImageDraw.Draw(img)
    for s in shapes:
        draw_shape(d, s["kind"], COLOURS[s["colour"]], s["cell"], rng)
    return img, shapes


def make_digit_image(pixels: np.ndarray, colour: str) -> Image.Image:
    a = Image.fromarray((pixels * (255.0 / 16.0)).astype(np.uint8), mode="L")
    a = a.resize((40, 40), Image.BILINEAR)
    alpha = np.zeros((IMAGE_SIZE, IMAGE_SIZE), dtype=np.float32)
    alpha[4:44, 4:44] = np.asarray(a, dtype=np.float32) / 255.0
    ink = np.array(COLOURS[colour], dtype=np.float32)
    rgb = 255.0 * (1 - alpha[..., None]) + ink * alpha[..., None]
    return Image.fromarray(rgb.round().astype(np.uint8), mode="RGB")


def _a(kind: str) -> str:
    return "an" if kind[0] in "aeiou" else "a"


def _shape_phrase(s: dict, with_pos: bool = False) -> str:
    p = f"{_a(s['colour'])} {s['colour']} {s['kind']}"
    return p + (f" in the {s['pos']}" if with_pos else "")


def _count_phrase(n: int, noun: str = "shape") -> str:
    if n == 0:
        return f"no {noun}s"
    if n == 1:
        return f"one {noun}"
    return f"{NUMBER_WORDS[n]} {noun}s"


def shapes_question(meta: dict, rng: random.Random) -> tuple[str, str]:
    """A question about a shapes image whose answer depends on the image."""
    shapes = meta["shapes"]
    if len(shapes) == 1:
        s = shapes[0]
        kind = rng.choice(["colour", "kind", "where", "describe"])
        if kind == "colour":
            return "What colour is the shape?", f"The {s['kind']} is {s['colour']}."
        if kind == "kind":
            return rng.choice(["What shape is in the image?", "What shape is this?"]), \
                f"It is {_shape_phrase(s)}."
        if kind == "where":
            return "Where is the shape?", f"The {s['colour']} {s['kind']} is in the {s['pos']}."
        return rng.choice(["Describe the image.", "What do you see?"]), \
            f"I see {_shape_phrase(s, True)}."
    kind = rng.choice(["count", "count", "colour_at", "list", "count_colour", "is_there"])
    listing = _join([_shape_phrase(s) for s in shapes])
    if kind == "count":
        return "How many shapes are there?", \
            f"There are {_count_phrase(len(shapes))}: {listing}."
    if kind == "list":
        return rng.choice(["Describe the image.", "What do you see?"]), \
            "I see " + _join([_shape_phrase(s, True) for s in shapes]) + "."
    if kind == "colour_at":
        s = rng.choice(shapes)
        return f"What colour is the shape in the {s['pos']}?", \
            f"The {s['kind']} in the {s['pos']} is {s['colour']}."
    if kind == "count_colour":
        colour = rng.choice([s["colour"] for s in shapes] + list(COLOURS))
        same = [s for s in shapes if s["colour"] == colour]
        if not same:
            return f"How many {colour} shapes are there?", \
                f"There are no {colour} shapes. There are {_count_phrase(len(shapes))}: {listing}."
        verb = "is" if len(same) == 1 else "are"
        return f"How many {colour} shapes are there?", \
            f"There {verb} {_count_phrase(len(same), colour + ' shape')}: " + \
            _join([f"{_a(s['kind'])} {s['kind']} in the {s['pos']}" for s in same]) + "."
    colour = rng.choice(list(COLOURS))
    k = rng.choice(KINDS)
    match = [s for s in shapes if s["colour"] == colour and s["kind"] == k]
    if rng.random() < 0.5:  # ask about a shape that is there
        s = rng.choice(shapes)
        colour, k, match = s["colour"], s["kind"], [s]
    q = f"Is there {_a(colour)} {colour} {k}?"
    if match:
        return q, f"Yes, there is {_a(colour)} {colour} {k} in the {match[0]['pos']}."
    return q, f"No. The image shows {listing}."


def digit_question(meta: dict, rng: random.Random) -> tuple[str, str]:
    d, colour = meta["digit"], meta["colour"]
    kind = rng.choice(["which", "which", "colour"])
    if kind == "which":
        return rng.choice(["What digit is written in the image?", "Which number is this?"]), \
            f"It is the digit {d} ({NUMBER_WORDS[d]}), written in {colour}."
    return "What colour is the writing?", f"The digit {d} is written in {colour}."


def image_question(meta: dict, rng: random.Random) -> tuple[str, str]:
    return digit_question(meta, rng) if meta["type"] == "digit" else shapes_question(meta, rng)


def _describe(meta: dict) -> str:
    if meta["type"] == "digit":
        return f"the digit {meta['digit']} in {meta['colour']}"
    return _join([_shape_phrase(s) for s in meta["shapes"]])


def two_image_question(m1: dict, m2: dict, rng: random.Random) -> tuple[str, str]:
    if m1["type"] == "digit" and m2["type"] == "digit":
        a, b = m1["digit"], m2["digit"]
        if rng.random() < 0.5:
            q = "Which image shows the larger digit?"
            if a == b:
                return q, f"Both images show the digit {a}."
            which = "first" if a > b else "second"
            return q, f"The {which} image: it shows {max(a, b)} and the other shows {min(a, b)}."
        return "What is the sum of the two digits?", f"The digits are {a} and {b}, so the sum is {a + b}."
    if m1["type"] == "shapes" and m2["type"] == "shapes" and rng.random() < 0.6:
        n1, n2 = len(m1["shapes"]), len(m2["shapes"])
        q = "Which image has more shapes?"
        if n1 == n2:
            return q, f"Both images have {_count_phrase(n1)}."
        which = "first" if n1 > n2 else "second"
        return q, f"The {which} image has more shapes: the first has " \
            f"{_count_phrase(n1)} and the second has {_count_phrase(n2)}."
    return rng.choice(["What is the difference between the two images?",
                       "Describe both images."]), \
        f"The first image shows {_describe(m1)}, and the second shows {_describe(m2)}."


# --------------------------------------------------------------------------------------
# Building data/tiny/
# --------------------------------------------------------------------------------------


def make_data(data_dir: Path, seed: int, n_text: int, n_image: int) -> None:
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
    held_docs = set(docs[:160])  # held-out objects have docstrings never seen in training
    train_objs = [o for o in objs if o["doc"] not in held_docs]
    held_objs = [o for o in objs if o["doc"] in held_docs]
    held_objs = rng.sample(held_objs, min(len(held_objs), 150))

    def text_items(pool, n, prefix, held):
        items = []
        order = []
        while len(order) < n:  # every object once before any twice
            batch = list(pool)
            rng.shuffle(batch)
            order.extend(batch)
        for i, o in enumerate(order[:n]):
            item = {"id": f"{prefix}-{i}", "conversations": _sharegpt(text_conversation(o, rng))}
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
    held_didx, train_didx = didx[:120], didx[120:1320]

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

    train_imgs = make_images(1500, train_didx, "train")
    held_imgs = make_images(200, held_didx, "heldout")

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
                item = {"id": iid, "image": image, "conversations": _sharegpt(turns)}
                if held:
                    item["category"] = category
                items.append(item)
        return items

    n_multi = n_image * 3 // 20
    n_follow = n_image * 3 // 20
    n_mt = n_image * 2 // 20
    llava_train = image_items(
        train_imgs, train_objs,
        {"image_question": n_image - n_multi - n_follow - n_mt, "image_multiturn": n_mt,
         "image_followup": n_follow, "multi_image": n_multi}, "img", False)
    rng.shuffle(llava_train)
    # Held-out: each held-out single-image question gets its own image.
    llava_held = image_items(
        held_imgs, held_objs,
        {"image_question": 150, "image_followup": 50, "multi_image": 50}, "heldout", True)

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


def caption(meta: dict) -> str:
    """What a captioning model would say about an image: its ground truth in one sentence."""
    if meta["type"] == "digit":
        return f"The digit {meta['digit']}, written in {meta['colour']}."
    text = _join([_shape_phrase(s, True) for s in meta["shapes"]])
    return text[0].upper() + text[1:] + "."


def write_captions(data_dir: Path) -> Path:
    """data/tiny/captions_heldout.json: {image path: caption} for the held-out images, the
    captions that the ensemble variant C splices in place of the image (benchmark only)."""
    meta = json.loads((data_dir / "images" / "meta.json").read_text())
    caps = {path: caption(m) for path, m in sorted(meta.items()) if "heldout" in path}
    out = data_dir / "captions_heldout.json"
    out.write_text(json.dumps(caps, indent=1) + "\n")
    return out


# --------------------------------------------------------------------------------------
# Conversations -> model inputs (the project's own formatting)
# --------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------
# Tokenizer, processor, model
# --------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------
# Evaluation (the same numbers tests/test_tiny_target.py asserts)
# --------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------


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


def train(args) -> None:
    from tqdm import tqdm

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)

    data_dir = Path(args.data_dir)
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
    save(model, processor, Path(args.out))


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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(REPO / "data" / "tiny-llava"), help="model folder")
    p.add_argument("--data-dir", default=str(REPO / "data" / "tiny"), help="dataset folder")
    p.add_argument("--remake-data", action="store_true", help="regenerate the datasets")
    p.add_argument("--data-only", action="store_true", help="only (re)make the datasets")
    p.add_argument("--eval-only", action="store_true", help="only evaluate --out")
    p.add_argument("--captions-only", action="store_true",
                   help="only (re)write the held-out image captions from images/meta.json")
    p.add_argument("--no-eval", action="store_true", help="skip the evaluation after training")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=24)
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate of the LM")
    p.add_argument("--vision-lr-mult", type=float, default=0.1,
                   help="vision tower and projector learning rate, relative to --lr")
    p.add_argument("--vision-steps", type=int, default=400,
                   help="vision tower pretraining steps before the LLaVA training")
    p.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    p.add_argument("--n-text", type=int, default=3200, help="training text conversations")
    p.add_argument("--n-image", type=int, default=3600, help="training image conversations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=False,
                   help="bf16 autocast for the LLaVA training forward (fp32 weights and "
                        "optimizer state): quality alike, little faster here, slow on CPUs "
                        "without BF16 instructions; the committed weights are fp32-trained")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads; 1 is faster than 2 on a shared 2-core machine and "
                        "the committed weights were made with 1")
    args = p.parse_args(argv)

    data_dir, out = Path(args.data_dir), Path(args.out)
    if args.captions_only:
        print(f"wrote {write_captions(data_dir)}")
        return
    if args.eval_only:
        torch.set_num_threads(args.threads)
        evaluate(out, data_dir)
        return
    if args.remake_data or args.data_only or not (data_dir / "llava_train.json").exists():
        make_data(data_dir, args.seed, args.n_text, args.n_image)
    if args.data_only:
        return
    t0 = time.time()
    train(args)
    if not args.no_eval:
        evaluate(out, data_dir)
    print(f"total wall time {(time.time() - t0) / 60:.1f} min")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
