"""Which block size pays on a CPU: tokens a cycle over the cost of verifying them.

A block of B drafts B-1 tokens in one head forward and the target verifies B rows (the root
and the proposals) in one forward. With conditional acceptances c_1, c_2, .. (the chance that
proposal i is accepted when those before it were), a cycle yields 1 + c_1 + c_1 c_2 + ..
tokens; against plain decoding's one token per one-row forward, the speedup before the
draft's own cost is

    tokens(B) * forward_ms(1) / forward_ms(B)

``forward_ms`` is measured (``lab/bench/cpu_linear.py``: the target's forward over q new rows
after a 256-token prefix); the acceptances come from a run's held-out validation
(``val/text/agree_cond_i`` in its metrics.jsonl), the last one repeated past the rollout.

    python -m lab.bench.block_size FORWARD_JSON METRICS_JSONL [--kernels "fp32 onednn"] [--split text]
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path


def read_rows(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def acceptances(rows: list[dict], split: str) -> tuple[int, list[float]]:
    val = [r for r in rows if f"val/{split}/agree_cond_1" in r]
    if not val:
        raise SystemExit(f"block_size: no held-out val/{split}/agree_cond_* rows in the metrics")
    last = val[-1]
    c, i = [], 1
    while f"val/{split}/agree_cond_{i}" in last:
        c.append(float(last[f"val/{split}/agree_cond_{i}"]))
        i += 1
    return int(last["step"]), c


def table(forward_ms: dict[int, float], cond: list[float]) -> list[dict]:
    out = []
    for rows in sorted(q for q in forward_ms if q >= 2):
        tokens, reach = 1.0, 1.0
        for i in range(rows - 1):
            reach *= cond[min(i, len(cond) - 1)]
            tokens += reach
        out.append({"block_size": rows, "tokens_a_cycle": round(tokens, 3),
                    "verify_ms": forward_ms[rows], "plain_ms": forward_ms[1],
                    "speedup_before_draft_cost": round(tokens * forward_ms[1] / forward_ms[rows], 3)})
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("forward", type=Path, help="lab/bench/cpu_linear.py's JSON")
    p.add_argument("metrics", type=Path, help="a run's metrics.jsonl(.gz) with held-out validation rows")
    p.add_argument("--kernels", default="fp32 onednn", help="which of the forward JSON's kernel rows")
    p.add_argument("--split", default="text", choices=["text", "mm"])
    a = p.parse_args(argv)
    fwd = json.loads(a.forward.read_text())
    ms = {int(q): v["median"] for q, v in fwd["ms"][a.kernels].items() if q.isdigit()}
    step, cond = acceptances(read_rows(a.metrics), a.split)
    print(json.dumps({"forward": str(a.forward), "kernels": a.kernels, "cpu": fwd.get("cpu"),
                      "acceptances": {"metrics": str(a.metrics), "step": step, "split": a.split,
                                      "conditional": [round(x, 3) for x in cond]},
                      "rows": table(ms, cond)}, indent=1))


if __name__ == "__main__":
    main()
