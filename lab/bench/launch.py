#!/usr/bin/env python
"""Time a training launch at the recipe's scale, phase by phase, from ``deepspeed train.py``
to the first optimizer step, at 1 and 2 ranks; and the loader workers' collate throughput
in images per second.

Usage::

    python -m lab.data.make_scale_data /tmp/scale                  # 733k conversations
    python -m lab.bench.data_scale /tmp/scale --out scale.json --keep-cache /tmp/cache
    python -m lab.bench.launch /tmp/scale --cache /tmp/cache --out benchmarks/data/launch.json

**Launch.** ``deepspeed --num_gpus N train.py stage=1 stage.splits=[text,multimodal]
data=sharegpt_llava665k ...`` (the data files of ``--data``, ``data.cache_dir=--cache``,
``train.max_steps=1``, ``train.grad_accum=1``), each rank run through this file, which wraps
the recipe's phases with clocks and then runs ``train.py`` as it is: ``start`` (the launcher,
Python and the imports, until the entry point runs), ``join`` (the process group), ``target``
(``load_target``), ``data`` (``TrainRecipe._setup_data``: every split found in the cache and
memory-mapped, or tokenised when ``--cache`` is cold), ``draft`` (the head, and the pass over
every row's ids that counts the assistant tokens), ``engine`` (``deepspeed.initialize``),
``first_step`` (the loader, the first batch and the first optimizer step). Per rank, beside
its peak RSS and, at the first step, its own memory (``RssAnon``) and the pages of
files it maps (``RssFile``: the cache's Arrow files, shared by a node's ranks through the page
cache); the slowest rank's sum is the launch.

**Collate.** ``StepBatches`` of the multimodal rows of the cache through the project's own
loader (``step_loader``, ``--workers`` processes, micro-batch ``--micro-batch``), with the
target's own image processor and with LLaVA-1.5's (``CLIPImageProcessor`` at 336x336, the
settings of ``llava-hf/llava-1.5-7b-hf``, put in the target's place: the pixels and their cost
are LLaVA-1.5's, the token counts the target's): images collated per second, after the first
batch.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PHASES = ["start", "imports", "join", "target", "data", "draft", "engine", "first_step"]


def rank_main() -> None:
    """One rank: clocks around the recipe's phases, then ``train.py``'s own main."""
    t_entry = time.time()
    out = Path(os.environ["BENCH_LAUNCH_OUT"])
    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine

    from msd_train import runtime
    from msd_train.training import recipe

    marks = {"entry": t_entry}

    def timed(owner, name: str, phase: str):
        inner = getattr(owner, name)

        def wrapper(*a, **k):
            marks.setdefault(f"{phase}_begin", time.time())
            try:
                return inner(*a, **k)
            finally:
                marks[f"{phase}_end"] = time.time()

        setattr(owner, name, wrapper)

    timed(recipe.TrainRecipe, "setup", "setup")
    timed(runtime, "setup_group", "join")
    timed(recipe, "load_target", "target")
    timed(recipe.TrainRecipe, "_setup_data", "data")
    timed(recipe.TrainRecipe, "_build_draft", "draft")
    timed(deepspeed, "initialize", "engine")
    step = DeepSpeedEngine.step

    def first_step(self, *a, **k):
        result = step(self, *a, **k)
        if "first_step_end" not in marks and self.is_gradient_accumulation_boundary():
            marks["first_step_end"] = time.time()
            marks["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
            # now: the process's own memory, and the pages of files it maps (the cache's Arrow
            # files: shared by the ranks of a node through the page cache, and reclaimable)
            status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
            for key, name in (("RssAnon", "rss_anon_gb"), ("RssFile", "rss_file_gb")):
                marks[name] = int(status[key].split()[0]) / 2**20
            rank = int(os.environ.get("RANK", "0"))
            (out / f"rank{rank}.json").write_text(json.dumps(marks))
        return result

    DeepSpeedEngine.step = first_step
    sys.argv = [str(ROOT / "train.py"), *(a for a in sys.argv[1:] if a != "_rank")]  # train.py drops --local_rank
    import runpy

    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")


def phases(launch: float, marks: dict) -> dict:
    """Seconds of each phase of one rank (the time between phases goes to the next one)."""
    ends = [marks["entry"], marks["setup_begin"], marks["join_end"], marks["target_end"], marks["data_end"], marks["draft_end"],
            marks["engine_end"], marks["first_step_end"]]
    out, last = {}, launch
    for name, end in zip(PHASES, ends):
        out[name] = round(end - last, 2)
        last = end
    out["total"] = round(last - launch, 2)
    for key in ("peak_rss_gb", "rss_anon_gb", "rss_file_gb"):
        out[key] = round(marks[key], 3)
    return out


def launch(ranks: int, data: Path, cache: str, target: str, run_dir: str, timeout: float) -> dict:
    out = Path(tempfile.mkdtemp(prefix="bench-launch-"))
    overrides = ["stage=1", "stage.splits=[text,multimodal]", "data=sharegpt_llava665k",
                 f"data.text.0.path={data / 'sharegpt.json'}", f"data.multimodal.0.path={data / 'llava_mix.json'}",
                 f"data.multimodal.0.image_root={data / 'images'}", f"data.cache_dir={cache}", "data.num_proc=2",
                 f"target.name_or_path={target}", f"run_dir={run_dir}", "train.max_steps=1", "train.grad_accum=1",
                 "logging.wandb.mode=disabled", "logging.progress=false", "eval.every=1000", "checkpoint.every=1000",
                 "resume=false"]
    cmd = ["deepspeed", "--num_gpus", str(ranks), "--master_port", str(_free_port()), __file__, "_rank", *overrides]
    env = {**os.environ, "BENCH_LAUNCH_OUT": str(out), "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    load = os.getloadavg()[0]
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.time() - t0
    if p.returncode != 0 or len(list(out.glob("rank*.json"))) != ranks:
        sys.exit(f"the launch with {ranks} rank(s) failed:\n{(p.stdout + p.stderr)[-4000:]}")
    per_rank = [phases(t0, json.loads((out / f"rank{r}.json").read_text())) for r in range(ranks)]
    return {"ranks": ranks, "per_rank": per_rank, "launch_to_first_step_s": max(r["total"] for r in per_rank),
            "process_wall_s": round(wall, 2), "load_avg_1min": [round(load, 2), round(os.getloadavg()[0], 2)],
            "command": " ".join(cmd[:5] + ["train.py"] + overrides)}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collate_rate(data: Path, cache: str, target_path: str, workers: int, micro_batch: int, batches: int,
                 side: int | None) -> dict:
    """Images collated per second by the training loader over the cache's multimodal rows."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from msd_train.data.collate import StepBatches, step_loader
    from msd_train.data.dataset import build_split
    from msd_train.targets import load_target

    target = load_target(target_path)
    # the rows of the target's own cache (found before its image processor is replaced below)
    mm = build_split([{"path": str(data / "llava_mix.json"), "format": "llava", "image_root": str(data / "images")}],
                     target, 2048, "skip", cache, 2, None).dataset
    if side is not None:
        from transformers import CLIPImageProcessor

        # llava-hf/llava-1.5-7b-hf's image processor: shortest edge to 336 (bicubic), centre crop 336x336
        target.processor.image_processor = CLIPImageProcessor(
            size={"shortest_edge": side}, crop_size={"height": side, "width": side}, resample=3,
            do_center_crop=True, do_normalize=True, do_rescale=True, do_resize=True, do_convert_rgb=True,
            image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711])
    with_image = [i for i, n in enumerate(mm["n_visual"][: batches * micro_batch * 4]) if n][: (batches + 1) * micro_batch]

    class Plans:  # the curriculum's interface for StepSampler: step -> that step's global batch
        def plan(self, step):
            return [("mm", i) for i in with_image[step * micro_batch:(step + 1) * micro_batch]]

        def state_dict(self):
            return {}

    dataset = StepBatches(mm, mm, target.tokenizing_view(), micro_batch, 1, 0, 1)
    loader = step_loader(dataset, Plans(), 0, batches + 1, workers, pin_memory=False)
    it = iter(loader)
    first = next(it)
    shape = tuple(first["micro_batches"][0]["pixel"]["pixel_values"].shape[1:])
    t0, images = time.perf_counter(), 0
    for item in it:
        images += sum(b["n_images"] for b in item["micro_batches"])
    seconds = time.perf_counter() - t0
    return {"processor": "llava-1.5 (CLIPImageProcessor 336)" if side else f"the target's ({Path(target_path).name})",
            "pixel_shape": list(shape), "workers": workers, "micro_batch": micro_batch, "images": images,
            "seconds": round(seconds, 2), "images_per_s": round(images / seconds, 1),
            "load_avg_1min": round(os.getloadavg()[0], 2)}


