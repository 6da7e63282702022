"""Benchmark metrics from per-turn records, overall and per category.

* ``tau``: tokens committed per target verification forward, the bonus token included
  (plain decoding: 1), counted over all verification cycles, before stop truncation; the
  first new token (from the prefill forward) is not a verification.
* ``accept_at_pos[i]``: conditional acceptance of draft position i+1: the share of cycles
  that accepted it among those that tried it (positions before it accepted and the
  drafted tree had a token there); None where no cycle tried it. ``accept_trials[i]`` is
  that number of cycles: the sample size behind each figure.
* ``tokens_per_s`` / ``ar_tokens_per_s``: new tokens over wall-clock seconds, prefill
  included, summed over all turns; ``speedup`` is their ratio (a ratio of totals, not a
  mean of per-sample ratios).
* ``exact_match_fraction``, ``near_tie_mismatches``, ``real_mismatches`` (greedy): how the
  speculative outputs compare with plain decoding's, turn by turn (``classify_mismatch``).
"""

from __future__ import annotations

#: a mismatch is a near-tie when the two tokens' logits are this many units of the dtype's
#: rounding (eps x the top logit's magnitude) apart or less: a 60-node verification and a
#: one-token step accumulate in different orders, and in bf16 that moves a logit by a few
#: such units (in fp32 the same rule leaves room only for exact ties)
NEAR_TIE_UNITS = 4

DEFINITIONS = {
    "tau": "tokens committed per target verification forward, bonus token included (plain decoding: 1); "
           "mean over all verification cycles, before stop truncation",
    "accept_at_pos": "conditional acceptance per draft position: P(position i accepted | positions < i accepted "
                     "and the draft had a token at position i); null where no cycle tried position i",
    "accept_trials": "per draft position, the verification cycles that tried it: the sample size behind "
                     "accept_at_pos",
    "tokens_per_s": "new tokens / wall-clock seconds (prefill included), totals over all turns",
    "speedup": "tokens_per_s / ar_tokens_per_s: ratio of totals over the same prompts, same process, after warm-up",
    "outputs_match_ar": "greedy only: every turn's tokens equal plain greedy decoding's exactly",
    "exact_match_fraction": "greedy only: the share of turns whose tokens equal plain greedy decoding's exactly",
    "near_tie_mismatches": "greedy only: turns that part from plain decoding where the target's logits of the two "
                           f"tokens are within {NEAR_TIE_UNITS} x eps(dtype) x |top logit| (rounding can flip the "
                           "argmax: verification and a one-token step round differently)",
    "real_mismatches": "greedy only: turns that part from plain decoding by more than rounding (a decoder error "
                       "unless the target is nondeterministic); turns after an earlier parting are not counted",
    "graph_capture_s": "seconds spent capturing CUDA graphs in the measured turns (once per shape for the whole "
                       "benchmark); not in time_s",
}


def classify_mismatch(logits, spec_token: int, ar_token: int) -> tuple[float, str]:
    """At the first position where speculative and plain outputs part: the target's top-2
    logit margin there, and ``near_tie`` when the two tokens' logits are within the dtype's
    rounding (``NEAR_TIE_UNITS``) of each other, else ``real``. ``logits`` (V,) in the
    target's dtype."""
    import torch  # here: reading reports needs no torch

    top = logits.float().topk(2).values
    unit = torch.finfo(logits.dtype).eps * max(abs(float(top[0])), 1.0)
    gap = abs(float(logits[spec_token].float() - logits[ar_token].float()))
    return float(top[0] - top[1]), "near_tie" if gap <= NEAR_TIE_UNITS * unit else "real"


def summarize(records: list[dict], greedy: bool) -> dict:
    accepted = [a for r in records for a in r["accepted"]]
    tried = [t for r in records for t in r["tried"]]
    cycles = len(accepted)
    depth = max(tried, default=0)
    time_s = sum(r["time_s"] for r in records)
    ar_time_s = sum(r["ar_time_s"] for r in records)
    new = sum(r["new_tokens"] for r in records)
    ar_new = sum(r["ar_new_tokens"] for r in records)
    tps = new / time_s if time_s > 0 else None
    ar_tps = ar_new / ar_time_s if ar_time_s > 0 else None

    def per_cycle_ms(key):
        return 1000 * sum(r[key] for r in records) / cycles if cycles else None

    trials = [sum(t >= i for t in tried) for i in range(1, depth + 1)]
    return {
        "tau": sum(a + 1 for a in accepted) / cycles if cycles else None,
        "accept_at_pos": [sum(a >= i for a in accepted) / n if n else None for i, n in enumerate(trials, 1)],
        "accept_trials": trials,
        "tokens_per_s": tps,
        "ar_tokens_per_s": ar_tps,
        "speedup": tps / ar_tps if tps and ar_tps else None,
        "outputs_match_ar": all(r["outputs_match_ar"] for r in records) if greedy else None,
        "exact_match_fraction": sum(bool(r["outputs_match_ar"]) for r in records) / len(records)
        if greedy and records else None,
        "near_tie_mismatches": sum(r.get("mismatch") == "near_tie" for r in records) if greedy else None,
        "real_mismatches": sum(r.get("mismatch") == "real" for r in records) if greedy else None,
        "graph_capture_s": sum(r.get("capture_s", 0.0) + r.get("ar_capture_s", 0.0) for r in records),
        "n_samples": len({r["item"] for r in records}),
        "n_turns": len(records),
        "new_tokens": new,
        "ar_new_tokens": ar_new,
        "cycles": cycles,
        "time_s": time_s,
        "ar_time_s": ar_time_s,
        "prefill_s": sum(r["prefill_s"] for r in records),
        "ar_prefill_s": sum(r["ar_prefill_s"] for r in records),
        "draft_ms_per_cycle": per_cycle_ms("draft_s"),
        "verify_ms_per_cycle": per_cycle_ms("verify_s"),
        "accept_ms_per_cycle": per_cycle_ms("accept_s"),
        "ar_ms_per_token": 1000 * ar_time_s / ar_new if ar_new else None,
    }


def summarize_by_category(records: list[dict], greedy: bool) -> dict[str, dict]:
    cats: dict[str, list[dict]] = {}
    for r in records:
        cats.setdefault(r["category"], []).append(r)
    return {c: summarize(rs, greedy) for c, rs in sorted(cats.items())}
