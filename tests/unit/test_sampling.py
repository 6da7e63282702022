"""Sampling is lossless: what the speculative decoder emits is distributed as the target.

The target here is a one-layer causal LM over 8 tokens written out in a few lines, with
the interface of ``msd_train.targets.Target`` that the decoder uses (a transformers
``DynamicCache``, 4-D additive tree masks, explicit positions). It is small enough that
thousands of draws through the real decode loop take seconds, and that the exact distribution
of every 3-token continuation can be enumerated. The "good" head reads the same weights
as the target (high acceptance, not exact: it misses the first token and sees shifted
positions); the "bad" head is another random model, sharpened so it disagrees confidently.
"""

from __future__ import annotations

import pytest
import torch
from builders.sampling import (
    PROMPT,
    TinyHead,
    TinyTarget,
    V,
    assert_same_distribution,
    bad_head,
    block_head,
    exact_continuations,
)

from msd_train.decoding import (
    BlockDrafter,
    DecodeConfig,
    HeadDrafter,
    SamplingParams,
    Tree,
    accept_sampling,
    chain,
    decode,
    logits_to_probs,
    prefill,
    sample,
)
from msd_train.targets import Encoded

DRAWS = 20_000  # the acceptance rule alone (microseconds a draw)

# Draws of the real decode loop (milliseconds a draw; the bad head, at ~3 cycles a draw, half).
# The chi-square test's threshold p = 1e-3 is its false-alarm rate: a correct decoder fails one
# run in a thousand, whatever the draws. With 6,000 draws it detects, with 95% power, an output
# distribution q whose chi-square divergence sum((q - p)^2 / p) from the target's p is 0.009 to
# 0.013 by case (0.024 for the bad head's 3,000): about 2 points of probability moved between
# two 10% continuations. The rejection-rule bugs it guards are 10 to 30 times that: a residual
# that keeps the rejected token (tree) or is p instead of max(p - q, 0) (chain, block) measured
# 0.15 to 0.31, failing at p < 1e-77 with 3,000 draws. 20,000 draws detected 0.0027 to 0.005,
# at 3.3 times the time (200 s of the suite's 21 minutes).
DECODE_DRAWS = 6_000


pytestmark = pytest.mark.usefixtures("one_thread")


# ----- the real decode loop -----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "method, head, sampling",
    [
        ("tree", "good", SamplingParams(temperature=0.8, top_k=6, top_p=0.9, rank_by="warped")),
        ("tree", "good", SamplingParams(temperature=0.8, top_k=6, top_p=0.9, rank_by="raw")),
        ("chain", "bad", SamplingParams(temperature=1.0)),
        ("chain", "pruned", SamplingParams(temperature=1.0)),
        ("tree", "pruned", SamplingParams(temperature=0.8, top_k=6, rank_by="warped")),
        ("block", "block", SamplingParams(temperature=0.9, top_p=0.9)),
    ],
    ids=["tree-warped", "tree-raw", "chain", "chain-draft-vocabulary", "tree-draft-vocabulary", "block"],
)
def test_decode_loop_is_lossless(method, head, sampling):
    """Prefill once, then decode 3 tokens from a copy of that state, many times: the
    tree (deterministic top-k proposals, ranked by warped or by raw log-probabilities:
    raw ranking also proposes tokens the warpers removed, which must never be emitted)
    and chain (proposals sampled from the head) paths of the loop, for a head that is
    mostly accepted and one that is mostly not; and a dflash head's block (all proposals
    drawn at once, each from its own block position's distribution: ``decoding/block.py``)."""
    draws = DECODE_DRAWS if head != "bad" else DECODE_DRAWS // 2
    target = TinyTarget(seed=0)
    # "pruned": the good head drafting from a draft vocabulary without 3 of the 8 ids (never proposed,
    # still emitted by the target at their probability)
    vocab = torch.tensor([True, False, True, True, False, True, True, False])
    draft = {"good": lambda: TinyHead(target.lm), "bad": lambda: bad_head(seed=1),
             "pruned": lambda: TinyHead(target.lm, vocab=vocab), "block": lambda: block_head(target)}[head]()
    config = DecodeConfig(method=method, depth=1, top_k=3, total_tokens=6, k=2, max_new_tokens=3,
                          eos_token_ids=(), sampling=sampling)
    drafter = BlockDrafter(draft) if method == "block" else HeadDrafter(draft)
    state0 = prefill(target, drafter, Encoded(PROMPT, torch.zeros_like(PROMPT)))
    gen = torch.Generator().manual_seed(0)
    counts: dict[tuple, int] = {}
    accepted = cycles = 0
    for _ in range(draws):
        out = decode(target, state0.clone(), config, gen)
        key = tuple(out.tokens)
        counts[key] = counts.get(key, 0) + 1
        accepted += sum(c.accepted for c in out.cycles)
        cycles += len(out.cycles)
    assert_same_distribution(counts, exact_continuations(target, sampling), draws)
    rate = accepted / cycles  # both regimes are exercised: mostly accepted vs mostly rejected
    assert rate > 1.0 if head == "good" else rate < 0.8 if head in ("bad", "block") else rate > 0.3, rate
    assert accepted > 0, "no proposal was ever accepted: acceptance went untested"


