#!/usr/bin/env python
"""Build the embedded default target: a tiny, *trained* LLaVA, and the small datasets it
was trained on. The builder is ``lab.tiny`` (the data recipe: ``lab/tiny/data.py``).

Usage::

    python -m lab.targets.make_tiny_target                 # data (if missing) + tokenizer + model
    python -m lab.targets.make_tiny_target --remake-data   # regenerate data/tiny/ too
    python -m lab.targets.make_tiny_target --eval-only     # just print the quality numbers

At the end it prints the held-out assistant-token cross-entropy and the image-swap rate
(the share of held-out single-image questions whose greedy answer changes when the image
is replaced by another one); ``tests/lab_tools/test_tiny_target.py`` checks both.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from lab.cli import at_least
from lab.tiny.data import N_IMAGE, N_TEXT, make_data, write_captions
from lab.tiny.model import TrainSettings, train
from lab.tiny.quality import evaluate
from msd_train.config import REPO_ROOT


def main(argv=None) -> None:
    d = TrainSettings()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(REPO_ROOT / "data" / "tiny-llava"), help="model folder")
    p.add_argument("--data-dir", default=str(REPO_ROOT / "data" / "tiny"), help="dataset folder")
    p.add_argument("--remake-data", action="store_true", help="regenerate the datasets")
    p.add_argument("--data-only", action="store_true", help="only (re)make the datasets")
    p.add_argument("--eval-only", action="store_true", help="only evaluate --out")
    p.add_argument("--captions-only", action="store_true",
                   help="only (re)write the held-out image captions from images/meta.json")
    p.add_argument("--no-eval", action="store_true", help="skip the evaluation after training")
    p.add_argument("--steps", type=at_least(1), default=d.steps)
    p.add_argument("--batch-size", type=at_least(1), default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate of the LM")
    p.add_argument("--vision-lr-mult", type=float, default=d.vision_lr_mult,
                   help="vision tower and projector learning rate, relative to --lr")
    p.add_argument("--vision-steps", type=at_least(1), default=d.vision_steps,
                   help="vision tower pretraining steps before the LLaVA training")
    p.add_argument("--vocab-size", type=at_least(1), default=d.vocab_size)
    p.add_argument("--n-text", type=at_least(1), default=N_TEXT, help="training text conversations")
    p.add_argument("--n-image", type=at_least(1), default=N_IMAGE, help="training image conversations")
    p.add_argument("--seed", type=at_least(0), default=d.seed)
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=d.bf16,
                   help="bf16 autocast for the LLaVA training forward (fp32 weights and "
                        "optimizer state): quality alike, little faster here, slow on CPUs "
                        "without BF16 instructions; the committed weights are fp32-trained")
    p.add_argument("--threads", type=at_least(1), default=d.threads,
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
    settings = TrainSettings(steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                             vision_lr_mult=args.vision_lr_mult, vision_steps=args.vision_steps,
                             vocab_size=args.vocab_size, seed=args.seed, bf16=args.bf16, threads=args.threads)
    train(data_dir, out, settings)
    if not args.no_eval:
        evaluate(out, data_dir)
    print(f"total wall time {(time.time() - t0) / 60:.1f} min")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from msd_train.errors import run_main

    run_main(main)  # a known failure (a missing path, a full disk, Ctrl-C): one line, exit non-zero
