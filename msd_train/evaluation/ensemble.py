"""Ensemble drafting in evaluation: tau of every single input variant beside the ensemble's,
and the ensemble's drafting-time overhead over the head alone (variant M).

Each configuration decodes every turn of every item (its own answers in the context), and
the configurations are interleaved item by item after a warm-up, so their timings see the
same machine state. tau is a ratio of totals (committed tokens over verification
forwards); drafting time is per draft block (per cycle), so that configurations with
different acceptance compare the same work.
"""

from __future__ import annotations

import dataclasses

from msd_train.decoding import DecodeConfig, Workspace
from msd_train.evaluation.bench import BenchItem
from msd_train.evaluation.runner import answer_turns
from msd_train.formatting import fmt
from msd_train.targets import TargetProtocol


def variant_configs(config: DecodeConfig) -> dict[str, DecodeConfig]:
    """``{name: config}``: each variant alone (M is the plain decoder, the others a one-row
    ensemble), then the ensemble itself under ``<ensemble>-<variants>``; the runner times
    their phases (``timing.py``), the drafting time is what this report compares."""
    out = {}
    for v in config.variants:
        if v == "M":
            out["M"] = dataclasses.replace(config, ensemble=None, variants=("M",))
        else:
            out[v] = dataclasses.replace(config, ensemble="ibed", variants=(v,))
    out[ensemble_name(config)] = config
    return out


def ensemble_name(config: DecodeConfig) -> str:
    return f"{config.ensemble}-{''.join(config.variants)}"


def run_variants(target: TargetProtocol, draft, items: list[BenchItem], configs: dict[str, DecodeConfig], warmup: int = 1,
                 progress: bool = False) -> dict[str, list[dict]]:
    """Per configuration, one row per turn: category, accepted per cycle, drafting seconds."""
    from tqdm.auto import tqdm

    # one workspace per configuration (their heads have different row counts): each keeps its
    # captured steps across the prompts
    spaces = {name: Workspace() for name in configs}
    for item in items[:warmup]:
        images = item.load_images()
        for name, cfg in configs.items():
            answer_turns(target, draft, item, cfg, images, workspace=spaces[name])
    rows = {name: [] for name in configs}
    for item in tqdm(items, desc="variants", disable=not progress):
        images = item.load_images()
        for name, cfg in configs.items():
            for _, gen in answer_turns(target, draft, item, cfg, images, workspace=spaces[name]):
                rows[name].append({"id": item.id, "category": item.category, "accepted": [c.accepted for c in gen.cycles],
                                   "draft_s": sum(c.t_draft for c in gen.cycles), "prefill_s": gen.t_prefill,
                                   "tokens": gen.tokens})
    return rows


def _tau(rows: list[dict]) -> float | None:
    acc = [a for r in rows for a in r["accepted"]]
    return sum(a + 1 for a in acc) / len(acc) if acc else None


def summarize_variants(rows: dict[str, list[dict]], single: str = "M") -> dict:
    """tau overall and per category for each configuration, drafting ms per cycle, and
    each configuration's drafting-time overhead over ``single`` (a fraction)."""
    cats = sorted({r["category"] for rs in rows.values() for r in rs})
    out = {"tau": {}, "tau_per_category": {}, "draft_ms_per_cycle": {}, "draft_overhead_vs_" + single: {},
           "prefill_ms_per_turn": {}}
    for name, rs in rows.items():
        out["tau"][name] = _tau(rs)
        out["tau_per_category"][name] = {c: _tau([r for r in rs if r["category"] == c]) for c in cats}
        cycles = sum(len(r["accepted"]) for r in rs)
        out["draft_ms_per_cycle"][name] = 1000 * sum(r["draft_s"] for r in rs) / cycles if cycles else None
        out["prefill_ms_per_turn"][name] = 1000 * sum(r["prefill_s"] for r in rs) / len(rs) if rs else None
    base = out["draft_ms_per_cycle"].get(single)
    for name, ms in out["draft_ms_per_cycle"].items():
        out["draft_overhead_vs_" + single][name] = (ms / base - 1) if base and ms is not None else None
    names = list(rows)
    out["outputs_identical"] = all(
        [r["tokens"] for r in rows[n]] == [r["tokens"] for r in rows[names[0]]] for n in names
    )
    return out


def ensemble_report(target: TargetProtocol, draft, items: list[BenchItem], config: DecodeConfig, warmup: int = 1,
                    progress: bool = False) -> dict:
    """The ``ensemble`` section of ``report.json``."""
    configs = variant_configs(config)
    summary = summarize_variants(run_variants(target, draft, items, configs, warmup, progress))
    summary["variants"] = list(config.variants)
    summary["ensemble"] = ensemble_name(config)
    summary["tau_is"] = "ratio of totals: committed tokens over verification forwards"
    summary["draft_time_is"] = "drafting seconds per draft block (cycle), TABED's weight search included"
    summary["prefill_time_is"] = "target and head prefill per turn (variant C adds a text-only target pass)"
    if not config.sampling.greedy:
        summary.pop("outputs_identical")
    return summary


def ensemble_table(summary: dict) -> list[str]:
    """The ``ensemble`` section as Markdown table lines: tau per category and overall,
    drafting ms per cycle, overhead over M alone, prefill ms per turn."""
    cats = sorted(next(iter(summary["tau_per_category"].values())))
    base = next(k for k in summary if k.startswith("draft_overhead_vs_"))
    lines = ["| drafting | " + " | ".join(cats) + f" | overall | draft ms/cycle | overhead vs "
             f"{base.removeprefix('draft_overhead_vs_')} | prefill ms/turn |",
             "|---" * (len(cats) + 5) + "|"]
    for name, tau in summary["tau"].items():
        per = summary["tau_per_category"][name]
        over = summary[base].get(name)
        lines.append(f"| {name} | " + " | ".join(fmt(per[c]) for c in cats) + f" | {fmt(tau)} | "
                     f"{fmt(summary['draft_ms_per_cycle'][name], 2)} | "
                     f"{'-' if over is None else f'{100 * over:+.0f}%'} | "
                     f"{fmt(summary.get('prefill_ms_per_turn', {}).get(name), 2)} |")
    return lines
