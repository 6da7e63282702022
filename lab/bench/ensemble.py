"""Ensemble drafting on the tiny benchmark: tau of each input variant alone, IbED and TABED,
per category and overall, and the drafting-time overhead of the ensembles over M alone.

    python -m lab.bench.ensemble                              # runs/tiny/stage2/final, chain k=5, M,T,P
    python -m lab.bench.ensemble --method tree --variants M,T,P,C
    python -m lab.bench.ensemble --draft PATH --k 4 --variants M,T --max-per-category 4

Greedy decoding (outputs of every configuration must be identical: checked). Writes
benchmarks/ensemble/<name>.json and .md, with the command that produced them.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from lab.cli import at_least
from msd_train.config import CONF_DIR
from msd_train.decoding import DecodeConfig
from msd_train.evaluation import load_bench
from msd_train.evaluation.ensemble import (
    ensemble_table,
    run_variants,
    summarize_variants,
    variant_configs,
)
from msd_train.evaluation.run import describe_device

ROOT = Path(__file__).resolve().parents[2]


def _conf(name: str) -> dict:
    """A conf/ file as a dict, ``${msd_root:}`` resolved as the recipe does."""
    return OmegaConf.to_container(OmegaConf.load(CONF_DIR / name), resolve=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default=str(ROOT / "runs/tiny/stage2/final"))
    ap.add_argument("--method", choices=["chain", "tree"], default="chain")
    ap.add_argument("--k", type=at_least(1), default=5, help="chain: draft tokens per cycle")
    ap.add_argument("--tree", default="5,10,60", help="tree: depth,top_k,total_tokens (conf/decoding/tree.yaml's)")
    ap.add_argument("--variants", default="M,T,P")
    ap.add_argument("--max-per-category", type=at_least(1), default=None, help="default: conf/bench/tiny.yaml's")
    ap.add_argument("--max-new-tokens", type=at_least(1), default=64)
    ap.add_argument("--tabed-window", type=at_least(1), default=32)
    ap.add_argument("--warmup", type=at_least(0), default=1)
    ap.add_argument("--threads", type=at_least(1), default=None)
    ap.add_argument("--name", default="tiny")
    ap.add_argument("--per-turn", action="store_true",
                    help="also write each configuration's accepted-token sequence per turn (cycle by cycle)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not Path(args.draft).is_dir():
        sys.exit(f"--draft {args.draft}: no such folder; train the tiny head with "
                 "`python train.py stage=1 && python train.py stage=2` or pass --draft PATH")

    from msd_train.hub.load import load_head
    from msd_train.targets import load_target

    bench = _conf("bench/tiny.yaml")
    if args.max_per_category is not None:
        bench["max_per_category"] = args.max_per_category
    items = load_bench(bench)
    tc = _conf("target/tiny.yaml")
    target = load_target(tc["name_or_path"], "auto", "cpu")
    draft = load_head(args.draft, target)

    variants = tuple(args.variants.split(","))
    depth, top_k, total = (int(x) for x in args.tree.split(","))
    shape = dict(k=args.k) if args.method == "chain" else dict(depth=depth, top_k=top_k, total_tokens=total)
    base = DecodeConfig(method=args.method, max_new_tokens=args.max_new_tokens, tabed_window=args.tabed_window,
                        ensemble="ibed", variants=variants, **shape)
    configs = variant_configs(base)  # M, T, P alone, then ibed
    configs.update({k: v for k, v in variant_configs(dataclasses.replace(base, ensemble="tabed")).items()
                    if k not in configs})
    rows = run_variants(target, draft, items, configs, warmup=args.warmup, progress=True)
    summary = summarize_variants(rows)

    command = " ".join(["python", "-m", "lab.bench.ensemble", *sys.argv[1:]])
    result = {
        "command": command, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "draft": os.path.relpath(args.draft, ROOT), "target": tc["name_or_path"].replace(str(ROOT) + "/", ""),
        "device": describe_device(torch.device("cpu")), "load_average": os.getloadavg(),
        "decoding": {"method": args.method, **shape, "greedy": True, "max_new_tokens": args.max_new_tokens,
                     "tabed_window": args.tabed_window},
        "items": len(items), "turns": len(rows["M" if "M" in rows else next(iter(rows))]),
        **summary,
    }
    if args.per_turn:
        result["accepted_per_turn"] = {name: [{"id": r["id"], "category": r["category"],
                                               "accepted": "".join(str(a) for a in r["accepted"])} for r in rs]
                                       for name, rs in rows.items()}
    out = ROOT / "benchmarks" / "ensemble"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{args.name}.md").write_text(table(result))
    print(table(result))


def table(r: dict) -> str:
    d = r["decoding"]
    shape = f"chain k={d['k']}" if d["method"] == "chain" else \
        f"tree depth={d['depth']} top_k={d['top_k']} total_tokens={d['total_tokens']}"
    lines = [
        f"# Ensemble drafting, tiny benchmark ({r['date']})", "",
        f"`{r['command']}`", "",
        f"draft {r['draft']}, target {r['target']}, {shape}, greedy, {r['items']} items / {r['turns']} turns, "
        f"{r['device']}, load average {r['load_average'][0]:.1f}. tau: committed tokens per verification (ratio "
        f"of totals). Drafting time: ms per draft block (cycle), overhead relative to M alone. Prefill: target and "
        f"head prefill per turn (C adds a text-only target pass). Outputs identical across rows: "
        f"{r['outputs_identical']}.", "",
        *ensemble_table(r),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    from msd_train.errors import run_main

    run_main(main)  # a known failure (a missing path, a full disk, Ctrl-C): one line, exit non-zero
