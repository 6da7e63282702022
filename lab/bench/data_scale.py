#!/usr/bin/env python
"""Time the data-loading part of a training launch at the recipe's scale: cold start
(tokenising into an empty ``data.cache_dir``), warm start (what every later launch and
every rank does) and peak RSS, on data from ``lab/data/make_scale_data.py``.

Usage::

    python -m lab.data.make_scale_data /tmp/scale            # 665k + 68k records
    python -m lab.bench.data_scale /tmp/scale --out benchmarks/data/scale.json
    # the code of another commit beside this one, on the same data, in the same run:
    git archive main msd_train | tar -x -C /tmp/old
    python -m lab.bench.data_scale /tmp/scale-20k --baseline /tmp/old --out ...

Each measurement is a fresh process (``python THIS _one ...``) running what
``Recipe._setup_data`` runs for ``stage.splits=[text,multimodal]`` with
``conf/data/sharegpt_llava665k.yaml``'s settings (``max_length=2048``,
``on_bad_sample=skip``, ``data.max_train=null``): ``build_split`` of the text file and of the
mix, after the target is loaded (its load is not counted). Peak RSS is the process's own
(``ru_maxrss``); the tokenising workers' (``num_proc``) is reported beside it.
With ``--baseline`` the other code is measured in the same run, alternating with this one
phase by phase (cold, then each warm repeat), so that load from elsewhere falls on both;
``load_avg_1min`` is the machine's 1-minute load average before and after each measurement.
With ``--append`` the runs are added to an existing ``--out`` file.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def one(args) -> None:
    """One measurement, in this process: prints a JSON line."""
    import datasets  # noqa: F401  (imported before the clock starts: both codes import it)

    from msd_train.data.dataset import build_split
    from msd_train.targets import load_target

    data = Path(args.data)
    target = load_target(args.target)
    splits = {"text": [{"path": str(data / "sharegpt.json"), "format": "sharegpt"}],
              "multimodal": [{"path": str(data / "llava_mix.json"), "format": "llava",
                              "image_root": str(data / "images")}]}
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    t0 = time.perf_counter()
    rows, skipped = {}, 0
    for name, sources in splits.items():
        split = build_split(sources, target, 2048, "skip", args.cache, args.num_proc, None)
        rows[name], skipped = len(split), skipped + len(split.skipped)
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": round(seconds, 2),
                      "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
                      "rss_before_data_gb": round(base, 3),
                      "workers_peak_rss_gb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 3),
                      "rows": rows, "skipped": skipped}))


def machine() -> dict:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")
    flags = Path("/proc/cpuinfo").read_text()
    return {"cpu": model, "cores": os.cpu_count(), "avx512_bf16": "avx512_bf16" in flags,
            "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}


def measure(code: Path, data: str, cache: str, phase: str, num_proc: int, target: str, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code), "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, __file__, "_one", "--data", data, "--cache", cache, "--num-proc", str(num_proc),
           "--target", target]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        sys.exit(f"{phase} with {code} failed:\n{p.stderr[-3000:]}")
    res = json.loads(p.stdout.strip().splitlines()[-1])
    res["process_seconds"] = round(time.perf_counter() - t0, 2)
    return res


def main(argv=None) -> None:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "_one":
        p = argparse.ArgumentParser()
        p.add_argument("_one")
        for a in ("--data", "--cache", "--target"):
            p.add_argument(a, required=True)
        p.add_argument("--num-proc", type=int, default=2)
        return one(p.parse_args())
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", help="a folder written by lab/data/make_scale_data.py")
    p.add_argument("--out", required=True, help="JSON file to write (or extend with --append)")
    p.add_argument("--append", action="store_true")
    p.add_argument("--baseline", help="a folder holding another commit's msd_train/ (measured the same way)")
    p.add_argument("--num-proc", type=int, default=2)
    p.add_argument("--warm-repeats", type=int, default=2)
    p.add_argument("--target", default=str(ROOT / "data" / "tiny-llava"))
    p.add_argument("--timeout", type=float, default=4 * 3600, help="seconds per measurement")
    p.add_argument("--keep-cache", help="an empty folder for this code's data.cache_dir, kept afterwards (for "
                                        "lab.bench.launch to start warm from)")
    args = p.parse_args(argv)
    data = Path(args.data)
    for f in ("llava_mix.json", "sharegpt.json", "manifest.json"):
        if not (data / f).is_file():
            sys.exit(f"{data / f} not found: write the data with python -m lab.data.make_scale_data {data}")
    if args.baseline and not (Path(args.baseline) / "msd_train").is_dir():
        sys.exit(f"--baseline {args.baseline}: no msd_train/ in it (git archive COMMIT msd_train | tar -x -C DIR)")
    out = Path(args.out)
    if args.append and not out.is_file():
        sys.exit(f"--append: {out} does not exist yet")
    made = json.loads((data / "manifest.json").read_text())
    records = made["mix"]["records"] + made["sharegpt_records"]
    result = json.loads(out.read_text()) if args.append else {
        "what": "build_split of the text and multimodal splits as Recipe._setup_data runs them "
                "(stage.splits=[text,multimodal], conf/data/sharegpt_llava665k.yaml settings), "
                "embedded target data/tiny-llava; fresh process per measurement",
        "machine": machine(), "runs": []}
    result.setdefault("runs", [])
    codes = [("new", ROOT)] + ([("old", Path(args.baseline))] if args.baseline else [])
    if args.keep_cache and Path(args.keep_cache).exists() and any(Path(args.keep_cache).iterdir()):
        sys.exit(f"--keep-cache {args.keep_cache}: not empty; give an empty or new folder")
    caches = {label: tempfile.mkdtemp(prefix=f"bench-data-{label}-") for label, _ in codes}
    if args.keep_cache:
        shutil.rmtree(caches["new"])
        caches["new"] = args.keep_cache
    command = " ".join(["python", "-m", "lab.bench.data_scale", *(argv or sys.argv[1:])])
    # old and new alternate within each phase, so that a load from elsewhere on the machine
    # falls on both (the 1-minute load average is recorded beside each measurement)
    try:
        for phase in ["cold"] + ["warm"] * args.warm_repeats:
            for label, code in codes:
                load = os.getloadavg()[0]
                r = measure(code, str(data), caches[label], phase, args.num_proc, args.target, args.timeout)
                row = {"code": label, "records": records, "mix_records": made["mix"]["records"],
                       "sharegpt_records": made["sharegpt_records"], "phase": phase, "num_proc": args.num_proc,
                       "target": Path(args.target).name, **r, "load_avg_1min": [round(load, 2), round(os.getloadavg()[0], 2)],
                       "command": command}
                result["runs"].append(row)
                print(json.dumps(row), flush=True)
    finally:
        for label, cache in caches.items():
            if not (args.keep_cache and label == "new"):
                shutil.rmtree(cache, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
