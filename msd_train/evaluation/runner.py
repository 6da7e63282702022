"""Run plain and speculative decoding over a benchmark, side by side, in one process.

For every item both decoders answer every turn of the conversation, each with its own
previous answers in the context (as a user of that decoder would see them). They are
interleaved item by item, after a warm-up, so that the two timings see the same
machine state. Every generation is timed from outside the decoder (``timing.py``: a
``PhaseTimer`` observes the loop, CUDA events read once per generation, no synchronisation
per phase); plain decoding has no phases to time.
Both decode in one ``Workspace`` for the whole benchmark, so each step is captured once
per shape (CUDA graphs), not once per prompt; capture time is kept out of the timings.

Where a turn's speculative output parts from plain decoding's, the record says where,
the target's top-2 logit margin there, and whether that is a near-tie within the dtype's
rounding (a verification over many nodes and a one-token step round differently, so
bf16 can flip an argmax between two near-equal logits) or a real mismatch.
"""

from __future__ import annotations

import dataclasses

import torch

from msd_train.decoding import DecodeConfig, Generation, Workspace, prefill
from msd_train.evaluation.bench import BenchItem
from msd_train.evaluation.metrics import classify_mismatch
from msd_train.evaluation.timing import timed_generate
from msd_train.targets import Encoded, TargetProtocol
from msd_train.targets.chat import count_image_markers


def answer_turns(target: TargetProtocol, draft, item: BenchItem, config: DecodeConfig, images: list,
                 generator: torch.Generator | None = None, workspace: Workspace | None = None
                 ) -> list[tuple[Encoded, Generation]]:
    """Each turn's (prompt, generation), the generation timed (``timing.timed_generate``);
    every answer is fed into the next turn."""
    messages, out = [], []
    for turn in item.turns:
        messages.append({"role": "user", "content": turn})
        n_images = count_image_markers(messages)
        prompt = target.encode_prompt(messages, images[:n_images])
        gen = timed_generate(target, draft, prompt, config, generator, captions=item.captions[:n_images],
                             workspace=workspace)
        out.append((prompt, gen))
        messages.append({"role": "assistant", "content": gen.text})
    return out


def compare_outputs(target: TargetProtocol, prompt: Encoded, ar_prompt: Encoded, spec: list[int], ar: list[int]) -> dict:
    """Where the speculative tokens part from plain decoding's: the first position, the
    target's top-2 logit margin there (one target forward over the prompt and plain
    decoding's tokens before it) and the kind (``metrics.classify_mismatch``). A turn whose
    prompt already differs (an earlier turn parted) is ``earlier_turn``: its outputs are
    answers to different conversations."""
    if spec == ar:
        return {"first_mismatch": None, "mismatch_top2_margin": None, "mismatch": None}
    first = next((i for i, (a, b) in enumerate(zip(spec, ar)) if a != b), min(len(spec), len(ar)))
    if not torch.equal(prompt.input_ids, ar_prompt.input_ids):
        return {"first_mismatch": first, "mismatch_top2_margin": None, "mismatch": "earlier_turn"}
    if first >= min(len(spec), len(ar)):  # one output stops where the other goes on: not a rounding question
        return {"first_mismatch": first, "mismatch_top2_margin": None, "mismatch": "real"}
    ids = torch.cat([ar_prompt.input_ids, torch.as_tensor(ar[:first], dtype=ar_prompt.input_ids.dtype)])
    state = prefill(target, None, Encoded(ids, torch.zeros_like(ids), ar_prompt.pixel), capacity=len(ids))
    margin, kind = classify_mismatch(state.next_logits, spec[first], ar[first])
    return {"first_mismatch": first, "mismatch_top2_margin": margin, "mismatch": kind}


