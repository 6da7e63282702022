"""Image prompts for stage 2 on the SmolLM2 target, and held-out image questions.

    python -m lab.studies.real_lm.make_image_data OUT_DIR [--n-train 120] [--questions | --describe]

OUT_DIR gets
  train_prompts.jsonl  easy-VQA training images (the first --n-train, one per image) with an
                       open request ("Describe this image." and three others in turn); the
                       assistant turn is easy-VQA's answer to one of the image's questions, a
                       placeholder that scripts/regenerate_data.py replaces with the target's answer
  bench_images.jsonl   held-out image questions: photographs of scikit-image (category
                       "photo", saved to OUT_DIR/photos/) and easy-VQA *test* images
                       (category "shapes"), none of them trained on
The target's vision side knows coloured shapes only (data/README.md), so its answers about
photographs are its own guesses: still the distribution a head must predict.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lab.targets.make_smollm2_llava import vqa_pairs

#: --describe: requests for a description and an explanation, which the target answers at length
#: (its answers to REQUESTS and easy-VQA's questions average 8.8 tokens: little to draft)
DESCRIBE = ("Describe this image in detail, then explain where one might see a shape like this.",
            "What shape and colour do you see in this picture? Write a few sentences about them.",
            "Look at the image and describe it. Then explain what the colour of the shape could mean.",
            "Describe the shape in this image, then name three everyday objects that have the same shape and say why.",
            "Write a short paragraph describing this image for someone who cannot see it.")
#: --describe: the second user turn, a text follow-up on the image's answer (the image stays in context)
FOLLOW_UPS = ("Tell me more about it: where might one see it, and what could it mean?",
              "Can you explain that in more detail?",
              "Why do you think so? Explain your answer step by step.",
              "Write a short story about what you described.")
REQUESTS = ("Describe this image.", "What do you see in this picture?", "Describe the shape in the image in detail.",
            "What is in this image? Explain.")
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "camera", "coins")  # shipped with scikit-image (no download)
EASY_VQA = Path("~/.cache/msd-train/smollm2/easy_vqa-1.0-py3-none-any").expanduser()


def images_with_answers(root: Path, split: str) -> list[tuple[str, str]]:
    """(image path, its first open answer) per image of an easy-VQA split, in image order
    (the projector's reader of the same file: make_smollm2_llava.vqa_pairs)."""
    return [(path, answer) for path, _, answer in images_with_questions(root, split)]


def images_with_questions(root: Path, split: str) -> list[tuple[str, str, str]]:
    """(image path, its first open question, that question's answer) per image, in image order."""
    first: dict[str, tuple[str, str]] = {}
    for path, question, answer in vqa_pairs(root, split, open_only=True):
        first.setdefault(path, (question, answer))
    return sorted(((p, q, a) for p, (q, a) in first.items()), key=lambda item: int(Path(item[0]).stem))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--n-train", type=int, default=120)
    ap.add_argument("--n-shapes", type=int, default=4, help="held-out easy-VQA test images")
    ap.add_argument("--questions", action="store_true",
                    help="every other training image gets its own easy-VQA question instead of an open request")
    ap.add_argument("--describe", action="store_true",
                    help="every training image gets a request for a description and an explanation (DESCRIBE) and a "
                         "text follow-up (FOLLOW_UPS): two exchanges")
    ap.add_argument("--easy-vqa", default=str(EASY_VQA), help="the unpacked easy-vqa wheel (lab/targets/make_smollm2_llava.py)")
    a = ap.parse_args()
    out = Path(a.out)
    (out / "photos").mkdir(parents=True, exist_ok=True)
    root = Path(a.easy_vqa)
    with open(out / "train_prompts.jsonl", "w", encoding="utf-8") as fh:
        for k, (path, question, answer) in enumerate(images_with_questions(root, "train")[: a.n_train]):
            if a.describe:
                ask = DESCRIBE[k % len(DESCRIBE)]
            else:
                ask = question if a.questions and k % 2 else REQUESTS[(k // 2 if a.questions else k) % len(REQUESTS)]
            msgs = [{"role": "user", "content": "<image>\n" + ask},
                    {"role": "assistant", "content": answer}]
            if a.describe:  # a second exchange, answered at length with the image still in context
                msgs += [{"role": "user", "content": FOLLOW_UPS[k % len(FOLLOW_UPS)]},
                         {"role": "assistant", "content": answer}]
            fh.write(json.dumps({"id": f"easyvqa-{'describe' if a.describe else 'train'}-{k}", "messages": msgs, "images": [path]}) + "\n")

    import skimage.data
    from PIL import Image

    bench = []
    for k, name in enumerate(PHOTOS):
        img = Image.fromarray(getattr(skimage.data, name)()).convert("RGB")
        path = out / "photos" / f"{name}.png"
        img.save(path)
        bench.append({"id": f"photo-{name}", "image": str(path), "turns": [REQUESTS[k % 2]], "category": "photo"})
    for k, (path, _) in enumerate(images_with_answers(root, "test")[: a.n_shapes]):
        bench.append({"id": f"easyvqa-test-{k}", "image": path, "turns": [REQUESTS[k % 2]], "category": "shapes"})
    with open(out / "bench_images.jsonl", "w", encoding="utf-8") as fh:
        for r in bench:
            fh.write(json.dumps(r) + "\n")
    print(f"{min(a.n_train, len(images_with_questions(root, 'train')))} training prompts, {len(bench)} held-out image questions -> {out}")


if __name__ == "__main__":
    main()
