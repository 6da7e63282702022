"""Exactness that means what it says: where speculative and plain outputs part, the report
says whether the target was at a near-tie (rounding can flip the argmax) or not."""

from __future__ import annotations

import pytest
import torch
from builders import random_image, tiny_llava_target

from msd_train.decoding import DecodeConfig, Workspace, generate
from msd_train.draft import MSDDraftConfig, MSDDraftModel
from msd_train.evaluation.bench import BenchItem
from msd_train.evaluation.metrics import classify_mismatch, summarize
from msd_train.evaluation.runner import compare_outputs, evaluate

pytestmark = pytest.mark.usefixtures("one_thread")


def test_classify_mismatch_by_the_dtypes_rounding():
    logits = torch.tensor([20.0, 19.0, 3.0, -5.0], dtype=torch.bfloat16)
    assert classify_mismatch(logits, 1, 0) == (1.0, "real")  # a whole logit apart: not rounding
    # bf16 at 20: one rounding unit is 20 * 2**-7 ~ 0.16; 0.125 apart is a near-tie there...
    near = torch.tensor([20.0, 19.875, 3.0, -5.0], dtype=torch.bfloat16)
    assert classify_mismatch(near, 1, 0) == (0.125, "near_tie")
    # ...and a real mismatch in fp32, whose rounding unit is 65,536 times smaller
    assert classify_mismatch(near.float(), 1, 0)[1] == "real"
    assert classify_mismatch(torch.tensor([7.0, 7.0, 1.0]), 1, 0) == (0.0, "near_tie")  # an exact tie, any dtype


@pytest.fixture(scope="module")
def tied_target():
    """A tiny target whose lm_head rows of two tokens are equal: at every position their
    logits tie exactly, and argmax takes the lower id."""
    target = tiny_llava_target(seed=1)
    prompt = target.encode_prompt([{"role": "user", "content": "<image>\nwhat is this"}], [random_image(1)])
    plain = generate(target, None, prompt, DecodeConfig(method="ar", max_new_tokens=12, eos_token_ids=()))
    a = plain.tokens[5]
    b = next(t for t in range(a + 1, target.config.text_config.vocab_size) if t not in plain.tokens)
    with torch.no_grad():
        target.lm_head.weight[b] = target.lm_head.weight[a]
    again = generate(target, None, prompt, DecodeConfig(method="ar", max_new_tokens=12, eos_token_ids=()))
    assert again.tokens[:6] == plain.tokens[:6]
    return target, prompt, again.tokens, a, b


def test_a_forced_near_tie_is_classified_as_such(tied_target):
    target, prompt, ar, a, b = tied_target
    spec = ar[:5] + [b] + ar[6:]  # the other side of the exact tie at position 5
    assert compare_outputs(target, prompt, prompt, spec, ar) == {
        "first_mismatch": 5, "mismatch_top2_margin": 0.0, "mismatch": "near_tie"}


def test_a_real_mismatch_is_classified_as_real(tied_target):
    target, prompt, ar, a, b = tied_target
    vocab = target.config.text_config.vocab_size
    other_token = next(t % vocab for t in range(ar[2] + 7, ar[2] + 99) if t % vocab not in (a, b))  # just wrong
    spec = ar[:2] + [other_token] + ar[3:]
    parted = compare_outputs(target, prompt, prompt, spec, ar)
    assert parted["first_mismatch"] == 2 and parted["mismatch"] == "real" and parted["mismatch_top2_margin"] >= 0
    assert compare_outputs(target, prompt, prompt, ar, ar)["mismatch"] is None
    other = target.encode_prompt([{"role": "user", "content": "something else"}], [])
    assert compare_outputs(target, other, prompt, spec, ar)["mismatch"] == "earlier_turn"


