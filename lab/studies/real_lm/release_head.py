"""Commit a trained head as the release under ``data/``: the product's bf16 export of a run's
head (``scripts/export.py format=msd dtype=bf16``), with the paths of the machine that trained
it taken out of its ``training.json`` (the work folder becomes ``WORK``, the checkout the run
launched from becomes relative), so what users load names no folder of ours.

    python -m lab.studies.real_lm.release_head RUN/stage2/final data/smollm2-llava-heads/msd-stage2 \\
        --work WORK [--checkout DIR] [--replace]

DEST must be empty or missing; with ``--replace`` the head files a release holds
(``config.json``, ``model.safetensors``, ``token_counts.safetensors``, ``training*.json``) are
replaced and nothing else in DEST is touched (git keeps the old head). Refused, before DEST
changes: a path of the machine left in ``training.json`` after the rewrite (named), a head
folder without ``training.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from lab.portable import machine_paths, portable

ROOT = Path(__file__).resolve().parents[3]
RELEASE_FILES = ("config.json", "model.safetensors", "token_counts.safetensors")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("head", type=Path, help="a run's head folder (RUN/stage2/final or RUN/stage2/best)")
    p.add_argument("dest", type=Path, help="the release folder (data/smollm2-llava-heads/msd-stage2)")
    p.add_argument("--work", required=True, help="the experiment's work folder the run read (recipe.work)")
    p.add_argument("--checkout", default=str(ROOT), help="the checkout the run launched from (default: this one)")
    p.add_argument("--replace", action="store_true", help="replace the head files of a release already in DEST")
    a = p.parse_args(argv)
    if not (a.head / "training.json").is_file():
        raise SystemExit(f"release_head: {a.head} has no training.json; give a run's head folder (RUN/stage2/final)")
    held = sorted(f.name for f in a.dest.iterdir()) if a.dest.is_dir() else []
    if held and not a.replace:
        raise SystemExit(f"release_head: {a.dest} holds {', '.join(held)}; add --replace to replace its head files")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "head"
        subprocess.run([sys.executable, "scripts/export.py", f"checkpoint={a.head}", "format=msd", "dtype=bf16",
                        f"out={out}"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        training = portable(json.loads((out / "training.json").read_text()), {a.work: "WORK"}, a.checkout)
        left = machine_paths(training)
        if left:
            raise SystemExit("release_head: training.json still names paths of this machine after the rewrite "
                             f"(give --work / --checkout for them): {'; '.join(left[:5])}")
        a.dest.mkdir(parents=True, exist_ok=True)
        for f in held:
            if f in RELEASE_FILES or (f.startswith("training") and f.endswith(".json")):
                (a.dest / f).unlink()
        for name in RELEASE_FILES:
            (a.dest / name).write_bytes((out / name).read_bytes())
        (a.dest / "training.json").write_text(json.dumps(training, indent=1) + "\n")
    print(f"release_head: {a.dest} <- {a.head} (bf16; training.json: {a.work} -> WORK)")


if __name__ == "__main__":
    main()
