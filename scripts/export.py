#!/usr/bin/env python
"""Export a head: this project's folder, or the released MSD layout.

    python scripts/export.py checkpoint=runs/tiny/stage2/final format=msd out=heads/tiny dtype=bf16
    python scripts/export.py checkpoint=heads/tiny format=reference target=tiny out=heads/tiny-reference

format=reference writes config.json + model.safetensors (weights=bin: pytorch_model.bin)
with embed_tokens.weight taken from embed_from=, target=, or the folder the head was
imported from. See docs/hub.md.
"""

import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from msd_train.hub.cli import parse_args, resolve_target  # noqa: E402


def main(argv=None) -> None:
    cfg = parse_args("export", argv, __doc__)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from msd_train.hub import export_msd, export_reference

    target, _ = resolve_target(cfg.target)
    if cfg.format == "msd":
        summary = export_msd(cfg.checkpoint, cfg.out, target=target, dtype=cfg.dtype)
    elif cfg.format == "reference":
        summary = export_reference(cfg.checkpoint, cfg.out, target=target, embed_from=cfg.embed_from,
                                   weights=cfg.weights, vocab_size=cfg.vocab_size)
    else:
        raise SystemExit(f"format={cfg.format}: use msd or reference")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
