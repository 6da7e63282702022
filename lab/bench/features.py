"""Feature store budgets: disk per token and per sample, loader and generation throughput.

    python -m lab.bench.features [target/data overrides...] [--steps 20] [--out DIR]

1. Generates a bf16 store of the configured data (default: the tiny target and data) into
   a temporary folder, timing the generation.
2. Accounts for its bytes: per tensor, per split, per text and per visual token, against
   the budget of 2H bytes per text token and 4H per visual token (H = hidden size).
3. Extrapolates the layout to the 7B targets at representative sample shapes.
4. Times the loader (collate without pixels + ``OfflineFeatures``) on batches of the
   configured micro-batch size, half of them multimodal, and the trainer's consumption
   by running ``lab/bench/train.py`` (the real recipe, one process) on the same store
   with stage 2 at a fixed multimodal share of 0.5, and, for reference, online.

Writes ``DIR/<name>.json`` and ``DIR/<name>.md`` (default benchmarks/features/tiny_cpu.*).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lab.cli import at_least
from msd_train.config import CONF_DIR, REPO_ROOT


# Real targets: hidden size, vocabulary (so the id width) and M-RoPE from the adapters'
# published shapes (msd_train/targets ``target_shapes``); here the visual tokens of a typical
# image and ``prefix``: tokens every sample of the template opens with (Vicuna v1: at least
# the BOS; ChatML: "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n",
# 14 tokens with Qwen2's tokenizer).
def _target(shape: str, visual: int, prefix: int) -> dict:
    from msd_train.targets import FAMILIES, target_shapes

    s = target_shapes()[shape]
    return {"H": s["text"]["hidden_size"], "vocab": s["text"]["vocab_size"], "visual": visual,
            "mrope": FAMILIES[s["family"]].uses_mrope, "prefix": prefix}


TARGETS_7B = {
    "llava-1.5-7b": _target("llava15_7b", 576, 1),
    "llava-1.5-13b": _target("llava15_13b", 576, 1),
    # Qwen2-VL: one visual token per 28x28 px; a 640x480 COCO image gives about 23x17.
    "qwen2-vl-7b": _target("qwen2vl_7b", 391, 14),
}


def compose(name, overrides):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(str(CONF_DIR), version_base=None):
        return hydra_compose(name, overrides=overrides)


def tensor_bytes(store: Path, manifest: dict) -> dict:
    """Bytes per tensor name over all shards; ``header`` is what the files hold besides."""
    from safetensors import safe_open

    out: dict[str, int] = {}
    for s in manifest["shards"]:
        total = 0
        with safe_open(str(store / s["file"]), "pt") as f:
            for k in f.keys():
                t = f.get_slice(k)
                n = math.prod(t.get_shape()) * torch.tensor([], dtype=getattr(torch, _dtype(t.get_dtype()))).element_size()
                out[k] = out.get(k, 0) + n
                total += n
        out["header"] = out.get("header", 0) + s["bytes"] - total
    return out


def _dtype(name: str) -> str:
    return {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "I64": "int64", "I32": "int32",
            "U16": "uint16", "U8": "uint8"}[name]


def disk_report(manifest: dict, H: int) -> dict:
    splits = {}
    for name in manifest["splits"]:
        sh = [s for s in manifest["shards"] if s["split"] == name]
        b, n, v, k = (sum(s[x] for s in sh) for x in ("bytes", "n_tokens", "n_visual", "n_samples"))
        splits[name] = {"samples": k, "tokens": n, "visual_tokens": v, "text_tokens": n - v, "bytes": b,
                        "bytes_per_sample": b / k, "bytes_per_token": b / n,
                        "budget_bytes": 2 * H * (n - v) + 4 * H * v, "of_budget": b / (2 * H * (n - v) + 4 * H * v)}
    t = manifest["totals"]
    text_rate = splits["text"]["bytes"] / splits["text"]["tokens"] if "text" in splits else None
    mm = splits.get("multimodal")
    visual_rate = ((mm["bytes"] - mm["text_tokens"] * text_rate) / mm["visual_tokens"]
                   if mm and text_rate and mm["visual_tokens"] else None)
    budget = 2 * H * (t["n_tokens"] - t["n_visual"]) + 4 * H * t["n_visual"]
    return {"hidden_size": H, "dtype": manifest["dtype"], "ids_dtype": manifest["ids_dtype"],
            "samples": t["n_samples"], "tokens": t["n_tokens"], "visual_tokens": t["n_visual"], "bytes": t["bytes"],
            "bytes_per_sample": t["bytes"] / t["n_samples"], "bytes_per_token": t["bytes"] / t["n_tokens"],
            "bytes_per_text_token": text_rate, "bytes_per_text_token_in_H": text_rate / H if text_rate else None,
            "bytes_per_visual_token": visual_rate,
            "bytes_per_visual_token_in_H": visual_rate / H if visual_rate else None,
            "budget_bytes": budget, "of_budget": t["bytes"] / budget, "splits": splits}


def extrapolate() -> dict:
    """The store's layout at the 7B targets, per sample shape, with only the final row
    left out (the last token carries loss). ``of_budget_p1`` is the conservative case of a
    sample sharing only its first token with the shard's reference; ``of_budget`` uses
    the template's shared prefix."""
    from msd_train.features.store import sample_bytes

    out = {}
    for name, t in TARGETS_7B.items():
        H, ids = t["H"], (2 if t["vocab"] <= 1 << 16 else 4)
        shapes = {"text 256": (256, 0), "text 1024": (1024, 0), "text 2048 (max_length)": (2048, 0),
                  "1 image + 128 text": (t["visual"] + 128, t["visual"]),
                  "1 image, 2048 in all": (2048, t["visual"])}
        rows = {}
        for label, (n, v) in shapes.items():
            budget = 2 * H * (n - v) + 4 * H * v
            b1 = sample_bytes(n, v, n - 1 - 1, H, 2, ids, t["mrope"] and v > 0)
            b = sample_bytes(n, v, n - 1 - t["prefix"], H, 2, ids, t["mrope"] and v > 0)
            rows[label] = {"tokens": n, "visual_tokens": v, "bytes": b, "bytes_per_token": b / n,
                           "budget_bytes": budget, "of_budget": b / budget, "of_budget_p1": b1 / budget}
        out[name] = {"hidden_size": H, "ids_bytes": ids, "shared_prefix": t["prefix"], "shapes": rows,
                     "bytes_per_text_token_limit": 2 * H + ids + 0.125,
                     "note": "per text token the store holds 2H (state) + ids + 1/8 (mask bit) minus the rows "
                             "it leaves out (at least 2 per sample: the last and the shared first)"}
    return out


