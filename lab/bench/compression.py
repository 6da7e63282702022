"""Draft-side visual compression: tau, draft time and wall-clock per cycle for K visual slots per image.

    python -m lab.bench.compression                          # the embedded tiny LLaVA (36 visual tokens)
    python -m lab.bench.compression --target qwen --qwen-pixels 96   # tiny Qwen2-VL, 144 visual tokens

For each K of ``--ks`` (default all, 64, 32, 16) a stage-2 head is trained with
``draft.visual_compression=METHOD draft.visual_compression_tokens=K`` from one shared stage-1
head (stage 1 is text only: compression does not touch it), since the head learns to read
what it will read when drafting. K >= N (the target's visual tokens per image) is no
compression, bit for bit, so that row reuses the ``all`` head and is not trained again.
Each head is then decoded (greedy, tree 5/10/60 and chain 5, in this process) on the first
turns of the tiny held-out image benchmark; the uncompressed head is also decoded with
the setting applied at decode time only, which shows what training with it buys.

``--target qwen``: the tiny Qwen2-VL of ``lab/targets/tiny_qwen.py`` (the embedded
LLaVA's trained language model in a Qwen2-VL with M-RoPE and a random vision tower), its
image processor set to resize every image to ``--qwen-pixels`` squared pixels: 96 gives a
12 x 12 grid of 144 visual tokens for each 48 x 48 benchmark image.

Results go to benchmarks/compression/<target>.json and .md; heads stay under --run-dir.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from lab.cli import at_least, counts

ROOT = Path(__file__).resolve().parents[2]


def run(cmd: list[str], log: Path) -> float:
    """A project command from the repository root, its output in ``log``; its wall seconds."""
    print("+", shlex.join(cmd), flush=True)
    t0 = time.time()
    with open(log, "w") as f:
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=f, stderr=subprocess.STDOUT,
                       env={**os.environ, "WANDB_MODE": "disabled"})
    return round(time.time() - t0, 1)


def qwen_target(folder: Path, pixels: int) -> Path:
    """The tiny Qwen2-VL, every image resized to ``pixels`` squared (min = max pixels)."""
    from lab.targets.tiny_qwen import save_tiny_qwen2vl

    if not (folder / "config.json").is_file():
        save_tiny_qwen2vl(folder, ROOT / "data" / "tiny-llava", image_pixels=pixels)
        pre = folder / "preprocessor_config.json"
        config = json.loads(pre.read_text())
        config.update(min_pixels=pixels * pixels, max_pixels=pixels * pixels)
        config.setdefault("size", {}).update(shortest_edge=pixels * pixels, longest_edge=pixels * pixels)
        pre.write_text(json.dumps(config, indent=2))
    return folder


def visual_tokens(target, item) -> int:
    """Visual tokens of one image of the benchmark (they are all the same size)."""
    enc = target.encode_prompt([{"role": "user", "content": item.turns[0]}], item.load_images()[:1])
    return int((enc.input_ids == target.image_token_id).sum())


def decode_rows(target, head, items, configs, warmup: int) -> list[dict]:
    from msd_train.evaluation import evaluate, summarize

    rows = []
    for c in configs:
        records = evaluate(target, head, items, c, warmup=warmup, progress=False)
        m = summarize(records, greedy=True)
        cycle = {k: m[f"{k}_ms_per_cycle"] for k in ("draft", "verify", "accept")}
        # medians over turns of the per-cycle means: less swayed by other jobs on a shared machine
        per_turn = [(1000 * r["draft_s"] / len(r["accepted"]),
                     1000 * (r["draft_s"] + r["verify_s"] + r["accept_s"]) / len(r["accepted"]))
                    for r in records if r["accepted"]]
        rows.append({"method": c.method, "tau": m["tau"], "draft_ms_per_cycle": cycle["draft"],
                     "cycle_ms": sum(cycle.values()), "verify_ms_per_cycle": cycle["verify"],
                     "draft_ms_median": statistics.median(d for d, _ in per_turn),
                     "cycle_ms_median": statistics.median(c for _, c in per_turn),
                     "tokens_per_s": m["tokens_per_s"], "speedup": m["speedup"],
                     "outputs_match_ar": m["outputs_match_ar"], "cycles": m["cycles"]})
        print(f"  {c.method}: tau {m['tau']:.3f}  draft {cycle['draft']:.2f} ms  cycle {rows[-1]['cycle_ms']:.2f} ms  "
              f"exact {m['outputs_match_ar']}", flush=True)
    return rows


def validation(final: Path) -> dict:
    """The stage's last held-out validation: simulated tau and top-1 on image conversations."""
    rows = [json.loads(line) for line in (final.parent / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = [r for r in rows if "val/mm/sim_tau" in r][-1]
    return {"mm_sim_tau": last["val/mm/sim_tau"], "mm_top1": last["val/mm/top1"]}


def alternating_draft_ms(target, heads: dict, items, config, rounds: int) -> dict[str, float]:
    """Median milliseconds of one ``draft_block`` per head, the heads taking turns on the same
    prompts (each prefilled once), so that a load change on the machine hits them alike."""
    from msd_train.decoding import HeadDrafter, prefill

    states = {}
    for name, head in heads.items():
        for i, item in enumerate(items):
            prompt = target.encode_prompt([{"role": "user", "content": item.turns[0]}], item.load_images())
            state = prefill(target, HeadDrafter(head), prompt)
            state.tokens.append(int(state.next_logits.argmax()))
            states[name, i] = state
    times = {name: [] for name in heads}
    for _ in range(rounds):
        for (name, _i), state in states.items():
            length = state.drafter.cache.length
            t0 = time.perf_counter()
            state.drafter.draft_block(target, state.pending(), config)
            times[name].append(1000 * (time.perf_counter() - t0))
            state.drafter.cache.length = length  # the draft is dropped: the next round drafts the same block
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=("tiny", "qwen"), default="tiny")
    ap.add_argument("--qwen-pixels", type=at_least(1), default=96, help="--target qwen: image side after resizing")
    ap.add_argument("--ks", type=counts(words=("all",)), default="all,64,32,16", help="visual slots per image to keep (all: no compression)")
    ap.add_argument("--method", choices=("kmeans", "pool"), default="kmeans")
    ap.add_argument("--steps1", type=at_least(1), default=None, help="stage-1 steps (default: the stage's own)")
    ap.add_argument("--steps2", type=at_least(1), default=None, help="stage-2 steps (default: the stage's own)")
    ap.add_argument("--prompts", type=at_least(1), default=4, help="first turns per image category of the benchmark")
    ap.add_argument("--max-new-tokens", type=at_least(1), default=64)
    ap.add_argument("--warmup", type=at_least(0), default=2)
    ap.add_argument("--rounds", type=at_least(1), default=15, help="turns of each head in the alternating draft timing")
    ap.add_argument("--run-dir", default=None, help="default runs/compression/<target>")
    ap.add_argument("--out", default=None, help="default benchmarks/compression/<target>.json")
    ap.add_argument("--train", nargs="*", default=[], help="extra train.py overrides (every stage)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # small matmuls gain nothing from more; shared machines make them erratic

    run_dir = Path(args.run_dir or ROOT / "runs" / "compression" / args.target).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    if args.target == "qwen":
        folder = qwen_target(run_dir / "target", args.qwen_pixels)
        tgt, template = [f"target.name_or_path={folder}", "target.chat_template=chatml_qwen"], "chatml_qwen"
    else:
        folder, tgt, template = ROOT / "data" / "tiny-llava", [], None

    from msd_train.decoding import DecodeConfig
    from msd_train.evaluation import load_bench
    from msd_train.evaluation.run import describe_device
    from msd_train.hub.load import load_head
    from msd_train.targets import load_target

    target = load_target(str(folder), torch.float32, "cpu", chat_template=template)
    items = load_bench({"kind": "conversations", "max_per_category": args.prompts, "max_turns": 1, "sources": [
        {"path": str(ROOT / "data/tiny/llava_heldout.json"), "image_root": str(ROOT / "data/tiny/images")}]})
    n_visual = visual_tokens(target, next(i for i in items if len(i.images) == 1 and i.turns[0].count("<image>") == 1))
    print(f"{target.name}: {n_visual} visual tokens per image, {len(items)} prompts", flush=True)

    py, wall = sys.executable, {}
    common = [*tgt, f"data.cache_dir={run_dir / 'cache'}", "logging.wandb.mode=disabled", "logging.progress=false",
              "resume=false", *args.train]
    stage1 = run_dir / "base" / "stage1" / "final"
    if not (stage1 / "config.json").is_file():
        wall["stage1"] = run([py, "train.py", "stage=1", f"run_dir={run_dir / 'base'}", *common,
                              *([f"train.max_steps={args.steps1}"] if args.steps1 else [])], run_dir / "stage1.log")
    ks = args.ks
    heads = {}
    for k in ks:
        name = "all" if k == "all" or k >= n_visual else f"k{k}"
        final = run_dir / name / "stage2" / "final"
        if name not in heads and not (final / "config.json").is_file():
            setting = ["draft.visual_compression=none"] if name == "all" else [
                f"draft.visual_compression={args.method}", f"draft.visual_compression_tokens={k}"]
            wall[f"stage2 {name}"] = run([py, "train.py", "stage=2", f"run_dir={run_dir / name}",
                                          f"stage.init_from={stage1}", *setting, *common,
                                          *([f"train.max_steps={args.steps2}"] if args.steps2 else [])],
                                         run_dir / f"stage2-{name}.log")
        heads[name] = final

    configs = [DecodeConfig(method="tree", depth=5, top_k=10, total_tokens=60, max_new_tokens=args.max_new_tokens),
               DecodeConfig(method="chain", k=5, max_new_tokens=args.max_new_tokens)]
    results = []
    for k in ks:
        name = "all" if k == "all" or k >= n_visual else f"k{k}"
        for trained in (True, False) if name != "all" else (True,):
            head = load_head(heads[name] if trained else heads["all"], target)
            if not trained:  # the uncompressed head, compressed at decode time only
                head.config.visual_compression, head.config.visual_compression_tokens = args.method, k
            label = f"K={k}" + ("" if name != "all" or k == "all" else f" (>= {n_visual}: none)")
            print(f"{label}, head trained {'with' if trained else 'without'} it", flush=True)
            for row in decode_rows(target, head, items, configs, args.warmup):
                results.append({"k": k, "compressed": name != "all", "trained_with_it": trained, **row,
                                **(validation(heads[name]) if trained else {})})

    # the draft step alone, heads alternating: K's effect on the draft's time with the load drift removed
    timed = {}
    for k in ks:
        name = "all" if k == "all" or k >= n_visual else f"k{k}"
        timed[str(k)] = load_head(heads[name], target)
    for c in configs:
        medians = alternating_draft_ms(target, timed, [i for i in items if len(i.images) == 1][:4], c, args.rounds)
        for x in results:
            if x["trained_with_it"] and x["method"] == c.method:
                x["draft_ms_alternating"] = medians[str(x["k"])]
        print(f"  {c.method} draft_block, heads alternating: "
              + ", ".join(f"K={k} {v:.2f} ms" for k, v in medians.items()), flush=True)

    result = {
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m lab.bench.compression " + shlex.join(sys.argv[1:] if argv is None else argv),
        "target": target.name, "visual_tokens_per_image": n_visual, "method": args.method,
        "prompts": len(items), "max_new_tokens": args.max_new_tokens, "rounds": args.rounds,
        "steps": {"stage1": args.steps1 or "default", "stage2": args.steps2 or "default"},
        "device": describe_device(torch.device("cpu")), "threads": 1, "torch": torch.__version__,
        "python": platform.python_version(), "train_wall_s": wall,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "rows": results,
    }
    out = Path(args.out or ROOT / "benchmarks" / "compression" / f"{args.target}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    print(out.with_suffix(".md").read_text())
    return result


def markdown(r: dict) -> str:
    lines = [f"# Visual compression on {r['target']} ({r['visual_tokens_per_image']} visual tokens per image)", "",
             f"`{r['command']}` ({r['created']}; {r['device']}, 1 thread, load average {r['load_average']}: "
             "a shared 2-core machine, so times are noisy). Method: "
             f"{r['method']}; {r['prompts']} first turns of the tiny held-out image benchmark, greedy, "
             f"{r['max_new_tokens']} new tokens. Draft and cycle (draft + verify + accept) times are means per "
             "verification cycle over all turns, in brackets the median over turns; tokens/s includes prefill.", "",
             "The last column times the draft step alone: one `draft_block` on 4 one-image prompts, the heads "
             f"taking turns {r['rounds']} times (median), so that the machine's load drifts over all K alike.", "",
             "Held-out image sim. tau / top-1: the stage's last validation (simulated 5-step chains on held-out "
             "image conversations, the head reading compressed images as it was trained).", "",
             "| K | head trained with it | decoding | tau | draft ms / cycle (median) | cycle ms (median) | tokens/s "
             "| speedup | exact | draft step ms, alternating | held-out image sim. tau / top-1 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        k = "all" if x["k"] == "all" else (f"{x['k']}" if x["compressed"] else f"{x['k']} (= all)")
        lines.append(f"| {k} | {'yes' if x['trained_with_it'] else 'no (decode only)'} | {x['method']} | "
                     f"{x['tau']:.3f} | {x['draft_ms_per_cycle']:.1f} ({x['draft_ms_median']:.1f}) | "
                     f"{x['cycle_ms']:.1f} ({x['cycle_ms_median']:.1f}) | "
                     f"{x['tokens_per_s']:.1f} | {x['speedup']:.2f} | {x['outputs_match_ar']} | "
                     + (f"{x['draft_ms_alternating']:.2f} |" if "draft_ms_alternating" in x else "|")
                     + (f" {x['mm_sim_tau']:.3f} / {x['mm_top1']:.3f} |" if "mm_sim_tau" in x else " |"))
    lines += ["", "Training wall seconds: " + (", ".join(f"{k} {v}" for k, v in r["train_wall_s"].items())
                                               or "(heads reused)"), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    from msd_train.errors import run_main

    run_main(main)  # a known failure (a missing path, a full disk, Ctrl-C): one line, exit non-zero
