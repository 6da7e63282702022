"""Markdown table of eval.py reports: python benchmarks/real_lm/table.py EVAL_DIR..."""

import json
import sys
from pathlib import Path

print("| run | tau | accepted at position 1, 2, 3 (conditional) | tokens/s (plain) | speedup | draft / verify / accept ms per cycle | outputs = plain |")
print("|---|---|---|---|---|---|---|")
for d in sys.argv[1:]:
    r = json.loads((Path(d) / "report.json").read_text())
    o = r.get("overall", r)
    pos = ", ".join(f"{x:.2f}" for x in (o.get("accept_at_pos") or [])[:3])
    split = " / ".join(f"{o[k + '_ms_per_cycle']:.0f}" for k in ("draft", "verify", "accept"))
    print(f"| {Path(d).name} | {o['tau']:.3f} | {pos} | {o['tokens_per_s']:.2f} ({o['ar_tokens_per_s']:.2f}) | "
          f"{o['speedup']:.2f}x | {split} | {o['outputs_match_ar']} |")
