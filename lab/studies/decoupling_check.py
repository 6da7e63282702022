"""Does `draft.decouple_visual` reach an msd3 head in the decoder? Two stage-2 exports
trained from the same stage-1 head with decoupling on (b) and off (c), measured on the
image prompts of the tiny benchmark:

- how far apart their weights are;
- the first draft distribution after the decoder's prefill (the head over the prompt,
  image positions included) for b, for c, and for b's weights with the flag turned off
  (the flag alone): largest logit difference and whether the top-1 token changes;
- tree decoding with b and with c: tokens accepted per cycle, cycle by cycle.

    python -m lab.studies.decoupling_check B_FINAL C_FINAL [--per-category N] [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch

from msd_train.decoding import DecodeConfig, HeadDrafter, generate, prefill
from msd_train.evaluation.bench import load_bench
from msd_train.hub import load_head
from msd_train.targets import load_target

ROOT = Path(__file__).resolve().parents[2]


@torch.inference_mode()
def first_draft(target, head, prompt) -> torch.Tensor:
    """Logits (target vocabulary) of the head's first draft after the decoder's prefill."""
    state = prefill(target, HeadDrafter(head), prompt)
    state.tokens.append(int(state.next_logits.argmax()))
    out = state.drafter.feed_pending(target, state.pending())
    return head.logits(out[:, None], target)[0, 0].float()


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    ok = torch.isfinite(a) & torch.isfinite(b)
    return {"max_abs_logit_diff": float((a[ok] - b[ok]).abs().max()), "same_top1": int(a.argmax()) == int(b.argmax()),
            "top10_overlap": len(set(a.topk(10).indices.tolist()) & set(b.topk(10).indices.tolist()))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("b", help="stage-2 export trained with decoupling (draft.decouple_visual=true)")
    ap.add_argument("c", help="stage-2 export trained without it")
    ap.add_argument("--per-category", type=int, default=4, help="image items per category (the ablation's)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    target = load_target(str(ROOT / "data" / "tiny-llava"), device="cpu")
    b, c = load_head(args.b, target), load_head(args.c, target)
    assert b.config.decouple_visual and not c.config.decouple_visual, "b must decouple, c must not"
    b_off = copy.deepcopy(b)
    b_off.config.decouple_visual = False
    sb, sc = b.state_dict(), c.state_dict()
    num = sum(float((sb[k].float() - sc[k].float()).square().sum()) for k in sb if sb[k].is_floating_point())
    den = sum(float(sb[k].float().square().sum()) for k in sb if sb[k].is_floating_point())
    weights = {"max_abs_diff": max(float((sb[k].float() - sc[k].float()).abs().max()) for k in sb
                                   if sb[k].is_floating_point()),
               "relative_l2": (num / den) ** 0.5}
    bench = {"kind": "conversations", "max_per_category": args.per_category, "sources": [
        {"path": str(ROOT / "data/tiny/llava_heldout.json"), "image_root": str(ROOT / "data/tiny/images")}]}
    items = [it for it in load_bench(bench) if it.images]
    config = DecodeConfig(method="tree", depth=5, top_k=10, total_tokens=60, max_new_tokens=args.max_new_tokens)
    rows = []
    for item in items:
        images = item.load_images()
        messages = [{"role": "user", "content": item.turns[0]}]
        prompt = target.encode_prompt(messages, images)
        lb, lc, loff = (first_draft(target, h, prompt) for h in (b, c, b_off))
        gb, gc = (generate(target, h, prompt, config) for h in (b, c))
        acc_b, acc_c = [x.accepted for x in gb.cycles], [x.accepted for x in gc.cycles]
        rows.append({"id": item.id, "category": item.category, "b_vs_c": compare(lb, lc),
                     "flag_only": compare(lb, loff), "same_output": gb.tokens == gc.tokens,
                     "accepted_b": acc_b, "accepted_c": acc_c, "same_accepted": acc_b == acc_c})
    n = len(rows)
    summary = {
        "weights_b_vs_c": weights, "image_prompts": n,
        "b_vs_c_same_first_top1": sum(r["b_vs_c"]["same_top1"] for r in rows),
        "b_vs_c_max_logit_diff": max(r["b_vs_c"]["max_abs_logit_diff"] for r in rows),
        "flag_only_same_first_top1": sum(r["flag_only"]["same_top1"] for r in rows),
        "flag_only_max_logit_diff": max(r["flag_only"]["max_abs_logit_diff"] for r in rows),
        "prompts_with_identical_accepted_per_cycle": sum(r["same_accepted"] for r in rows),
        "tau_b": sum(sum(a + 1 for a in r["accepted_b"]) for r in rows) / sum(len(r["accepted_b"]) for r in rows),
        "tau_c": sum(sum(a + 1 for a in r["accepted_c"]) for r in rows) / sum(len(r["accepted_c"]) for r in rows),
    }
    out = {"command": "python -m lab.studies.decoupling_check " + " ".join(
        [args.b, args.c, f"--per-category {args.per_category}"]), "summary": summary, "prompts": rows}
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
