"""Tables of lab/bench/train_data_path.sh (see benchmarks/train/README.md).

    python -m lab.bench.train_summary features WORK OUT.json SECONDS   # the store just built
    python -m lab.bench.train_summary padding WORK OUT.json [target/data overrides]
    python -m lab.bench.train_summary all WORK OUT_DIR      # -> OUT_DIR/../data_path.json and .md
"""

from __future__ import annotations

import json
import platform
import random
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
COMMAND = "lab/bench/train_data_path.sh"
BASELINE_TRAIN_TOKENS_PER_S = 372  # benchmarks/real_lm/results/train_split.json: online, full vocabulary (another data file)


def machine() -> dict:
    import os

    return {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
            "torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads()}


def features(work: Path, out: Path, seconds: float) -> None:
    """Bytes per token of the store (and of an msd-only store, estimated by its dry run) and
    target tokens per second of the whole command (loading and tokenising included)."""
    manifest = json.loads((work / "store" / "manifest.json").read_text())
    t = manifest["totals"]
    dry = (work / "features-msd-dry.log").read_text()
    row = {"samples": t["n_samples"], "tokens": t["n_tokens"], "bytes": t["bytes"], "dtype": manifest["dtype"],
           "layers": manifest.get("layers"), "bytes_per_token": t["bytes"] / t["n_tokens"],
           "hidden_size": manifest["target"]["hidden_size"], "seconds_whole_command": round(seconds, 1),
           "target_tokens_per_s": t["n_tokens"] / seconds, "msd_only_dry_run": dry.strip().splitlines()[-3:]}
    out.write_text(json.dumps(row, indent=1) + "\n")


def padding(work: Path, out: Path, overrides: list[str]) -> None:
    """Share of padded positions in micro-batches of 4 drawn as training draws them (uniformly,
    without replacement within an epoch), and with the epoch's samples bucketed by length
    (sorted within windows of 64, batches shuffled)."""
    from hydra import compose, initialize_config_dir

    from msd_train.config import CONF_DIR
    from msd_train.data.dataset import build_split
    from msd_train.features.generate import load_target_skeleton

    with initialize_config_dir(str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=overrides)
    target = load_target_skeleton(cfg.target)
    ds = build_split(list(cfg.data.text), target, cfg.data.max_length, "skip", cfg.data.cache_dir).dataset
    lengths = [len(x) for x in ds["input_ids"]]

    def share(batches):
        real = sum(sum(b) for b in batches)
        padded = sum(len(b) * max(b) for b in batches)
        return 1 - real / padded

    rng = random.Random(0)
    plain, bucketed = [], []
    for _ in range(20):
        order = lengths[:]
        rng.shuffle(order)
        plain += [order[i:i + 4] for i in range(0, len(order) - 3, 4)]
        for w in range(0, len(order), 64):
            window = sorted(order[w:w + 64])
            bucketed += [window[i:i + 4] for i in range(0, len(window) - 3, 4)]
    row = {"samples": len(lengths), "micro_batch": 4, "max_length": int(cfg.data.max_length),
           "length_mean": sum(lengths) / len(lengths), "length_max": max(lengths),
           "padded_share_random": share(plain), "padded_share_bucketed_64": share(bucketed)}
    out.write_text(json.dumps(row, indent=1) + "\n")


def _load(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def _train_row(path: Path) -> dict | None:
    r = _load(path)
    if r is None:
        return None
    row = r["rows"][0]
    return {"target_tokens_per_s": row["target_tokens_per_s"], "s_per_step": row["s_per_step"],
            "split_ms_per_step": row["split_ms_per_step"], "split_share": row["split_share"],
            "features": row.get("features"), "peak_memory_gib": row.get("peak_memory_gib")}


def summary(work: Path, out_dir: Path) -> None:
    regen = {}
    for f in sorted(out_dir.glob("regen-*.json")):
        m = json.loads(f.read_text())
        t = m["this_launch"]
        regen[f.stem.removeprefix("regen-")] = {
            "engine": t.get("engine"), "conversations": t["conversations"], "new_tokens": t["new_tokens"],
            "seconds": t["seconds"], "new_tokens_per_s": t["new_tokens"] / t["seconds"],
            "conversations_per_minute": 60 * t["conversations"] / t["seconds"]}
    train = {f.stem.removeprefix("train-"): _train_row(f) for f in sorted(out_dir.glob("train-*.json"))}
    feats, pad = _load(out_dir / "features.json"), _load(out_dir / "padding.json")
    today = regen.get("hf-decoder-16")
    result = {
        "machine": machine(), "command": COMMAND,
        "note": "target=smollm2_llava (SmolLM2-135M-Instruct as a LLaVA, fp32 on the CPU), 2 threads, one run each",
        "regeneration": regen, "features": feats, "training": train, "padding": pad,
    }
    if today and "vllm-200" in regen:
        result["regeneration_speedup"] = regen["vllm-200"]["new_tokens_per_s"] / today["new_tokens_per_s"]
        result["regeneration_speedup_same_prompts"] = (
            regen["vllm-16"]["new_tokens_per_s"] / today["new_tokens_per_s"] if "vllm-16" in regen else None)
        result["regeneration_speedup_note"] = (
            "vLLM on 200 prompts (one batch) over today's path (engine=hf, the project's decoder, one prompt at a "
            "time) on the first 16 of them: its rate per token does not depend on how many prompts it answers; "
            "regeneration_speedup_same_prompts compares the same 16 prompts")
    base, best = train.get("msd-online-full"), train.get("msd-offline-8192")
    if base and best:
        result["training_speedup"] = best["target_tokens_per_s"] / base["target_tokens_per_s"]
        result["training_speedup_over_372"] = best["target_tokens_per_s"] / BASELINE_TRAIN_TOKENS_PER_S
        long, bucketed = train.get("msd-offline-8192-40steps"), train.get("msd-offline-8192-bucket64-40steps")
        if long and bucketed:  # over one epoch: the 4-step runs see too few batches to compare orders
            result["bucketing_gain"] = bucketed["target_tokens_per_s"] / long["target_tokens_per_s"]
            result["training_speedup_bucketed"] = bucketed["target_tokens_per_s"] / base["target_tokens_per_s"]
    out_json = out_dir.parent / "data_path.json"
    out_json.write_text(json.dumps(result, indent=1) + "\n")
    (out_dir.parent / "data_path.md").write_text("\n".join(table(result)) + "\n")
    print("\n".join(table(result)))


def table(r: dict) -> list[str]:
    lines = [f"# The data path on `smollm2_llava`: `{r['command']}`", "",
             f"{r['note']}; {r['machine']['cpus']} CPUs, torch {r['machine']['torch']}.", "",
             "## Regeneration (first ShareGPT user turn, greedy, 128 new tokens, prompts <= 384 tokens)", "",
             "| run | engine | conversations | new tokens | s | new tokens/s | conversations/min |", "|---|---|---|---|---|---|---|"]
    for name, x in r["regeneration"].items():
        lines.append(f"| {name} | {x['engine']} | {x['conversations']} | {x['new_tokens']} | {x['seconds']:.0f} | "
                     f"{x['new_tokens_per_s']:.1f} | {x['conversations_per_minute']:.1f} |")
    if "regeneration_speedup" in r:
        lines += ["", f"regeneration_speedup **{r['regeneration_speedup']:.1f}x** "
                      f"(same 16 prompts: {r['regeneration_speedup_same_prompts']:.1f}x). {r['regeneration_speedup_note']}."]
    f = r.get("features")
    if f:
        lines += ["", "## Feature generation", "",
                  f"{f['samples']} conversations, {f['tokens']} tokens, {f['dtype']}, layers {f['layers']} + the last: "
                  f"{f['bytes'] / 2**20:.1f} MiB, **{f['bytes_per_token']:.0f} bytes per token** (H = {f['hidden_size']}); "
                  f"{f['seconds_whole_command']:.0f} s for the whole command, **{f['target_tokens_per_s']:.0f} target "
                  "tokens/s** (loading and tokenising included). An msd-only store (no layer inputs), dry run: "
                  + " / ".join(f["msd_only_dry_run"])]
    lines += ["", "## A training step (stage 1, micro-batch 4, max_length 512)", "",
              "| head / features / vocabulary | target tokens/s | s/step | data | target fwd | head fwd+bwd | loss | optimizer |",
              "|---|---|---|---|---|---|---|---|"]
    for name, x in r["training"].items():
        if x is None:
            continue
        ms = x["split_ms_per_step"]
        lines.append(f"| {name} | {x['target_tokens_per_s']:.0f} | {x['s_per_step']:.2f} | "
                     + " | ".join(f"{ms.get(k, 0):.0f} ms" for k in ("data", "target_forward", "head_fwd_bwd", "loss",
                                                                     "optimizer")) + " |")
    if "training_speedup" in r:
        lines += ["", f"training_speedup (msd, offline + draft.train_vocab=8192 over online full vocabulary, same run): "
                      f"**{r['training_speedup']:.2f}x**; over the 372 target tokens/s of "
                      f"benchmarks/real_lm/results/train_split.json: {r['training_speedup_over_372']:.2f}x"]
        if "training_speedup_bucketed" in r:
            lines[-1] += (f"; length buckets (train.bucket_window=64) over the same run without, 40 steps each: "
                          f"**{r['bucketing_gain']:.2f}x**, so {r['training_speedup_bucketed']:.2f}x over online full")
    p = r.get("padding")
    if p:
        lines += ["", "## Padding", "",
                  f"{p['samples']} conversations, mean {p['length_mean']:.0f} tokens (max {p['length_max']}): "
                  f"padded positions in a micro-batch of {p['micro_batch']}: {100 * p['padded_share_random']:.1f}% "
                  f"drawn at random, {100 * p['padded_share_bucketed_64']:.1f}% bucketed by length (windows of 64)."]
    return lines


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("features", "padding", "all"))
    parser.add_argument("work", type=Path, help="lab/bench/train_data_path.sh's work folder")
    parser.add_argument("out", type=Path, help="OUT.json (features, padding) or OUT_DIR (all)")
    parser.add_argument("rest", nargs="*", help="features: the seconds the store took; padding: target/data overrides")
    args = parser.parse_args()
    if args.mode == "features":
        if len(args.rest) != 1:
            parser.error("features needs the seconds the store took: features WORK OUT.json SECONDS")
        try:
            seconds = float(args.rest[0])
        except ValueError:
            parser.error(f"SECONDS={args.rest[0]!r} is not a number")
        features(args.work, args.out, seconds)
    elif args.mode == "padding":
        padding(args.work, args.out, args.rest)
    else:
        summary(args.work, args.out)
