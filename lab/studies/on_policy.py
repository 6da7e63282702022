#!/usr/bin/env python
"""Does training a head on its own drafts (stage 3) beat supervised training continued for the
same wall-clock time from the same head?

From one trained head (``--head``, e.g. RUN/stage2/final), two arms train in this process with
the project's recipe, each for ``--budget`` seconds of optimizer steps (or ``--max-steps``,
which is also the horizon of each arm's learning-rate schedule):

- ``on_policy``: ``conf/stage/3.yaml`` (``train.objective=on_policy``), from the head;
- ``supervised``: ``conf/stage/2.yaml``'s settings from the same head, its multimodal share
  held at the value stage 2 ends with (stage 3's), so both arms read the same mix.

Before and after, each arm's held-out validation (the training's own: top-1 agreement at each
step of a k-step self-rollout, unconditional and given the earlier steps, and simulated tau
per split) is written to ``OUT/results.json`` with each arm's steps and wall time; the heads
are exported to ``OUT/<arm>/stageN/final``. ``--eval chain tree`` also runs ``eval.py`` (fp32)
on the three heads and records the decoder's tau and exactness. Hydra overrides after ``--``
(target, data, features, ...) apply to both arms::

    python -m lab.studies.on_policy --head runs/tiny/stage2/final --budget 300 --out runs/on_policy
    python -m lab.studies.on_policy --head H --budget 3600 --out O -- target=smollm2_llava data=...
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARMS = {
    "on_policy": ["stage='3'"],
    "supervised": ["stage='2'", "stage.curriculum.start=0.5", "stage.curriculum.end=0.5",
                   "stage.curriculum.ramp_steps=0"],
}


def recipe(overrides: list[str]):
    """The training recipe, set up from the config tree as ``train.py`` composes it."""
    from hydra import compose, initialize_config_dir

    from msd_train.config import CONF_DIR
    from msd_train.training.recipe import TrainRecipe
    from msd_train.validate import check_train

    with initialize_config_dir(str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=["logging.wandb.mode=disabled", "logging.progress=false", *overrides])
    from omegaconf import OmegaConf

    check_train(OmegaConf.to_container(cfg, resolve=True))
    r = TrainRecipe(cfg)
    r.setup()
    return r


def held_out(r) -> dict:
    """Per held-out split: accept-at-position (top-1 agreement at step j given steps < j),
    unconditional agreement, simulated tau; and the mean simulated tau."""
    res = r.validate()
    out = {"sim_tau": res["sim_tau"]}
    for name, v in res.items():
        if isinstance(v, dict):
            out[name] = {"accept_at_pos": v["agree_cond"], "agree_uncond": v["agree_uncond"], "sim_tau": v["sim_tau"],
                         "top1": v["top1"], "loss": v["loss"]}
    return out


def train_for(r, budget_s: float) -> dict:
    """Optimizer steps until the wall-clock budget or ``train.max_steps``; then the export."""
    t0 = time.perf_counter()
    while r.step < r.cfg.train.max_steps and time.perf_counter() - t0 < budget_s:
        r.train_step()
        r.step += 1
    wall = time.perf_counter() - t0
    r.export("final")
    return {"steps": r.step, "wall_s": round(wall, 1)}


def decoder_tau(head: Path, out: Path, method: str, extra: list[str]) -> dict:
    cmd = [sys.executable, "eval.py", f"draft={head}", f"out={out}", f"decoding={method}", "target.dtype=float32",
           "progress=false", *extra]
    print("+", shlex.join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "WANDB_MODE": "disabled"})
    rep = json.loads((out / "report.json").read_text())["overall"]
    return {"tau": rep["tau"], "outputs_match_ar": rep["outputs_match_ar"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", required=True, help="the trained head both arms start from (an export folder)")
    ap.add_argument("--budget", type=float, required=True, help="wall-clock seconds of training per arm")
    ap.add_argument("--max-steps", type=int, default=1000, help="at most this many steps; each arm's lr schedule horizon")
    ap.add_argument("--out", required=True)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS),
                    help="the arms to train now; the others' results (and 'before') are kept from OUT/results.json")
    ap.add_argument("--eval", nargs="*", default=[], choices=["chain", "tree"], help="eval.py decoders to run")
    ap.add_argument("--eval-args", nargs="*", default=[], help="extra eval.py overrides (target, bench, ...)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for both arms (after --)")
    args = ap.parse_args()
    head, out = Path(args.head).resolve(), Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    kept = out / "results.json"
    results: dict = {"arms": {}, "heads": {"before": str(head)}}
    if kept.is_file() and set(args.arms) != set(ARMS):
        old = json.loads(kept.read_text())
        if old["heads"]["before"] != str(head):
            ap.error(f"{kept} compares heads trained from {old['heads']['before']}, not {head}: use another --out")
        results = {"arms": {a: v for a, v in old["arms"].items() if a not in args.arms},
                   "heads": {a: v for a, v in old["heads"].items() if a not in args.arms},
                   "meta_kept": old.get("meta")}
    for arm in args.arms:
        stage = ARMS[arm]
        for old_eval in sorted(out.glob(f"eval-{arm}-*")):  # the decoder's runs of this arm's earlier head
            aside = out / "earlier" / f"{old_eval.name}-{time.strftime('%Y%m%d-%H%M%S')}"
            aside.parent.mkdir(exist_ok=True)
            old_eval.rename(aside)
            print(f"{old_eval} measured the arm's earlier head: moved to {aside}", flush=True)
        r = recipe([*stage, f"stage.init_from={head}", f"run_dir={out / arm}", f"train.max_steps={args.max_steps}",
                    "resume=false", "checkpoint.every=1000000", *args.overrides])
        try:
            if "before" not in results["arms"]:
                results["arms"]["before"] = held_out(r)
            run = train_for(r, args.budget)
            results["arms"][arm] = {**run, **held_out(r)}
            results["heads"][arm] = str(r.stage_dir / "final")
        finally:
            r.cleanup()
        print(arm, json.dumps({k: v for k, v in results["arms"][arm].items() if not isinstance(v, dict)}), flush=True)
    for method in args.eval:
        for arm, h in results["heads"].items():
            if f"{method}_decoder" in results["arms"][arm]:
                continue
            results["arms"][arm][f"{method}_decoder"] = decoder_tau(Path(h), out / f"eval-{arm}-{method}", method,
                                                                    args.eval_args)
    results["meta"] = {
        "command": "python -m lab.studies.on_policy " + shlex.join(sys.argv[1:]),
        "budget_s": args.budget, "max_steps": args.max_steps,
        "device": f"cpu {platform.processor() or platform.machine()}, torch threads "
                  f"{__import__('torch').get_num_threads()}",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    summary = {arm: round(v["sim_tau"], 3) for arm, v in results["arms"].items()}
    print(f"held-out simulated tau: {summary}; {out / 'results.json'}")


if __name__ == "__main__":
    main()
