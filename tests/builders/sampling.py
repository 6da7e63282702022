"""A target and heads small enough to enumerate: the exact distribution of every short
continuation is known, so sampled decoding can be tested for losslessness (``tests/unit/
test_sampling.py``, ``test_ensemble.py``, ``test_compression.py``).

The target is a one-layer causal LM over ``V`` = 8 tokens written out in a few lines, with
the interface of ``msd_train.targets.Target`` that the decoder uses (a transformers
``DynamicCache``, 4-D additive tree masks, explicit positions). The "good" head reads the
same weights as the target; ``bad_head`` is another random model, sharpened so it
disagrees confidently.
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import torch
from scipy.stats import chisquare
from torch import nn
from transformers import DynamicCache

from msd_train.decoding import SamplingParams, logits_to_probs

V, H = 8, 16


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

    def run_for_head(self, inputs_embeds, position_ids, attention_mask=None, past_key_values=None, use_cache=False,
                     layers=None, extras=None):
        """The one layer's output and, for a head reading ``layers`` ([0]), its input (the embeddings)."""
        hidden, cache = self.run_language_model(inputs_embeds, position_ids, attention_mask, past_key_values,
                                                use_cache)
        return hidden, cache, hidden if layers is None else inputs_embeds


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

    def logits_on_ids(self, states, target):
        if self.vocab is None:
            return target.lm_head(states), None
        ids = self.vocab.nonzero().squeeze(-1)
        return target.lm_head(states)[..., ids], ids


def bad_head(seed: int) -> TinyHead:
    return TinyHead(TinyLM(seed, scale=6.0), shift=0)


def block_head(target: TinyTarget, seed: int = 0, block_size: int = 3):
    """A dflash head with random weights over the tiny target (reading its one layer's input):
    its block proposals are drawn from distributions of their own, so sampled decoding
    exercises acceptance and rejection alike."""
    from msd_train.draft import DFlashDraftConfig, DFlashDraftModel

    torch.manual_seed(seed)
    config = DFlashDraftConfig(hidden_size=H, intermediate_size=2 * H, num_attention_heads=2, num_hidden_layers=1,
                               block_size=block_size, feature_layers=[0], target_num_layers=1, target_vocab_size=V,
                               max_position_embeddings=64, draft_positions="1d")
    head = DFlashDraftModel(config)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.5) if p.ndim > 1 else None
    return head.eval()

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