def time_loader(train_cfg, target, micro: int, steps: int) -> dict:
    from msd_train.data.collate import collate
    from msd_train.data.dataset import build_split, split_limit
    from msd_train.features.generate import split_sources
    from msd_train.features.offline import OfflineFeatures

    source = OfflineFeatures(train_cfg, target)
    d = train_cfg.data
    pools = {n: build_split(split_sources(train_cfg, n), target, d.max_length, d.on_bad_sample, d.cache_dir,
                            d.num_proc, split_limit(train_cfg.data, n)).dataset for n in ("text", "multimodal")}
    rng = random.Random(0)

    def batch_rows():
        rows = []
        for j in range(micro):
            ds = pools["multimodal" if j % 2 else "text"]
            rows.append(ds[rng.randrange(len(ds))])
        return rows

    for _ in range(3):  # warm-up: opens shards, fills the page cache
        source(collate(batch_rows(), target, pixels=False))
    batches = [batch_rows() for _ in range(steps)]
    t0 = time.perf_counter()
    for rows in batches:
        source(collate(rows, target, pixels=False))
    dt = time.perf_counter() - t0
    return {"samples_per_s": steps * micro / dt, "s_per_batch": dt / steps, "micro_batch_size": micro,
            "batches": steps, "multimodal_share": 0.5}


