"""The field's training settings against the project's defaults at equal data: msd stage 1 from
scratch on the same text conversations from the store (``scale_train.sh settings-field-N`` and
``settings-today-N``), held-out validation every 1,024 conversations. Reads the committed metrics
(``results/scale/runs/RUN/stage1/metrics.jsonl.gz``), prints the table and writes
``results/scale/settings.json``.

    python -m lab.studies.real_lm.settings_table [--n 8192]
"""

from __future__ import annotations

import argparse
import json

from lab.studies.real_lm.head_summary import RESULTS, rows

ARMS = {  # arm -> (conversations per optimizer step, what it sets)
    "field": (16, "lr 1e-4, 30 warm-up steps, cosine to 1e-5; micro-batch 4 x 4 accumulation steps"),
    "today": (4, "the defaults: lr 3e-4, 20 warm-up steps, cosine to 3e-5; micro-batch 4, no accumulation"),
}


def table(n: int) -> dict:
    out = {}
    for arm, (per_step, what) in ARMS.items():
        vals = [r for r in rows(f"scale/runs/settings-{arm}-{n}/stage1") if "val/text/sim_tau" in r]
        out[arm] = {"settings": what, "conversations_per_step": per_step,
                    "validations": [{"conversations": r["step"] * per_step, "step": r["step"],
                                     "sim_tau": round(r["val/text/sim_tau"], 4), "top1": round(r["val/text/top1"], 4)}
                                    for r in vals]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=8192, help="the runs' N (text conversations each)")
    a = ap.parse_args()
    arms = table(a.n)
    by_conv = {}
    for arm, data in arms.items():
        for v in data["validations"]:
            by_conv.setdefault(v["conversations"], {})[arm] = v
    print("| text conversations seen | field: simulated tau / top-1 | today: simulated tau / top-1 |")
    print("|---|---|---|")
    for c in sorted(by_conv):
        cells = [f"{by_conv[c][arm]['sim_tau']:.3f} / {by_conv[c][arm]['top1']:.3f}" if arm in by_conv[c] else "-"
                 for arm in ARMS]
        print(f"| {c:,} | " + " | ".join(cells) + " |")
    path = RESULTS / "scale" / "settings.json"
    path.write_text(json.dumps({"n": a.n, "data": "text_train of the scale splits, from the msd-only store",
                                "validation": "64 held-out text conversations, 5-step simulated tau", "arms": arms},
                               indent=1) + "\n")
    print(path)


if __name__ == "__main__":
    main()