def main() -> None:
    if "_rank" in sys.argv[1:3]:  # a rank (the launcher puts --local_rank first)
        return rank_main()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", help="a folder written by lab/data/make_scale_data.py")
    p.add_argument("--cache", required=True, help="data.cache_dir (warm: lab.bench.data_scale --keep-cache)")
    p.add_argument("--out", required=True)
    p.add_argument("--target", default=str(ROOT / "data" / "tiny-llava"))
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--workers", type=int, default=2, help="loader workers for the collate rate")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--batches", type=int, default=40, help="micro-batches timed (after the first)")
    p.add_argument("--timeout", type=float, default=3600)
    args = p.parse_args()
    data = Path(args.data)
    made = json.loads((data / "manifest.json").read_text())
    result = {"what": "deepspeed train.py stage=1 stage.splits=[text,multimodal] on the embedded target, from the "
                      "launch to the first optimizer step, per phase and rank; the loader's collate rate",
              "records": made["mix"]["records"] + made["sharegpt_records"], "launches": [], "collate": []}
    with tempfile.TemporaryDirectory(prefix="bench-launch-run-") as run_dir:
        for n in args.ranks:
            r = launch(n, data, args.cache, args.target, f"{run_dir}/r{n}", args.timeout)
            print(json.dumps(r), flush=True)
            result["launches"].append(r)
    for side in (None, 336):
        r = collate_rate(data, args.cache, args.target, args.workers, args.micro_batch, args.batches, side)
        print(json.dumps(r), flush=True)
        result["collate"].append(r)
    result["command"] = "python -m lab.bench.launch " + " ".join(sys.argv[1:])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
