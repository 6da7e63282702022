"""A run's metrics.jsonl as committed: every validation line whole, every training line with only
the fields the tables read (step, loss, top1, mm_share, lr, tokens_per_s), gzipped without a
timestamp (the whole file is ~300 bytes a step; a 12,320-step run compacts to ~0.2 MB).

    python -m lab.studies.real_lm.compact_metrics IN.jsonl OUT.jsonl.gz

``lab/studies/real_lm/scale_collect.sh WORK RUN...`` calls it for each stage of the named runs.
"""

from __future__ import annotations

import argparse
import gzip
import json

KEEP = ("step", "loss", "top1", "mm_share", "lr", "tokens_per_s")


def compact(path_in, path_out) -> int:
    """Write the compacted copy; returns how many lines it holds."""
    n = 0
    with open(path_in) as src, gzip.GzipFile(path_out, "wb", mtime=0) as raw:
        for line in src:
            if not line.strip():
                continue
            r = json.loads(line)
            if not any(k.startswith("val/") for k in r):
                r = {k: (float(f"{r[k]:.5g}") if isinstance(r[k], float) else r[k]) for k in KEEP if k in r}
            raw.write((json.dumps(r) + "\n").encode())
            n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="a run's stageN/metrics.jsonl")
    ap.add_argument("out", help="where the compacted .jsonl.gz goes")
    a = ap.parse_args()
    print(f"{a.out}: {compact(a.src, a.out)} lines")


if __name__ == "__main__":
    main()
