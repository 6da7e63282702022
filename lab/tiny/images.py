"""Images of the tiny target and the questions about them: coloured shapes on a 3x3 grid
and scikit-learn's handwritten digits (``load_digits``, no download), rendered as small
PNGs, with answers that depend on what is drawn."""

from __future__ import annotations

import random

import numpy as np
from PIL import Image, ImageDraw

from lab.tiny.text import join_words

IMAGE_TOKEN = "<image>"  # an image's place in a conversation turn (LLaVA-Instruct format)

# Model geometry. 48 px images cut into 8 px patches: a 6x6 grid, 36 visual tokens per
# image once CLIP's class token is dropped (vision_feature_select_strategy="default").
IMAGE_SIZE = 48
PATCH_SIZE = 8
GRID = IMAGE_SIZE // PATCH_SIZE
TOKENS_PER_IMAGE = GRID * GRID

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
    listing = join_words([_shape_phrase(s) for s in shapes])
    if kind == "count":
        return "How many shapes are there?", \
            f"There are {_count_phrase(len(shapes))}: {listing}."
    if kind == "list":
        return rng.choice(["Describe the image.", "What do you see?"]), \
            "I see " + join_words([_shape_phrase(s, True) for s in shapes]) + "."
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
            join_words([f"{_a(s['kind'])} {s['kind']} in the {s['pos']}" for s in same]) + "."
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
    return join_words([_shape_phrase(s) for s in meta["shapes"]])


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


def caption(meta: dict) -> str:
    """What a captioning model would say about an image: its ground truth in one sentence."""
    if meta["type"] == "digit":
        return f"The digit {meta['digit']}, written in {meta['colour']}."
    text = join_words([_shape_phrase(s, True) for s in meta["shapes"]])
    return text[0].upper() + text[1:] + "."
