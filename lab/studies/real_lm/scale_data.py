"""The scale data's regenerated conversations, committed compressed (data/smollm2-llava-regen/).

    python -m lab.studies.real_lm.scale_data pack WORK        # WORK/regen_*/rank-*.jsonl -> data/smollm2-llava-regen/*.jsonl.xz
    python -m lab.studies.real_lm.scale_data unpack WORK      # the reverse: the regeneration then resumes from them

The regeneration (data/README.md, "The scale data": three scripts/regenerate_data.py runs into
WORK/regen_img, regen_img_describe and regen_text) answers thousands of conversations in the
background over hours; a session that ends kills it. Packing keeps what is done in the repository: each
record without its ``original`` messages (ShareGPT's answers are recovered from the prefix
file by ``source`` and ``index``; easy-VQA's placeholders are not needed), image paths made
relative to the easy-VQA folder that ``lab/targets/make_smollm2_llava.py`` unpacks. Unpacking
writes the records back as the rank file of the regeneration folder, with the image paths
of this machine, so relaunching the same regenerate_data.py commands answers only what is missing (records
are matched by their content key, not by position).
"""

from __future__ import annotations

import json
import lzma
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
OUT = ROOT / "data" / "smollm2-llava-regen"
EASY_VQA = Path("~/.cache/msd-train/smollm2/easy_vqa-1.0-py3-none-any").expanduser()
PARTS = {"regen_img": "images.jsonl.xz", "regen_img_describe": "images-describe.jsonl.xz", "regen_text": "text.jsonl.xz"}
KEEP = ("id", "n", "key", "messages", "images", "source", "index", "regenerated")


def _relative(path: str) -> str:
    p = Path(path)
    try:
        return "easy_vqa:" + str(p.relative_to(EASY_VQA))
    except ValueError:
        return path


def _absolute(path: str) -> str:
    return str(EASY_VQA / path.removeprefix("easy_vqa:")) if path.startswith("easy_vqa:") else path


def _source(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return path


def pack(work: Path) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for folder, name in PARTS.items():
        records = {}
        for f in sorted((work / folder).glob("rank-*.jsonl")):
            for line in f.read_text(encoding="utf-8").splitlines(keepends=True):
                if line.endswith("\n"):
                    r = json.loads(line)
                    records.setdefault(r["key"], r)
        if not records:
            continue
        rows = []
        for r in sorted(records.values(), key=lambda r: r["n"]):
            slim = {k: r[k] for k in KEEP if k in r}
            slim["images"] = [_relative(p) for p in r.get("images") or []]
            slim["source"] = _source(r.get("source"))
            slim["regenerated"] = {k: v for k, v in r["regenerated"].items() if k != "seconds"}
            rows.append(json.dumps(slim, ensure_ascii=False) + "\n")
        tmp = OUT / (name + ".tmp")
        with lzma.open(tmp, "wt", encoding="utf-8", preset=9) as fh:
            fh.writelines(rows)
        tmp.replace(OUT / name)
        print(f"{len(rows)} conversations of {work / folder} -> {OUT / name} ({(OUT / name).stat().st_size / 2**20:.1f} MiB)")


def unpack(work: Path) -> None:
    for folder, name in PARTS.items():
        src = OUT / name
        if not src.is_file():
            continue
        dest = work / folder / "rank-0.jsonl"
        if dest.exists():
            raise SystemExit(f"{dest} exists: unpack writes a new regeneration folder; give another WORK")
        dest.parent.mkdir(parents=True, exist_ok=True)
        n = 0
        with lzma.open(src, "rt", encoding="utf-8") as fh, open(dest, "w", encoding="utf-8") as out:
            for line in fh:
                r = json.loads(line)
                r["images"] = [_absolute(p) for p in r["images"]]
                if r.get("source") and not Path(r["source"]).is_absolute():
                    r["source"] = str(ROOT / r["source"])
                out.write(json.dumps(r, ensure_ascii=False) + "\n")
                n += 1
        print(f"{n} conversations -> {dest}")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("pack", "unpack"), help="pack: WORK -> data/smollm2-llava-regen; unpack: back")
    parser.add_argument("work", type=Path, help="the scale work folder")
    args = parser.parse_args()
    {"pack": pack, "unpack": unpack}[args.mode](args.work)
