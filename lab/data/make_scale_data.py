#!/usr/bin/env python
"""Write a synthetic copy of the MSD recipe's data at its real shape and size: no user data
needed to measure the data path at scale (``lab/bench/data_scale.py``).

Usage::

    python -m lab.data.make_scale_data OUT                 # 665k LLaVA-mix + 68k ShareGPT records
    python -m lab.data.make_scale_data OUT --n 20000       # 20k mix records (ShareGPT scaled: ~2k)

``OUT`` (created; refused when it exists and is not empty) gets, deterministically from
``--seed``:

* ``llava_mix.json``: LLaVA-1.5 ``llava_v1_5_mix665k.json``-like records (``id``, ``image``
  relative to ``images/``, ``conversations``): 1 to 20 exchanges (most 1-3; a tail of
  OCR-VQA-style long lists), short VQA answers and long descriptions, ~6% text-only records
  (40k of 665k, no ``image``);
* ``sharegpt.json``: ShareGPT-like text conversations (``--n-text``, default 68k at full
  scale): 1 to 12 exchanges of long answers;
* ``images/{coco/train2017,gqa/images,ocr_vqa/images,textvqa/train_images,vg/VG_100K}/``:
  ``--images`` distinct JPEGs at real sizes (half 640x480, the rest COCO/VG/OCR-VQA-like
  sizes), reused by the records;
* a few bad records in the mix (``--bad`` of each kind): an image that does not exist, a
  truncated JPEG, an empty turn;
* ``manifest.json``: the counts and the arguments.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

FOLDERS = ["coco/train2017", "gqa/images", "ocr_vqa/images", "textvqa/train_images", "vg/VG_100K"]
# (width, height) and weight: COCO/GQA/VG photos are mostly 640 wide, OCR-VQA covers are tall
SIZES = [((640, 480), 50), ((640, 427), 10), ((480, 640), 8), ((500, 375), 8), ((800, 600), 6), ((1024, 768), 5),
         ((336, 336), 3), ((1280, 720), 3), ((300, 450), 4), ((640, 640), 3)]
FULL_MIX, FULL_TEXT, FULL_TEXT_ONLY = 665_000, 68_000, 40_000
WORDS = ("the a of and to in is on with for at by from that this what which how image picture shows there are two "
         "man woman person people dog cat car bus street table room building sky tree water sign book cover title "
         "author color red blue green white black yellow left right top bottom front behind next large small many "
         "standing sitting holding wearing looking playing riding walking near under over into while it its their "
         "number text written word letter answer question describe detail scene background foreground light dark "
         "function code python data value list string return error file system model train time year first second "
         "because however therefore example result method class object user server network memory process thread "
         "approximately several various important different possible following information provide explain").split()
QUESTIONS = ["What is the {} in the image?", "Is there a {} in the picture?", "What color is the {}?",
             "How many {} are there?", "Where is the {} located?", "What is written on the {}?",
             "Describe the image in detail.", "What is happening in this scene?", "Who is the author of this book?",
             "What is the title of this book?", "Is this a {} book?", "What type of {} is shown?"]


def check_args(args) -> None:
    """Every argument checked before any work: a message naming the argument and the fix."""
    if args.n < 1:
        sys.exit(f"--n {args.n}: give at least 1 record")
    if args.n_text is not None and args.n_text < 0:
        sys.exit(f"--n-text {args.n_text}: give 0 or more")
    if args.images < 1:
        sys.exit(f"--images {args.images}: give at least 1 distinct image")
    if args.bad < 0 or 3 * args.bad > args.n:
        sys.exit(f"--bad {args.bad}: give between 0 and n/3 bad records of each kind")
    if not 0.0 <= args.text_only_share < 1.0:
        sys.exit(f"--text-only-share {args.text_only_share}: give a share in [0, 1)")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        sys.exit(f"{out}: exists and is not an empty folder; give a new folder")


class Text:
    """Deterministic text from a pool of sentences (cheap to draw hundreds of millions of words)."""

    def __init__(self, rng: random.Random, pool: int = 20000):
        self.rng = rng
        self.sentences = [" ".join(rng.choices(WORDS, k=rng.randint(4, 24))).capitalize() + "."
                          for _ in range(pool)]

    def words(self, lo: int, hi: int) -> str:
        """About ``lo``..``hi`` words."""
        n, out, k = self.rng.randint(lo, hi), [], 0
        while k < n:
            s = self.rng.choice(self.sentences)
            out.append(s)
            k += s.count(" ") + 1
        return " ".join(out)

    def question(self) -> str:
        return self.rng.choice(QUESTIONS).format(self.rng.choice(WORDS))


def exchanges(rng: random.Random) -> int:
    """Exchanges of a mix record: most 1-3 (VQA, captions), some conversations, a long tail."""
    r = rng.random()
    if r < 0.45:
        return 1
    if r < 0.75:
        return rng.randint(2, 3)
    if r < 0.92:
        return rng.randint(4, 8)
    return rng.randint(9, 20)


def mix_record(i: int, rng: random.Random, text: Text, image: str | None) -> dict:
    turns = []
    for k in range(exchanges(rng)):
        q = text.question() if rng.random() < 0.7 else text.words(8, 40)
        a = text.words(1, 6) if rng.random() < 0.5 else text.words(20, 160)
        if k == 0 and image is not None:
            q = f"<image>\n{q}" if rng.random() < 0.9 else f"{q}\n<image>"
        turns += [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
    rec = {"id": f"{i:012d}", "conversations": turns}
    if image is not None:
        rec["image"] = image
        rec["model"] = ""
    return rec


def sharegpt_record(i: int, rng: random.Random, text: Text) -> dict:
    turns = []
    for _ in range(min(1 + int(rng.expovariate(1 / 2.5)), 12)):
        turns += [{"from": "human", "value": text.words(5, 80)}, {"from": "gpt", "value": text.words(40, 400)}]
    return {"id": f"sg{i:07d}_0", "conversations": turns}


def write_images(root: Path, n: int, seed: int) -> list[str]:
    """``n`` JPEGs of real sizes and photo-like compressed size (smooth colour fields + noise)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    pick = random.Random(seed)
    sizes, weights = zip(*SIZES)
    names = []
    for i in range(n):
        folder = FOLDERS[i % len(FOLDERS)]
        (root / folder).mkdir(parents=True, exist_ok=True)
        w, h = pick.choices(sizes, weights)[0] if i % 7 else (pick.randint(200, 1200), pick.randint(200, 1000))
        small = rng.integers(0, 255, (max(h // 40, 2), max(w // 40, 2), 3), dtype=np.uint8)
        big = np.asarray(Image.fromarray(small).resize((w, h), Image.BILINEAR), dtype=np.int16)
        big = np.clip(big + rng.integers(-12, 12, big.shape, dtype=np.int16), 0, 255).astype(np.uint8)
        name = f"{folder}/{i:08d}.jpg"
        Image.fromarray(big).save(root / name, quality=85)
        names.append(name)
    return names


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="folder to create (refused when it exists and is not empty)")
    p.add_argument("--n", type=int, default=FULL_MIX, help="LLaVA-mix records (default: 665,000)")
    p.add_argument("--n-text", type=int, default=None,
                   help="ShareGPT records (default: 68,000 scaled by n / 665,000)")
    p.add_argument("--images", type=int, default=3000, help="distinct JPEGs the records reuse")
    p.add_argument("--text-only-share", type=float, default=FULL_TEXT_ONLY / FULL_MIX,
                   help="share of text-only records in the mix (default 40k of 665k)")
    p.add_argument("--bad", type=int, default=3, help="bad records of each kind in the mix")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    check_args(args)
    n_text = args.n_text if args.n_text is not None else round(FULL_TEXT * args.n / FULL_MIX)

    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    images = write_images(out / "images", args.images, args.seed)
    # bad images: a few truncated copies (a download cut short)
    truncated = []
    for k in range(min(args.bad, len(images))):
        src = out / "images" / images[k]
        name = str(Path(images[k]).with_name(f"truncated_{k}.jpg"))
        data = src.read_bytes()
        (out / "images" / name).write_bytes(data[: len(data) // 2])
        truncated.append(name)

    rng = random.Random(args.seed)
    text = Text(random.Random(args.seed + 1))
    bad_at = {}
    slots = rng.sample(range(args.n), 3 * args.bad)
    for k, i in enumerate(slots):
        bad_at[i] = ("missing", "truncated", "empty")[k % 3]
    counts = {"records": args.n, "text_only": 0, "with_image": 0, "bad_missing_image": 0, "bad_truncated_image": 0,
              "bad_empty_turn": 0}
    with open(out / "llava_mix.json", "w") as f:
        f.write("[\n")
        for i in range(args.n):
            kind = bad_at.get(i)
            if kind == "missing":
                image = f"{FOLDERS[0]}/missing_{i}.jpg"
            elif kind == "truncated":
                image = truncated[i % len(truncated)] if truncated else images[0]
            elif rng.random() < args.text_only_share:
                image = None
            else:
                image = images[rng.randrange(len(images))]
            rec = mix_record(i, rng, text, image)
            if kind == "empty":
                rec["conversations"][1]["value"] = ""
            counts["text_only" if image is None else "with_image"] += 1
            if kind:
                counts[{"missing": "bad_missing_image", "truncated": "bad_truncated_image",
                        "empty": "bad_empty_turn"}[kind]] += 1
            f.write(json.dumps(rec) + (",\n" if i + 1 < args.n else "\n"))
        f.write("]\n")
    trng = random.Random(args.seed + 2)
    with open(out / "sharegpt.json", "w") as f:
        f.write("[\n")
        for i in range(n_text):
            f.write(json.dumps(sharegpt_record(i, trng, text)) + (",\n" if i + 1 < n_text else "\n"))
        f.write("]\n")
    manifest = {"args": vars(args), "mix": counts, "sharegpt_records": n_text, "images": len(images),
                "truncated_images": truncated,
                "bytes": {p.name: p.stat().st_size for p in (out / "llava_mix.json", out / "sharegpt.json")},
                "seconds": round(time.time() - t0, 1)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(json.dumps(manifest, indent=1))


if __name__ == "__main__":
    main()
