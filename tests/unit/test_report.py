"""report.md and report.png stay readable on a real benchmark's ~20 categories."""

from __future__ import annotations

import random

import pytest

from msd_train.evaluation.metrics import summarize, summarize_by_category
from msd_train.evaluation.report import MAX_SERIES, MIN_TRIALS, drawn_groups, markdown, pool

# 19 labels with MMSpec-like sizes: four of 100, two near 50, thirteen small ones
CATS = {"default": 100, "textvqa": 100, "coco caption": 100, "charts": 100, "convbench instruction-following": 47,
        "mm-mt-bench": 53, **{f"MMMU subject number {i:02d} with a long name": 3 + i % 8 for i in range(13)}}


def records(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for cat, n in CATS.items():
        p = rng.uniform(0.4, 0.9)
        for _ in range(n):
            acc, tried = [], []
            for _ in range(rng.randint(2, 12)):
                a = 0
                while a < 6 and rng.random() < p:
                    a += 1
                acc.append(a)
                tried.append(min(6, a + 1))
            new = sum(x + 1 for x in acc)
            out.append({"item": len(out), "category": cat, "accepted": acc, "tried": tried, "new_tokens": new,
                        "ar_new_tokens": new + rng.randint(0, 3), "time_s": rng.uniform(0.5, 2), "ar_time_s": 2.0,
                        "prefill_s": 0.0, "ar_prefill_s": 0.0, "draft_s": 0.0, "verify_s": 0.0, "accept_s": 0.0,
                        "outputs_match_ar": True})
    return out


def report_of(recs: list[dict]) -> dict:
    return {"draft": "d", "target": "t", "adapter": None, "bench": "mmspec", "group_by": "category", "method": "tree",
            "decoding": {"method": "tree"}, "device": "cpu", "dtype": "float32", "warmup": 0, "date": "today",
            "command": "python eval.py", "overall": summarize(recs, True),
            "per_category": summarize_by_category(recs, True)}


def test_pooled_other_equals_the_metrics_of_its_records():
    recs = records()
    small = [c for c, n in CATS.items() if n < 20]
    per = summarize_by_category(recs, True)
    pooled = pool([per[c] for c in small])
    direct = summarize([r for r in recs if r["category"] in small], True)
    for key in ("tau", "speedup", "n_turns", "new_tokens"):
        assert pooled[key] == pytest.approx(direct[key]), key
    assert pooled["accept_trials"] == direct["accept_trials"]
    assert pooled["accept_at_pos"] == pytest.approx(direct["accept_at_pos"])


def test_untried_positions_are_none_and_trials_are_counted():
    recs = records()[:1]
    recs[0].update(accepted=[0, 1], tried=[1, 2])
    m = summarize(recs + [{**recs[0], "accepted": [5], "tried": [6], "item": 1}], True)
    assert m["accept_trials"] == [3, 2, 1, 1, 1, 1] and m["accept_at_pos"][:2] == [2 / 3, 1 / 2]
    one = summarize(recs, True)
    assert one["accept_at_pos"] == [0.5, 0.0] and one["accept_trials"] == [2, 1]


def test_markdown_shows_trials_and_marks_thin_figures():
    md = markdown(report_of(records()))
    assert "| category | pos 1 | pos 2 |" in md and f"fewer than {MIN_TRIALS} trials" in md
    row = next(line for line in md.splitlines() if line.startswith("| MMMU subject number 00") and "(" in line)
    cells = row.strip("|").split("|")[1:]
    thin = [c.strip() for c in cells if c.strip() != "-" and int(c.split("(")[1].split(")")[0]) < MIN_TRIALS]
    assert thin and all(c.startswith("_") and c.endswith("_") for c in thin)


def test_plot_of_19_categories_keeps_legend_and_labels_apart(tmp_path):
    pytest.importorskip("matplotlib")
    from msd_train.evaluation.report import figure, plot

    report = report_of(records())
    groups = drawn_groups(report)
    assert len(groups) == MAX_SERIES + 2  # overall, the largest, "other"
    assert list(groups)[:5] == ["overall", "charts", "coco caption", "default", "textvqa"]
    other = list(groups)[-1]
    assert other.startswith("other (") and groups[other]["n_turns"] == sum(
        n for c, n in CATS.items() if c not in groups)

    fig = figure(report)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    (legend,) = fig.legends
    assert len(legend.get_texts()) <= MAX_SERIES + 2
    lb = legend.get_window_extent(renderer)
    assert box.x0 <= lb.x0 and lb.x1 <= box.x1 and box.y0 <= lb.y0 and lb.y1 <= box.y1  # inside the figure
    ax1, ax2 = fig.axes
    for ax in (ax1, ax2):
        assert not lb.overlaps(ax.get_window_extent(renderer))  # below the panels, not on them
    labels = [t.get_window_extent(renderer) for t in ax2.get_yticklabels() if t.get_text()]
    assert len(labels) == len(groups)
    assert all(not a.overlaps(b) for i, a in enumerate(labels) for b in labels[i + 1:])  # bar labels apart
    assert all(box.x0 <= b.x0 for b in labels)  # long names are not cut off at the left
    assert plot(report, tmp_path / "report.png") and (tmp_path / "report.png").stat().st_size > 10_000
