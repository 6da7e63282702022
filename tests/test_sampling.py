"""Sampling is lossless: what the speculative decoder emits is distributed as the target.

The target here is a one-layer causal LM over 8 tokens written out in a few lines, with
the interface of ``msd_train.targets.Target`` that the decoder uses (a transformers
``DynamicCache``, 4-D additive tree masks, explicit positions). It is small enough that
20,000 draws through the real decode loop take seconds, and that the exact distribution
of every 3-token continuation can be enumerated. The "good" head reads the same weights
as the target (high acceptance, not exact: it misses the first token and sees shifted
positions); the "bad" head is another random model, sharpened so it disagrees confidently.
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch
from scipy.stats import chisquare
from torch import nn
from transformers import DynamicCache

from msd_train.decoding import (
    DecodeConfig,
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

V, H = 8, 16
DRAWS = 20_000


pytestmark = pytest.mark.usefixtures("one_thread")


class TinyLM:
    """One single-head attention layer with learned absolute positions (plain tensors:
    module call overhead would dominate 20,000 decodes)."""

    def __init__(self, seed: int, scale: float = 3.0):
        g = torch.Generator().manual_seed(seed)
        w = lambda *shape: torch.randn(*shape, generator=g) / math.sqrt(H)  # noqa: E731
        self.embed_tokens = nn.Embedding.from_pretrained(w(V, H))
        self.lm_head = nn.Linear(H, V, bias=False).requires_grad_(False)
        self.lm_head.weight.data = w(V, H) * scale  # peaked, far from uniform distributions
        self.pos, self.qkv, self.o = w(64, H), w(3 * H, H), w(H, H)

    def layer(self, x, position_ids, attention_mask, cache):
        x = x + self.pos[position_ids]
        q, k, v = torch.nn.functional.linear(x, self.qkv).chunk(3, dim=-1)
        if cache is not None:
            k, v = cache.update(k[:, None], v[:, None], 0)
            k, v = k[:, 0], v[:, 0]
        att = q @ k.transpose(-1, -2) / math.sqrt(H)
        if attention_mask is None:  # causal over the cache
            t, s = q.shape[1], k.shape[1]
            allowed = torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None]
            att = att.masked_fill(~allowed, float("-inf"))
        else:
            att = att + attention_mask[:, 0]
        out = torch.nn.functional.linear(att.softmax(-1) @ v, self.o)
        return torch.nn.functional.layer_norm(x + out, (H,))


class TinyTarget:
    """The part of the Target interface the decoder reads."""

    family, image_token_id, tokenizer, eos_token_ids = "tiny", -1, None, []
    device, dtype = torch.device("cpu"), torch.float32

    def __init__(self, seed: int):
        self.lm = TinyLM(seed)
        self.embed_tokens, self.lm_head = self.lm.embed_tokens, self.lm.lm_head

    def embed(self, ids, pixel=None):
        return self.embed_tokens(ids)

    def prompt_inputs(self, ids, pixel=None):
        return self.embed(ids, pixel), {}

    def position_ids(self, ids, attention_mask, pixel):
        return torch.arange(ids.shape[1])[None], None

    def continue_positions(self, start, n, rope_deltas):
        return torch.arange(start, start + n)[None]

    def run_language_model(self, inputs_embeds, position_ids, attention_mask=None, past_key_values=None,
                           use_cache=False, extras=None):
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        return self.lm.layer(inputs_embeds, position_ids, attention_mask, past_key_values), past_key_values


class TinyHead:
    """The part of the MSD head interface the decoder reads, over a TinyLM of its own.

    It ignores the target features and runs its LM over the next-token embeddings (draft
    position t holds e_{t+1}, hence ``shift`` = 1 to give it the target's positions): with
    the target's weights that predicts the target well but not exactly (it never sees the
    first prompt token).
    """

    dtype = torch.float32
    config = SimpleNamespace(draft_positions="mrope", decouple_visual=False, visual_offset="released")

    def __init__(self, lm: TinyLM, shift: int = 1, vocab: torch.Tensor | None = None):
        self.lm, self.shift = lm, shift
        self.vocab = vocab  # bool (V,): a draft vocabulary (as an msd3 head's), -inf logits outside

    feature_layers = None

    def target_inputs(self, features, target=None, position_ids=None):
        e = features.inputs_embeds[:, 1:]
        pos = features.position_ids if position_ids is None else position_ids
        return {"input_embeds": e, "hidden_states": features.hidden_states[:, :-1],
                "replace_mask": torch.zeros(e.shape[:2], dtype=torch.bool), "raw_embeds": e,
                "position_ids": pos[..., :-1]}

    def read_pass(self, features, target=None):
        return self.target_inputs(features, target), None  # no visual compression

    def __call__(self, input_embeds, hidden_states, replace_mask=None, raw_embeds=None, position_ids=None,
                 attention_mask=None, past_key_values=None, use_cache=False):
        h = self.lm.layer(input_embeds, position_ids + self.shift, attention_mask, past_key_values)
        return SimpleNamespace(last_hidden_state=h, past_key_values=past_key_values)

    def project(self, features):
        return features

    def step(self, input_embeds, states, position_ids=None, attention_mask=None, past_key_values=None,
             use_cache=True):
        return self(input_embeds, states, position_ids=position_ids, attention_mask=attention_mask,
                    past_key_values=past_key_values, use_cache=use_cache).last_hidden_state

    def logits(self, states, target):
        logits = target.lm_head(states)
        return logits if self.vocab is None else logits.masked_fill(~self.vocab, float("-inf"))


def bad_head(seed: int) -> TinyHead:
    return TinyHead(TinyLM(seed, scale=6.0), shift=0)


PROMPT = torch.tensor([1, 5, 2, 7, 3])


def exact_continuations(target: TinyTarget, sampling: SamplingParams, n: int = 3) -> dict[tuple, float]:
    """P(first n new tokens) under the warped target, by enumerating every continuation."""
    seqs = torch.tensor(list(itertools.product(range(V), repeat=n)))
    ids = torch.cat([PROMPT.expand(len(seqs), -1), seqs], dim=1)
    with torch.no_grad():
        h = target.lm.layer(target.embed_tokens(ids), torch.arange(ids.shape[1])[None], None, None)
        probs = logits_to_probs(target.lm_head(h), sampling)
    L = len(PROMPT)
    step = probs[:, L - 1 : L - 1 + n].gather(-1, seqs[..., None])[..., 0]  # p(x_i | prefix)
    joint = step.prod(-1)
    return {tuple(s): float(p) for s, p in zip(seqs.tolist(), joint)}


def assert_same_distribution(counts: dict[tuple, int], expected: dict[tuple, float], draws: int):
    """Chi-square goodness of fit; cells expected below 5 draws are pooled into one."""
    big = [c for c, p in expected.items() if p * draws >= 5]
    small = [c for c in expected if c not in big]
    obs = [counts.get(c, 0) for c in big] + [sum(counts.get(c, 0) for c in small)]
    exp = [expected[c] * draws for c in big] + [sum(expected[c] for c in small) * draws]
    assert sum(counts.values()) == draws and set(counts) <= set(expected), "impossible outcome drawn"
    if exp[-1] < 5:  # too little pooled mass for its own cell: fold it into the largest one
        i = max(range(len(big)), key=lambda j: exp[j])
        obs[i] += obs.pop()
        exp[i] += exp.pop()
    total = sum(exp)
    exp = [e * draws / total for e in exp]
    p_value = chisquare(obs, exp).pvalue
    assert p_value > 1e-3, f"chi-square p = {p_value:.2e} over {len(obs)} cells"


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
    ],
    ids=["tree-warped", "tree-raw", "chain", "chain-draft-vocabulary", "tree-draft-vocabulary"],
)
def test_decode_loop_is_lossless(method, head, sampling):
    """Prefill once, then decode 3 tokens from a copy of that state, many times: the
    tree (deterministic top-k proposals, ranked by warped or by raw log-probabilities:
    raw ranking also proposes tokens the warpers removed, which must never be emitted)
    and chain (proposals sampled from the head) paths of the loop, for a head that is
    mostly accepted and one that is mostly not."""
    draws = DRAWS if head != "bad" else DRAWS // 2  # the bad head needs ~3 cycles a draw: keep the file fast
    target = TinyTarget(seed=0)
    # "pruned": the good head drafting from a draft vocabulary without 3 of the 8 ids (never proposed,
    # still emitted by the target at their probability)
    vocab = torch.tensor([True, False, True, True, False, True, True, False])
    draft = {"good": lambda: TinyHead(target.lm), "bad": lambda: bad_head(seed=1),
             "pruned": lambda: TinyHead(target.lm, vocab=vocab)}[head]()
    config = DecodeConfig(method=method, depth=1, top_k=3, total_tokens=6, k=2, max_new_tokens=3,
                          eos_token_ids=(), sampling=sampling)
    state0 = prefill(target, draft, Encoded(PROMPT, torch.zeros_like(PROMPT)))
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
    assert rate > 1.0 if head == "good" else rate < 0.8 if head == "bad" else rate > 0.3, rate


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