def test_report_counts_exact_turns_and_real_mismatches():
    base = dict(accepted=[1], tried=[1], time_s=1.0, ar_time_s=1.0, new_tokens=2, ar_new_tokens=2, prefill_s=0.0,
                ar_prefill_s=0.0, draft_s=0.0, verify_s=0.0, accept_s=0.0, capture_s=0.5, ar_capture_s=0.25)
    kinds = [None, None, "near_tie", "real", "earlier_turn"]
    records = [dict(base, item=i, outputs_match_ar=kind is None, mismatch=kind) for i, kind in enumerate(kinds)]
    m = summarize(records, greedy=True)
    assert m["outputs_match_ar"] is False and m["exact_match_fraction"] == 0.4
    assert m["near_tie_mismatches"] == 1 and m["real_mismatches"] == 1
    assert m["graph_capture_s"] == 3.75
    assert summarize(records, greedy=False)["real_mismatches"] is None


def test_evaluate_records_the_comparison_and_keeps_one_workspace():
    """Through the runner: every turn carries the comparison; the benchmark's prompts share
    one workspace (one set of cache buffers)."""
    target = tiny_llava_target()
    torch.manual_seed(0)
    head = MSDDraftModel(MSDDraftConfig.from_target_config(target.config, "x")).eval()
    items = [BenchItem(str(i), "c", [f"say {w}", "and again"]) for i, w in enumerate(["one", "two words"])]
    workspace = Workspace()
    config = DecodeConfig(method="tree", depth=2, top_k=3, total_tokens=8, max_new_tokens=6)
    records = evaluate(target, head, items, config, warmup=0, progress=False, workspace=workspace)
    assert len(records) == 4 and all(r["outputs_match_ar"] and r["mismatch"] is None for r in records)
    assert set(workspace.caches) == {"target", "head"}
    assert summarize(records, greedy=True)["exact_match_fraction"] == 1.0


def test_bf16_chains_equal_plain_decoding_bit_for_bit():
    """A bf16 target on a CPU: oneDNN rounds a one-row product differently from a row of a
    multi-row one, so a plain step and the verification of the same position could round
    apart and greedy outputs part at near-ties. The plain step runs two rows
    (``plain_rows=auto``) and eager attention reads a chain's keys in the plain loop's
    order: every chain's tokens equal plain decoding's."""
    target = tiny_llava_target(seed=3)
    target.model.to(torch.bfloat16)
    target.model.set_attn_implementation("eager")
    torch.manual_seed(0)
    head = MSDDraftModel(MSDDraftConfig.from_target_config(target.config, "x")).eval().to(torch.bfloat16)
    prompts = [target.encode_prompt([{"role": "user", "content": text}], images) for text, images in
               [("<image>\nwhat is this", [random_image(1)]), ("tell me a long story", []),
                ("count to twenty", []), ("<image>\ndescribe it", [random_image(2, 24)])]]
    # the mechanism, which the tiny target's small products may not need (oneDNN's one-row
    # products round apart from 1,536 inputs on: benchmarks/real_lm/results/matmul_rows.json):
    # no forward of the target's layers runs a single row
    rows = []
    layer = target.model.model.language_model.layers[0].mlp.down_proj
    hook = layer.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[-2]))
    for prompt in prompts:
        plain = generate(target, None, prompt, DecodeConfig(method="ar", max_new_tokens=48, eos_token_ids=()))
        # k=3 with draft_min_prob: an untrained head's chains are often cut to no draft (a one-node verification)
        for k, min_prob in ((1, 0.0), (3, 0.0), (3, 0.5)):
            config = DecodeConfig(method="chain", k=k, draft_min_prob=min_prob, max_new_tokens=48, eos_token_ids=())
            chain = generate(target, head, prompt, config)
            assert chain.tokens == plain.tokens, (k, min_prob, chain.tokens, plain.tokens)
    hook.remove()
    assert any(c.tree_size == 1 for c in chain.cycles), "no chain was cut to a lone root: the padded verify went untested"
    assert min(rows) == 2
    target.model.to(torch.float32)  # fp32: one row (MKL's two-row products cost twice as much)
    rows.clear()
    layer.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[-2]))
    generate(target, None, prompts[1], DecodeConfig(method="ar", max_new_tokens=4, eos_token_ids=()))
    assert min(rows) == 1
