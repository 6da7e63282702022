"""Markdown table of eval.py reports: python -m lab.studies.real_lm.table EVAL_DIR...

Folders named NAME-rN are repeats of one setting: one row, the median and the range of
the timings over the repeats (tau and outputs are deterministic and must agree).
cycle / step is the cost of a cycle (draft + verify + accept) in plain decoding steps of
the same run; tau / that ratio is the speedup the decoding loop alone implies (the
measured speedup also pays the prefill, which both decoders share).
"""

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

runs = defaultdict(list)
for d in sys.argv[1:]:
    r = json.loads((Path(d) / "report.json").read_text())
    runs[re.sub(r"-r\d+$", "", Path(d).name)].append(r.get("overall", r))


def spread(values, fmt):
    mid = statistics.median(values)
    return fmt.format(mid) if len(values) == 1 else f"{fmt.format(mid)} ({fmt.format(min(values))}-{fmt.format(max(values))})"


print("| setting | runs | tau | accepted at position 1, 2, 3 | speedup | tokens/s (plain) | draft / verify / accept ms "
      "| cycle / plain step | tau / ratio | outputs = plain |")
print("|---|---|---|---|---|---|---|---|---|---|")
for name, os_ in runs.items():
    taus = {round(o["tau"], 6) for o in os_}
    o = os_[0]
    pos = ", ".join(f"{x:.2f}" for x in (o.get("accept_at_pos") or [])[:3])
    cycle = [o["draft_ms_per_cycle"] + o["verify_ms_per_cycle"] + o["accept_ms_per_cycle"] for o in os_]
    ratio = [c / o["ar_ms_per_token"] for c, o in zip(cycle, os_)]
    split = " / ".join(f"{statistics.median(o[k + '_ms_per_cycle'] for o in os_):.1f}" for k in ("draft", "verify", "accept"))
    tau = o["tau"] if len(taus) == 1 else float("nan")
    print(f"| {name} | {len(os_)} | {tau:.3f} | {pos} | {spread([o['speedup'] for o in os_], '{:.2f}x')} | "
          f"{spread([o['tokens_per_s'] for o in os_], '{:.1f}')} ({spread([o['ar_tokens_per_s'] for o in os_], '{:.1f}')}) | "
          f"{split} | {spread(ratio, '{:.2f}')} | {tau / statistics.median(ratio):.2f}x | "
          f"{all(o['outputs_match_ar'] for o in os_)} |")