def time_trainer(overrides: list[str], extra: list[str], steps: int, head: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "t.json"
        cmd = [sys.executable, "-m", "lab.bench.train", "--steps", str(steps), "--out", str(out),
               "stage=2", f"stage.init_from={head}", "stage.curriculum.start=0.5", "stage.curriculum.end=0.5",
               *overrides, *extra]
        res = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, env={**os.environ, "WANDB_MODE": "disabled"})
        if res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
        return json.loads(out.read_text())


def markdown(r: dict) -> str:
    d, L = r["disk"], r["loader"]
    H = d["hidden_size"]
    lines = [
        f"# Feature store budgets ({r['target']}, {r['device']}, {r['date']})", "",
        f"Machine load average at the end (1, 5, 15 min): {', '.join(f'{x:.2f}' for x in r['load_average'])}; "
        "loader and trainer were timed one after the other on the same machine.", "",
        f"Reproduce: `{r['command']}`", "", *([r["note"], ""] if r.get("note") else []),
        f"## Disk, tiny data, {d['dtype']} (H = {H}, ids {d['ids_dtype']})", "",
        "| split | samples | tokens (visual) | bytes | per sample | per token | of budget |", "|---|---|---|---|---|---|---|"]
    for n, s in d["splits"].items():
        lines.append(f"| {n} | {s['samples']} | {s['tokens']} ({s['visual_tokens']}) | {s['bytes']:,} | "
                     f"{s['bytes_per_sample']:,.0f} | {s['bytes_per_token']:.1f} | {s['of_budget']:.1%} |")
    lines += [f"| **all** | {d['samples']} | {d['tokens']} ({d['visual_tokens']}) | {d['bytes']:,} | "
              f"{d['bytes_per_sample']:,.0f} | {d['bytes_per_token']:.1f} | {d['of_budget']:.1%} |", "",
              f"- per text token: {d['bytes_per_text_token']:.1f} B = {d['bytes_per_text_token_in_H']:.3f} H "
              f"(budget 2H = {2 * H} B)",
              f"- per visual token: {d['bytes_per_visual_token']:.1f} B = {d['bytes_per_visual_token_in_H']:.3f} H "
              f"(budget 4H = {4 * H} B); multimodal bytes less its text tokens at the text rate",
              "- by tensor: " + ", ".join(f"{k} {v:,}" for k, v in r["tensor_bytes"].items()),
              f"- the dry run estimated {r['dry_run_estimate_bytes']:,} bytes (headers aside)", "",
              "## Extrapolated to the 7B targets (bf16)", "",
              "Per sample from the store's layout (`msd_train.features.store.sample_bytes`), the final row left out, "
              "P leading tokens shared with the shard's reference: the template's shared prefix, or only one token "
              "(conservative; a sample that opens differently from the rest of its shard).", "",
              "| target | sample | tokens (visual) | bytes | per token | of budget | of budget, P=1 |",
              "|---|---|---|---|---|---|---|"]
    for name, t in r["extrapolated"].items():
        for label, s in t["shapes"].items():
            lines.append(f"| {name} (H={t['hidden_size']}, P={t['shared_prefix']}) | {label} | {s['tokens']} "
                         f"({s['visual_tokens']}) | {s['bytes'] / 1e6:.2f} MB | {s['bytes_per_token']:,.0f} | "
                         f"{s['of_budget']:.2%} | {s['of_budget_p1']:.2%} |")
    g, T, online = r["generation"], r["trainer_offline"], r.get("trainer_online")
    lines += ["", "## Throughput", "",
              f"- loader (collate without pixels + OfflineFeatures, micro-batch {L['micro_batch_size']}, half "
              f"multimodal): **{L['samples_per_s']:.0f} samples/s** ({L['s_per_batch'] * 1e3:.1f} ms per batch)",
              f"- trainer consumption from the store (lab/bench/train.py, stage 2 at multimodal share 0.5, "
              f"loader included): {T['samples_per_s']:.1f} samples/s ({T['s_per_step'] * 1e3:.0f} ms per step)",
              f"- loader / trainer: **{L['samples_per_s'] / T['samples_per_s']:.1f}x** (budget: at least 5x)"]
    if online:
        lines.append(f"- for reference, online training (target forward in the step): {online['samples_per_s']:.1f} samples/s")
    lines.append(f"- generation: {g['samples_per_s']:.1f} samples/s ({g['seconds']:.1f} s for {g['samples']} samples)")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=at_least(1), default=20, help="trainer steps and loader batches timed")
    ap.add_argument("--micro-batch", type=at_least(1), default=None, help="default: train.micro_batch_size")
    ap.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "features"))
    ap.add_argument("--name", default="tiny_cpu")
    ap.add_argument("--no-online", action="store_true", help="skip the online trainer reference")
    ap.add_argument("--note", default="", help="a remark stored with the results")
    ap.add_argument("overrides", nargs="*", help="target.* / data.* overrides")
    args = ap.parse_args()

    from msd_train.draft import MSDDraftConfig, MSDDraftModel
    from msd_train.features.generate import generate
    from msd_train.targets import load_target

    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        gcfg = compose("generate_features", [*args.overrides, f"features.path={store}", "features.dtype=bf16",
                                             "progress=false"])
        target = load_target(gcfg.target.name_or_path, gcfg.target.dtype, "cpu", gcfg.target.adapter,
                             gcfg.target.chat_template)
        # a dry run tokenises every split (so the timing below is the target's and the writer's) and estimates
        estimate = generate(compose("generate_features", [*args.overrides, f"features.path={store}",
                                                          "features.dtype=bf16", "dry_run=true"]), target=target)
        t0 = time.perf_counter()
        manifest = generate(gcfg, target=target)
        gen_s = time.perf_counter() - t0
        tcfg = compose("config", [*args.overrides, "stage='2'", "features=offline", f"features.path={store}"])
        micro = args.micro_batch or int(tcfg.train.micro_batch_size)
        head = Path(tmp) / "head"
        MSDDraftModel(MSDDraftConfig.from_target_config(target.config, target.name)).save_pretrained(head)
        result = {
            "target": str(gcfg.target.name_or_path).replace(str(REPO_ROOT) + "/", ""),
            "command": " ".join(["python -m lab.bench.features", *sys.argv[1:]]), "note": args.note,
            "disk": disk_report(manifest, target.hidden_size), "tensor_bytes": tensor_bytes(store, manifest),
            "dry_run_estimate_bytes": estimate["bytes"],
            "extrapolated": extrapolate(),
            "generation": {"seconds": gen_s, "samples": manifest["totals"]["n_samples"],
                           "samples_per_s": manifest["totals"]["n_samples"] / gen_s},
            "loader": time_loader(tcfg, target, micro, max(args.steps, 50)),
        }
        mb = [f"train.micro_batch_size={micro}"]
        result["trainer_offline"] = time_trainer(args.overrides, ["features=offline", f"features.path={store}", *mb],
                                                 args.steps, head)
        if not args.no_online:
            result["trainer_online"] = time_trainer(args.overrides, mb, args.steps, head)
        result["loader_over_trainer"] = result["loader"]["samples_per_s"] / result["trainer_offline"]["samples_per_s"]
        result.update(device=f"cpu ({torch.get_num_threads()} threads)", load_average=os.getloadavg(),
                      torch=torch.__version__,
                      python=platform.python_version(), date=time.strftime("%Y-%m-%d"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{args.name}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    from msd_train.errors import run_main

    run_main(main)  # a known failure (a missing path, a full disk, Ctrl-C): one line, exit non-zero