def _record(index: int, item: BenchItem, turn: int, prompt_len: int, spec: Generation, ar: Generation,
            greedy: bool, parted: dict | None) -> dict:
    cycles = spec.cycles
    return {
        "item": index,
        "id": item.id,
        "category": item.category,
        "turn": turn,
        "prompt_tokens": prompt_len,
        "new_tokens": len(spec.tokens),
        "ar_new_tokens": len(ar.tokens),
        "time_s": spec.t_total,
        "ar_time_s": ar.t_total,
        "prefill_s": spec.t_prefill,
        "ar_prefill_s": ar.t_prefill,
        "capture_s": spec.t_capture,  # graph capture, not in time_s
        "ar_capture_s": ar.t_capture,
        "draft_s": sum(c.t_draft for c in cycles),
        "verify_s": sum(c.t_verify for c in cycles),
        "accept_s": sum(c.t_accept for c in cycles),
        "cycles": len(cycles),
        "tau": spec.tau,
        "accepted": [c.accepted for c in cycles],
        "tried": [c.tried for c in cycles],
        "tree_size": [c.tree_size for c in cycles],
        "outputs_match_ar": (spec.tokens == ar.tokens) if greedy else None,
        **(parted or {}),
        "stop_reason": spec.stop_reason,
        "ar_stop_reason": ar.stop_reason,
        "text": spec.text,
        "ar_text": ar.text,
    }


def evaluate(target: TargetProtocol, draft, items: list[BenchItem], config: DecodeConfig, warmup: int = 1, seed: int = 0,
             progress: bool = True, on_record=None, workspace: Workspace | None = None) -> list[dict]:
    """Per-turn records (see ``_record``) for every item; ``warmup`` items are decoded
    first by both decoders and not recorded. ``on_record(record)`` is called per turn.
    Both decoders use ``workspace`` (a new one when none is given) for every prompt."""
    from tqdm.auto import tqdm

    workspace = workspace if workspace is not None else Workspace()
    # the plain baseline: a chain's drafting options (draft_min_prob) mean nothing to it, and its checks refuse them
    ar_config = dataclasses.replace(config, method="ar", draft_min_prob=0.0)
    greedy = config.sampling.greedy

    def generator(i: int):
        if greedy:
            return None
        return torch.Generator(device=target.device).manual_seed(seed * 1_000_003 + i)

    for item in tqdm(items[:warmup], desc="warm-up", disable=not progress, leave=False):
        images = item.load_images()
        answer_turns(target, None, item, ar_config, images, generator(-1), workspace)
        answer_turns(target, draft, item, config, images, generator(-1), workspace)

    records = []
    bar = tqdm(total=sum(len(it.turns) for it in items), desc=f"eval {config.method}", unit="turn",
               disable=not progress)
    committed = cycles = 0
    t_spec = t_ar = 0.0
    for i, item in enumerate(items):
        images = item.load_images()
        ar = answer_turns(target, None, item, ar_config, images, generator(i), workspace)
        spec = answer_turns(target, draft, item, config, images, generator(i), workspace)
        for turn, ((prompt, s), (ar_prompt, a)) in enumerate(zip(spec, ar)):
            parted = compare_outputs(target, prompt, ar_prompt, s.tokens, a.tokens) if greedy else None
            rec = _record(i, item, turn, int(prompt.input_ids.shape[0]), s, a, greedy, parted)
            records.append(rec)
            if on_record is not None:
                on_record(rec)
            committed += sum(x + 1 for x in rec["accepted"])
            cycles += rec["cycles"]
            t_spec += rec["time_s"]
            t_ar += rec["ar_time_s"]
            bar.update(1)
        ar_tps = sum(r["ar_new_tokens"] for r in records) / max(t_ar, 1e-9)
        tps = sum(r["new_tokens"] for r in records) / max(t_spec, 1e-9)
        bar.set_postfix(tau=f"{committed / max(cycles, 1):.2f}", speedup=f"{tps / max(ar_tps, 1e-9):.2f}x")
    bar.close()
    return records