# ----- the acceptance rule alone -----------------------------------------------------
#
# A toy target with exact conditionals P0 (first token) and P1[a] (token after a); a
# cycle that ends after one token gets its second token from P1, as the next cycle would.


def _conditionals(seed: int):
    g = torch.Generator().manual_seed(seed)
    return g, (torch.randn(V, generator=g) * 2).softmax(-1), (torch.randn(V, V, generator=g) * 2).softmax(-1)


def _first_two(tree: Tree, path: list[int], bonus: int, P1: torch.Tensor, g) -> tuple[int, int]:
    out = tree.tokens[path[1:]].tolist() + [bonus]
    if len(out) == 1:
        out.append(int(sample(P1[out[0]], g)))
    return out[0], out[1]


@pytest.mark.slow
@pytest.mark.parametrize("quality", ["good", "bad"])
def test_accept_sampling_over_a_tree_of_top_k_proposals(quality):
    """Siblings proposed deterministically (point masses), tried in order."""
    g, P0, P1 = _conditionals(0)
    order = P0.argsort(descending=quality == "good").tolist()  # good: the likeliest tokens first
    a, b, c = order[:3]
    deeper = P1[a].argsort(descending=quality == "good").tolist()[:2]
    tree = Tree(tokens=torch.tensor([0, a, b, c, *deeper]), parents=torch.tensor([-1, 0, 0, 0, 1, 1]),
                depths=torch.tensor([0, 1, 1, 1, 2, 2]))
    target_probs = torch.stack([P0, P1[a], P1[b], P1[c], P0, P0])  # depth-2 rows: any distribution
    counts: dict[tuple, int] = {}
    accepted = 0
    for _ in range(DRAWS):
        path, bonus = accept_sampling(tree, target_probs, g)
        accepted += len(path) - 1
        key = _first_two(tree, path, bonus, P1, g)
        counts[key] = counts.get(key, 0) + 1
    expected = {(x, y): float(P0[x] * P1[x, y]) for x in range(V) for y in range(V)}
    assert_same_distribution(counts, expected, DRAWS)
    assert accepted / DRAWS > 0.8 if quality == "good" else accepted / DRAWS < 0.3


@pytest.mark.slow
@pytest.mark.parametrize("quality", ["good", "bad"])
def test_accept_sampling_over_a_chain_of_sampled_proposals(quality):
    """Chain tokens sampled from q (drawn in one batch), tested with min(1, p/q)."""
    g, P0, P1 = _conditionals(1)
    if quality == "good":
        Q0, Q1 = P0 * 0.8 + 0.2 / V, P1 * 0.8 + 0.2 / V  # close to p
    else:
        Q0, Q1 = (-3 * P0.log()).softmax(-1), (-3 * P1.log()).softmax(-1)  # mass where p has least
    x1 = sample(Q0.expand(DRAWS, V), g)
    x2 = sample(Q1[x1], g)
    counts: dict[tuple, int] = {}
    accepted = 0
    for i in range(DRAWS):
        a = int(x1[i])
        tree = chain(torch.tensor([0]), torch.stack([x1[i], x2[i]]), torch.stack([Q0, Q1[a]]))
        path, bonus = accept_sampling(tree, torch.stack([P0, P1[a], P0]), g)
        accepted += len(path) - 1
        key = _first_two(tree, path, bonus, P1, g)
        counts[key] = counts.get(key, 0) + 1
    expected = {(x, y): float(P0[x] * P1[x, y]) for x in range(V) for y in range(V)}
    assert_same_distribution(counts, expected, DRAWS)
    assert accepted / DRAWS > 1.2 if quality == "good" else accepted / DRAWS < 0.5


def test_warpers():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert torch.equal(logits_to_probs(logits, SamplingParams()), torch.tensor([[1.0, 0, 0, 0, 0]]))
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[0, 2:] == 0).all() and torch.allclose(p[0, :2], logits[0, :2].softmax(-1))
    full = logits.softmax(-1)[0]
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=float(full[0] + 0.01)))
    assert (p[0, 2:] == 0).all() and (p[0, :2] > 0).all()  # smallest set reaching top_p
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.01))
    assert torch.equal(p, torch.tensor([[1.0, 0, 0, 0, 0]]))  # the top token always survives
    p = logits_to_probs(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(p, (logits / 0.5).softmax(-1))


def test_tree_ranking_warped_or_raw():
    """``rank_by`` changes what a sampling tree ranks by, not what it samples from."""
    from msd_train.decoding.sampling import log_probs

    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    raw = log_probs(logits, SamplingParams(temperature=0.5, top_k=2, rank_by="raw"))
    assert torch.allclose(raw, logits.log_softmax(-1))  # no temperature, no top-k: EAGLE-2's scores
    warped = log_probs(logits, SamplingParams(temperature=0.5, top_k=2, rank_by="warped"))
    assert torch.allclose(warped[0, :2], (logits[0, :2] / 0.5).log_softmax(-1)) and warped[0, 2:].isinf().all()
    with pytest.raises(ValueError, match="rank_by"):
        SamplingParams(temperature=0.7, rank_by="tempered")
