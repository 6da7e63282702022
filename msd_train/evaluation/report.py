"""Evaluation outputs: report.json, report.md, report.png and samples.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

from msd_train.evaluation.metrics import DEFINITIONS
from msd_train.formatting import fmt
from msd_train.runtime import atomic_file
from msd_train.runtime import atomic_write_text as _atomic_write


def write_samples(path: Path, records: list[dict]) -> None:
    _atomic_write(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


COLUMNS = [("tau", "tau", 3), ("speedup", "speedup", 2), ("tokens_per_s", "tokens/s", 1),
           ("ar_tokens_per_s", "AR tokens/s", 1), ("outputs_match_ar", "matches AR", 0),
           ("n_samples", "samples", 0), ("n_turns", "turns", 0), ("new_tokens", "new tokens", 0)]

#: Per-position acceptance from fewer trials than this is shown apart (greyed in the plot,
#: in italics in report.md): at 20 trials a rate of 0.5 has a standard error of 0.11.
MIN_TRIALS = 20
#: Groups drawn in the plot besides "overall"; the smaller ones are pooled into "other".
MAX_SERIES = 7


def _grouping(report: dict) -> str:
    return report.get("group_by") or "category"


def pool(groups: list[dict]) -> dict:
    """The metrics of several groups taken together, from their per-group totals: what
    ``summarize`` would give for their records pooled."""
    def total(key):
        return sum(g.get(key) or 0 for g in groups)

    cycles = total("cycles")
    depth = max((len(g.get("accept_trials") or []) for g in groups), default=0)
    trials = [sum((g.get("accept_trials") or [])[i] if i < len(g.get("accept_trials") or []) else 0 for g in groups)
              for i in range(depth)]
    hits = [sum((g["accept_at_pos"][i] or 0) * g["accept_trials"][i] for g in groups
                if i < len(g.get("accept_trials") or [])) for i in range(depth)]
    time_s, ar_time_s = total("time_s"), total("ar_time_s")
    tps = total("new_tokens") / time_s if time_s else None
    ar_tps = total("ar_new_tokens") / ar_time_s if ar_time_s else None
    return {
        "tau": sum((g.get("tau") or 0) * (g.get("cycles") or 0) for g in groups) / cycles if cycles else None,
        "accept_at_pos": [h / n if n else None for h, n in zip(hits, trials)],
        "accept_trials": trials,
        "speedup": tps / ar_tps if tps and ar_tps else None,
        "cycles": cycles, "n_samples": total("n_samples"), "n_turns": total("n_turns"),
        "new_tokens": total("new_tokens"), "ar_new_tokens": total("ar_new_tokens"), "time_s": time_s,
        "ar_time_s": ar_time_s,
    }


def drawn_groups(report: dict, max_series: int = MAX_SERIES) -> dict[str, dict]:
    """"overall", the ``max_series`` largest groups (by turns) and "other (k ...)" for the rest pooled."""
    per = report["per_category"]
    order = sorted(per, key=lambda name: (-(per[name].get("n_turns") or 0), name))
    keep, rest = order[:max_series], order[max_series:]
    if len(rest) == 1:  # pooling one group hides its name for nothing
        keep, rest = order, []
    out = {"overall": report["overall"], **{name: per[name] for name in keep}}
    if rest:
        out[f"other ({len(rest)} {_grouping(report)} labels)"] = pool([per[name] for name in rest])
    return out


def _series_label(name: str, m: dict) -> str:
    n = m.get("n_turns")
    return f"{name} ({n} turn{'s' if n != 1 else ''})" if n is not None else name


def _acceptance_cell(p, n) -> str:
    if p is None:
        return "-"
    cell = f"{p:.2f} ({n})"
    return f"_{cell}_" if n is not None and n < MIN_TRIALS else cell


def markdown(report: dict) -> str:
    d = report["decoding"]
    group = _grouping(report)
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
        f"Overall and per {group} (the `{group}` field of each sample):",
        "",
        f"| {group} | " + " | ".join(label for _, label, _ in COLUMNS) + " |",
        "|" + "---|" * (len(COLUMNS) + 1),
    ]
    groups = [("**overall**", report["overall"])] + list(report["per_category"].items())
    for name, m in groups:
        lines.append("| " + " | ".join([name] + [fmt(m.get(k), n) for k, _, n in COLUMNS]) + " |")
    depth = max((len(m.get("accept_at_pos") or []) for _, m in groups), default=0)
    if depth:
        lines += ["", "Acceptance per draft position (conditional: position i accepted given positions < i were), "
                  f"with the number of cycles that tried it in brackets; in italics: fewer than {MIN_TRIALS} trials, "
                  "too few to read:", "",
                  f"| {group} | " + " | ".join(f"pos {i}" for i in range(1, depth + 1)) + " |",
                  "|" + "---|" * (depth + 1)]
        for name, m in groups:
            acc, trials = m.get("accept_at_pos") or [], m.get("accept_trials") or []
            cells = [_acceptance_cell(acc[i] if i < len(acc) else None, trials[i] if i < len(trials) else None)
                     for i in range(depth)]
            lines.append("| " + " | ".join([name] + cells) + " |")
    o = report["overall"]
    lines += [
        "",
        "Time per verification cycle (ms): "
        f"draft {fmt(o.get('draft_ms_per_cycle'), 2)}, verify {fmt(o.get('verify_ms_per_cycle'), 2)}, "
        f"accept + cache bookkeeping {fmt(o.get('accept_ms_per_cycle'), 2)}; "
        f"plain decoding {fmt(o.get('ar_ms_per_token'), 2)} ms per token.",
        "",
    ]
    if o.get("exact_match_fraction") is not None:
        lines += [f"Outputs vs plain greedy decoding: {fmt(o['exact_match_fraction'], 3)} of the turns identical; "
                  f"{o.get('near_tie_mismatches', 0)} part at a near-tie (within the dtype's rounding), "
                  f"{o.get('real_mismatches', 0)} are real mismatches (see `mismatch` in samples.jsonl).", ""]
    g = report.get("graphs")
    if g and g.get("enabled"):
        lines += [f"CUDA graphs: {g['captures']} captured once each for the whole run in {fmt(g['graph_capture_s'], 2)} s "
                  "(not in the times above)"
                  + (f"; steps run eagerly after a failed capture: {', '.join(g['eager_fallback_steps'])}"
                     if g.get("eager_fallback_steps") else "") + ".", ""]
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


def plot(report: dict, path: Path, max_series: int = MAX_SERIES) -> bool:
    """Write ``figure(report)`` to ``path``; False (and nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig = figure(report, max_series)
    with atomic_file(path, keep_suffix=True) as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return True


def figure(report: dict, max_series: int = MAX_SERIES):
    """Acceptance per draft position and tau per group, for "overall", the largest groups
    and the rest pooled as "other" (see ``drawn_groups``); positions tried fewer than
    ``MIN_TRIALS`` times are drawn hollow on a dotted line. One legend below both panels."""
    import matplotlib.pyplot as plt

    groups = drawn_groups(report, max_series)
    group = _grouping(report)
    palette = [c for i, c in enumerate(plt.get_cmap("tab10").colors) if i != 7]  # tab10's grey is "other"'s
    colors = {name: ("black" if name == "overall" else "tab:gray" if name.startswith("other (") else
                     palette[(i - 1) % len(palette)]) for i, name in enumerate(groups)}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [1.1, 1]})
    handles = []
    for name, m in groups.items():
        acc = m.get("accept_at_pos") or []
        trials = m.get("accept_trials") or [MIN_TRIALS] * len(acc)
        pts = [(i + 1, a, n) for i, (a, n) in enumerate(zip(acc, trials)) if a is not None]
        if not pts:
            continue
        c, lw, z = colors[name], (2.6 if name == "overall" else 1.4), (3 if name == "overall" else 2)
        x = [p[0] for p in pts]
        y = [p[1] for p in pts]
        ax1.plot(x, y, ls=":", lw=1, color=c, alpha=0.6, zorder=z)  # the whole series, thin and dotted
        solid = [(p[0], p[1]) for p in pts if p[2] >= MIN_TRIALS]
        if solid:
            line, = ax1.plot(*zip(*solid), marker="o", lw=lw, color=c, zorder=z,
                             label=_series_label(name, m))
            handles.append(line)
        thin = [(p[0], p[1]) for p in pts if p[2] < MIN_TRIALS]
        if thin:
            ax1.plot(*zip(*thin), ls="none", marker="o", mfc="white", mec=c, color=c, alpha=0.7)
            if not solid:
                handles.append(ax1.plot([], [], marker="o", mfc="white", mec=c, color=c, ls=":",
                                        label=_series_label(name, m))[0])
    depth = max((len(m.get("accept_at_pos") or []) for m in groups.values()), default=0)
    if depth:
        overall_trials = report["overall"].get("accept_trials") or []
        ax1.set_xticks(range(1, depth + 1))
        ax1.set_xticklabels([f"{i}\nn={overall_trials[i - 1]}" if i <= len(overall_trials) else str(i)
                             for i in range(1, depth + 1)], fontsize=8)
        ax1.set_xlim(0.7, depth + 0.3)
        ax1.text(0.99, 0.98, f"hollow: fewer than {MIN_TRIALS} trials\nn: cycles that tried the position (overall)",
                 transform=ax1.transAxes, ha="right", va="top", fontsize=7, color="dimgray")
    else:
        ax1.text(0.5, 0.5, "no draft positions (plain decoding)", ha="center", transform=ax1.transAxes)
    ax1.set(xlabel="draft position", ylabel="conditional acceptance", ylim=(0, 1.05),
            title="acceptance per draft position")
    ax1.grid(alpha=0.3)

    names = list(groups)
    taus = [groups[n].get("tau") or 0 for n in names]
    ys = list(range(len(names)))[::-1]  # overall on top
    ax2.barh(ys, taus, color=[colors[n] for n in names], height=0.7)
    ax2.set_yticks(ys)
    ax2.set_yticklabels([n if len(n) <= 28 else n[:27] + "…" for n in names], fontsize=8)
    top = max(taus, default=0) or 1
    for y, n, t in zip(ys, names, taus):
        sp = groups[n].get("speedup")
        label = f"{t:.2f}" + (f"  ({sp:.2f}x)" if sp else "")
        ax2.text(t + top * 0.01, y, label, va="center", fontsize=8)
    ax2.set_xlim(0, top * 1.3)  # room for the labels at the bars' ends
    ax2.set(xlabel="tau (tokens / verification)", title=f"tau per {group} (speedup in brackets)")
    ax2.grid(axis="x", alpha=0.3)

    fig.suptitle(f"{report['method']} on {report['bench']} ({report['device']})", fontsize=10)
    if handles:
        fig.legend(handles=handles, loc="lower center", ncol=min(3, len(handles)), fontsize=8, frameon=False)
    rows = -(-len(handles) // 3) if handles else 0
    fig.tight_layout(rect=(0, 0.045 * rows + 0.01, 1, 0.97))
    return fig


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
