"""Time the speculative decoder: per-cycle draft / verify / acceptance+bookkeeping split and tau.

    python -m lab.bench.decode                                  # tiny target, CPU
    python -m lab.bench.decode --tree 5,10,60 --tree 3,4,16 --chain 5 --chain 3
    python -m lab.bench.decode --target llava15_7b --random-shape --device cuda   # random 7B-shaped LLaVA
    python -m lab.bench.decode --target qwen2vl_7b --random-shape --num-layers 2  # M-RoPE, on a CPU
    python -m lab.bench.decode --host-reads --out benchmarks/decode/host-reads.json

``--host-reads`` counts, instead of timing, the device-to-host reads one ``decode`` makes
per cycle (``lab.transfers.HostReads``: ``.item()``, ``.tolist()``,
``bool()``/``int()`` of tensors, ``nonzero``, masked indexing), for the same settings,
on the first prompt of each category. It uses only ``prefill``/``decode``/``DecodeConfig``,
so the same command counts an older checkout (copy ``transfers.py`` into it).

``--target`` is a conf/target/*.yaml name (tiny, llava15_7b, qwen2vl_7b, ...), a model folder
or a Hub id. ``--random-shape`` builds a randomly initialised model of that target's shape
offline instead of loading weights (shapes below; ``--num-layers`` shrinks the depth so
that 7B widths fit a CPU). The head is ``--draft PATH`` (export folder or released head),
by default runs/tiny/stage2/final when it exists for the tiny target, else a random head
(then tau says nothing about a trained head; the time split still holds). Prompts are the
first turns of the tiny held-out benchmark. Results go to benchmarks/decode/<name>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import transformers
from omegaconf import OmegaConf

from lab.cli import at_least
from msd_train.config import CONF_DIR
from msd_train.decoding import DecodeConfig
from msd_train.evaluation import evaluate, load_bench, summarize
from msd_train.evaluation.run import describe_device
from msd_train.targets import target_shapes

ROOT = Path(__file__).resolve().parents[2]

# Published shapes, for timing random models of the real size without downloading them: the
# sizes are the adapters' (msd_train/targets ``target_shapes``), for the families built below
# (Qwen2.5-VL is timed as a Qwen2-VL of its size, as before).
_BUILT_AS = {"llava": "llava", "qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_vl"}
SHAPES = {
    "tiny": dict(family="llava", hidden=256, inter=704, layers=4, heads=4, kv=4, vocab=2048,  # data/tiny-llava
                 vision=dict(hidden_size=64, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                             image_size=48, patch_size=8, projection_dim=64)),
    **{name: dict(family=_BUILT_AS[sh["family"]], hidden=sh["text"]["hidden_size"],
                  inter=sh["text"]["intermediate_size"], layers=sh["text"]["num_hidden_layers"],
                  heads=sh["text"]["num_attention_heads"], kv=sh["text"]["num_key_value_heads"],
                  vocab=sh["text"]["vocab_size"], vision=sh["vision"])
       for name, sh in target_shapes().items() if sh["family"] in _BUILT_AS},
}


def target_name_or_path(name: str) -> str:
    """A conf/target name's ``name_or_path`` (``${msd_root:}`` resolved as the recipe does), else ``name``."""
    conf = CONF_DIR / "target" / f"{name}.yaml"
    return str(OmegaConf.load(conf).name_or_path) if conf.is_file() else name


