"""Evaluation outputs: report.json, report.md, report.png and samples.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

from msd_train.evaluation.metrics import DEFINITIONS
from msd_train.runtime import atomic_file
from msd_train.runtime import atomic_write_text as _atomic_write


def write_samples(path: Path, records: list[dict]) -> None:
    _atomic_write(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def fmt(v, digits: int = 3) -> str:
    """A metric for a Markdown table: '-' for missing, yes/no, fixed decimals, short lists."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(fmt(x, 2) for x in v) + "]"
    return str(v)


COLUMNS = [("tau", "tau", 3), ("speedup", "speedup", 2), ("tokens_per_s", "tokens/s", 1),
           ("ar_tokens_per_s", "AR tokens/s", 1), ("outputs_match_ar", "matches AR", 0),
           ("n_samples", "samples", 0), ("n_turns", "turns", 0), ("new_tokens", "new tokens", 0)]


def markdown(report: dict) -> str:
    d = report["decoding"]
    lines = [
        f"# Speculative decoding: {report['method']} on {report['bench']}",
        "",
        f"- target: `{report['target']}`" + (f" (adapter `{report['adapter']}`)" if report.get("adapter") else ""),
        f"- draft: `{report['draft']}`",
        f"- device: {report['device']}, dtype {report['dtype']}",
        "- decoding: " + ", ".join(f"{k}={fmt(v)}" for k, v in d.items()),
        f"- warm-up items: {report['warmup']}; date {report['date']}",
        f"- command: `{report['command']}`",
        "",
        "| | " + " | ".join(label for _, label, _ in COLUMNS) + " |",
        "|" + "---|" * (len(COLUMNS) + 1),
    ]
    groups = [("**overall**", report["overall"])] + list(report["per_category"].items())
    for name, m in groups:
        lines.append("| " + " | ".join([name] + [fmt(m.get(k), n) for k, _, n in COLUMNS]) + " |")
    lines += ["", "Acceptance per draft position (conditional: position i accepted given positions < i were):", ""]
    lines += [f"- {name.strip('*')}: {fmt(m.get('accept_at_pos'))}" for name, m in groups]
    o = report["overall"]
    lines += [
        "",
        "Time per verification cycle (ms): "
        f"draft {fmt(o.get('draft_ms_per_cycle'), 2)}, verify {fmt(o.get('verify_ms_per_cycle'), 2)}, "
        f"accept + cache bookkeeping {fmt(o.get('accept_ms_per_cycle'), 2)}; "
        f"plain decoding {fmt(o.get('ar_ms_per_token'), 2)} ms per token.",
        "",
    ]
    if report.get("ensemble"):
        from msd_train.evaluation.ensemble import ensemble_table

        e = report["ensemble"]
        lines += [f"Ensemble drafting ({e['ensemble']}): each input variant alone and the ensemble, every turn "
                  f"decoded by each (tau: {e['tau_is']}; drafting time: {e['draft_time_is']}).", ""]
        lines += ensemble_table(e) + [""]
    lines += [
        "Definitions:",
        "",
    ]
    lines += [f"- `{k}`: {v}" for k, v in DEFINITIONS.items()]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> bool:
    """Acceptance per draft position (overall and per category) and tau per category.
    Returns False (and writes nothing) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    groups = {"overall": report["overall"], **report["per_category"]}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, m in groups.items():
        acc = m.get("accept_at_pos") or []
        if acc:
            ax1.plot(range(1, len(acc) + 1), acc, marker="o", label=name, lw=2.5 if name == "overall" else 1.2)
    ax1.set(xlabel="draft position", ylabel="conditional acceptance", ylim=(0, 1.02),
            title="acceptance per draft position")
    ax1.xaxis.get_major_locator().set_params(integer=True)
    if ax1.lines:
        ax1.legend(fontsize=8)
    else:
        ax1.text(0.5, 0.5, "no draft positions (plain decoding)", ha="center", transform=ax1.transAxes)
    names = list(groups)
    taus = [groups[n].get("tau") or 0 for n in names]
    bars = ax2.bar(names, taus, color=["tab:gray"] + ["tab:blue"] * (len(names) - 1))
    for bar, n in zip(bars, names):
        sp = groups[n].get("speedup")
        if sp:
            ax2.annotate(f"{sp:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                         ha="center", va="bottom", fontsize=8)
    ax2.set(ylabel="tau (tokens / verification)", title="tau per category (label: speedup)")
    ax2.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.suptitle(f"{report['method']} on {report['bench']} ({report['device']})", fontsize=10)
    fig.tight_layout()
    with atomic_file(path, keep_suffix=True) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return True


def write_report(out: Path, report: dict, records: list[dict]) -> dict[str, Path]:
    """Write every output into ``out``; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "md": out / "report.md", "samples": out / "samples.jsonl"}
    write_samples(paths["samples"], records)
    _atomic_write(paths["md"], markdown(report))
    _atomic_write(paths["json"], json.dumps(report, indent=2) + "\n")
    if plot(report, out / "report.png"):
        paths["png"] = out / "report.png"
    return paths