def random_target(name: str, num_layers: int | None, device, dtype):
    """A randomly initialised target of a published shape, with a small offline tokenizer
    (ids beyond it decode to nothing; timings do not depend on the text)."""
    from lab.targets import random as lab_random
    from msd_train.targets import wrap_target

    s = dict(SHAPES[name])
    layers = num_layers or s["layers"]
    text = dict(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inter"], num_hidden_layers=layers,
                num_attention_heads=s["heads"], num_key_value_heads=s["kv"])
    if s["family"] == "llava":
        text.update(max_position_embeddings=4096, rms_norm_eps=1e-5)
        vision = dict(s["vision"])
        if num_layers:  # keep the vision tower in proportion when the language model is cut
            vision["num_hidden_layers"] = min(vision["num_hidden_layers"], 4 * num_layers)
        pixels = None
    else:
        text.update(max_position_embeddings=32768, rms_norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]})
        vision = dict(depth=min(32, 4 * layers), embed_dim=1280, hidden_size=s["hidden"], num_heads=16, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
        pixels = 336
    model, proc = lab_random.random_target(s["family"], 0, text, vision, device=device, dtype=dtype,
                                           image_pixels=pixels)
    return wrap_target(model, proc, f"random-{name}" + (f"-{layers}L" if num_layers else ""))


def parse_settings(values: list[str], n: int) -> list[tuple[int, ...]]:
    out = []
    for v in values:
        parts = tuple(int(x) for x in v.split(","))
        if len(parts) != n:
            raise SystemExit(f"expected {n} comma-separated integers, got {v!r}")
        out.append(parts)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="tiny", help="conf/target name, model folder or Hub id")
    ap.add_argument("--random-shape", action="store_true", help="a random model of the target's published shape")
    ap.add_argument("--num-layers", type=at_least(1), default=None, help="random shapes: language-model layers")
    ap.add_argument("--draft", default=None, help="head folder / Hub id; 'random' for a random head")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=at_least(1), default=None,
                    help="CPU threads (default 1 on CPU: small matmuls gain nothing from more, and shared "
                         "machines make multi-threaded timings erratic)")
    ap.add_argument("--tree", action="append", default=None, help="depth,top_k,total_tokens (repeatable)")
    ap.add_argument("--chain", action="append", default=None, help="k (repeatable)")
    ap.add_argument("--prompts", type=at_least(1), default=3, help="first turns per category of the tiny benchmark")
    ap.add_argument("--max-new-tokens", type=at_least(1), default=64)
    ap.add_argument("--warmup", type=at_least(0), default=2)
    ap.add_argument("--note", default=None, help="free text stored in the JSON (e.g. what the machine was doing)")
    ap.add_argument("--out", default=None, help="JSON file (default benchmarks/decode/<target>-<device>.json); "
                                                "a Markdown table goes next to it")
    ap.add_argument("--host-reads", action="store_true", help="count device-to-host reads per cycle, no timing")
    args = ap.parse_args(argv)

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if args.threads or device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    from msd_train.targets import load_target, resolve_dtype

    dtype = resolve_dtype(args.dtype, device)
    if args.random_shape:
        if args.target not in SHAPES:
            raise SystemExit(f"--random-shape knows {sorted(SHAPES)}, not {args.target!r}")
        target = random_target(args.target, args.num_layers, device, dtype)
    else:
        target = load_target(target_name_or_path(args.target), dtype, device)

    from msd_train.draft import MSDDraftConfig, MSDDraftModel

    draft_path = args.draft
    if draft_path is None and args.target == "tiny" and (ROOT / "runs/tiny/stage2/final/config.json").is_file():
        draft_path = str(ROOT / "runs/tiny/stage2/final")
    if draft_path in (None, "random"):
        torch.manual_seed(0)
        draft = MSDDraftModel(MSDDraftConfig.from_target_config(target.config, target.name)).to(device, dtype).eval()
        draft_note = "random head: tau is that of an untrained head; the time split is what the method costs"
        draft_path = "random"
    else:
        from msd_train.hub.load import load_head

        draft = load_head(draft_path, target)
        draft_note = "trained head"

    items = load_bench({"kind": "conversations", "max_per_category": args.prompts, "max_turns": 1, "sources": [
        {"path": str(ROOT / "data/tiny/sharegpt_heldout.json")},
        {"path": str(ROOT / "data/tiny/llava_heldout.json"), "image_root": str(ROOT / "data/tiny/images")}]})

    trees = parse_settings(args.tree or ["5,10,60", "3,8,24", "2,4,8"], 3)
    chains = parse_settings(args.chain or ["5", "3"], 1)
    configs = [DecodeConfig(method="tree", depth=d, top_k=k, total_tokens=n, max_new_tokens=args.max_new_tokens)
               for d, k, n in trees]
    configs += [DecodeConfig(method="chain", k=k, max_new_tokens=args.max_new_tokens) for (k,) in chains]

    if args.host_reads:
        return count_host_reads(target, draft, items, configs, args, draft_path, device)

    runs = []
    t0 = time.time()
    for c in configs:
        recs = evaluate(target, draft, items, c, warmup=args.warmup, progress=True)
        m = summarize(recs, greedy=True)
        cycle = {k: m[f"{k}_ms_per_cycle"] for k in ("draft", "verify", "accept")}
        total = sum(cycle.values())
        runs.append({
            "method": c.method, **({"depth": c.depth, "top_k": c.top_k, "total_tokens": c.total_tokens}
                                   if c.method == "tree" else {"k": c.k}),
            "tau": m["tau"], "accept_at_pos": m["accept_at_pos"],
            "ms_per_cycle": cycle, "share_of_cycle": {k: v / total for k, v in cycle.items()},
            "ms_per_token_in_cycles": total / m["tau"],
            "tokens_per_s": m["tokens_per_s"], "ar_tokens_per_s": m["ar_tokens_per_s"], "speedup": m["speedup"],
            "ar_ms_per_token": m["ar_ms_per_token"], "outputs_match_ar": m["outputs_match_ar"],
            "cycles": m["cycles"], "new_tokens": m["new_tokens"],
        })
        r = runs[-1]
        print(f"{c.method:5s} {json.dumps({k: r[k] for k in ('depth', 'top_k', 'total_tokens', 'k') if k in r})}: "
              f"tau {r['tau']:.2f}  draft {cycle['draft']:.2f} / verify {cycle['verify']:.2f} / accept "
              f"{cycle['accept']:.2f} ms per cycle  speedup {r['speedup']:.2f}x  (AR {r['ar_ms_per_token']:.2f} ms/token)")

    tc = target.text_config
    result = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m lab.bench.decode " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": describe_device(device), "dtype": str(dtype).replace("torch.", ""),
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "target": {"name": target.name, "family": target.family, "random": args.random_shape,
                   "hidden_size": tc.hidden_size, "num_layers": tc.num_hidden_layers, "vocab_size": tc.vocab_size,
                   "params_m": round(sum(p.numel() for p in target.model.parameters()) / 1e6, 2)},
        "draft": {"path": draft_path, "note": draft_note,
                  "params_m": round(sum(p.numel() for p in draft.parameters()) / 1e6, 2)},
        "prompts": len(items), "max_new_tokens": args.max_new_tokens, "warmup_items": args.warmup,
        "notes": "ms_per_cycle: mean time of each phase per verification cycle (msd_train.evaluation.timing: CUDA events on a GPU, perf_counter on a CPU); "
                 "accept = acceptance + KV-cache bookkeeping + stop check. tau: tokens per verification "
                 "(bonus included). speedup: ratio of total tokens/s over plain decoding, prefill included.",
        "runs": runs,
        "seconds": round(time.time() - t0, 1),
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "cpu_count": os.cpu_count(),
        "note": args.note,
    }
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "decode" / (
        f"{target.name.split('/')[-1]}-{device.type}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(timing_markdown(result))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return result


def _settings(r: dict) -> str:
    return (f"tree {r['depth']},{r['top_k']},{r['total_tokens']}" if r["method"] == "tree"
            else f"chain {r['k']}" if r["method"] == "chain" else "ar")


def timing_markdown(r: dict) -> str:
    lines = [f"# Decoder time split: {r['target']['name']} on {r['device']}", "",
             f"- command: `{r['command']}`", f"- created: {r['created']}; torch {r['torch']}, transformers "
             f"{r['transformers']}; head: {r['draft']['path']} ({r['draft']['note']})",
             f"- {r['prompts']} prompts, {r['max_new_tokens']} new tokens; load average {r['load_average']} on "
             f"{r['cpu_count']} CPUs (shared machine)", "",
             "| settings | tau | draft ms | verify ms | accept ms | ms/token in cycles | AR ms/token | speedup |"
             " outputs match AR |", "|---" * 9 + "|"]
    for x in r["runs"]:
        c = x["ms_per_cycle"]
        lines.append(f"| {_settings(x)} | {x['tau']:.3f} | {c['draft']:.2f} | {c['verify']:.2f} | {c['accept']:.2f} "
                     f"| {x['ms_per_token_in_cycles']:.2f} | {x['ar_ms_per_token']:.2f} | {x['speedup']:.2f} | "
                     f"{x['outputs_match_ar']} |")
    return "\n".join(lines + ["", r["notes"]]) + "\n"


def count_host_reads(target, draft, items, configs, args, draft_path, device) -> dict:
    """Device-to-host reads per decode cycle, counted (deterministic, not timed)."""
    import dataclasses
    from collections import Counter

    from lab.transfers import HostReads
    from msd_train.decoding import HeadDrafter, decode, prefill

    firsts = {}
    for item in items:  # the first prompt of each category
        firsts.setdefault(item.category, item)
    prompts = []
    for item in firsts.values():
        images = item.load_images()
        prompts.append(target.encode_prompt([{"role": "user", "content": item.turns[0]}], images))
    configs = [*configs, DecodeConfig(method="ar", max_new_tokens=args.max_new_tokens)]
    runs = []
    for c in configs:
        c = dataclasses.replace(c, eos_token_ids=())  # every prompt decodes max_new_tokens: comparable counts
        reads, cycles, kinds, tau = 0, 0, Counter(), []
        for prompt in prompts:
            state = prefill(target, HeadDrafter(draft) if c.method != "ar" else None, prompt)
            with HostReads() as counter:
                out = decode(target, state, c)
            reads += counter.count
            cycles += len(out.cycles)
            kinds.update(counter.names)
            tau += [a.accepted + 1 for a in out.cycles]
        run = {"settings": _settings(dataclasses.asdict(c) | {"method": c.method}), "reads": reads, "cycles": cycles,
               "prompts": len(prompts), "reads_per_cycle": round((reads - len(prompts)) / cycles, 3),
               "kinds": dict(kinds), "tau": round(sum(tau) / len(tau), 4)}
        runs.append(run)
        print(f"{run['settings']}: {run['reads_per_cycle']} host reads per cycle ({run['kinds']}), tau {run['tau']}")
    result = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m lab.bench.decode " + " ".join(sys.argv[1:]),
        "target": target.name, "draft": draft_path, "device": describe_device(device),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "max_new_tokens": args.max_new_tokens,
        "notes": "reads_per_cycle = (reads during decode() - one per prompt for the first token) / cycles; "
                 "counted with lab.transfers.HostReads (a TorchFunctionMode), EOS off",
        "runs": runs,
    }
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "decode" / "host-reads.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    from msd_train.errors import run_main

    run_main(main)  # a known failure (a missing path, a full disk, Ctrl-C): one line, exit non-zero
