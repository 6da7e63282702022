"""Ensemble drafting over input variants (M, T, P): exactness, losslessness, TABED weights,
and that batching the variants changes nothing per row."""

from __future__ import annotations

import pytest
import torch
from builders import random_image, tiny_llava_target
from test_sampling import TinyHead, TinyTarget, assert_same_distribution, bad_head, exact_continuations

from msd_train.decoding import DecodeConfig, SamplingParams, decode, generate
from msd_train.decoding.ensemble import prefill_ensemble, simplex_grid, tabed_weights, variant_inputs
from msd_train.draft import MSDDraftConfig, MSDDraftModel
from msd_train.targets import Encoded

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llava():
    target = tiny_llava_target()
    torch.manual_seed(0)
    draft = MSDDraftModel(MSDDraftConfig.from_target_config(target.config, "x")).eval()
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    prompts = [
        target.encode_prompt([user("<image>\nwhat colour is the circle?")], [random_image(1)]),
        target.encode_prompt([user("<image>\n<image>\nthere are two red circle")], [random_image(2), random_image(3)]),
        target.encode_prompt([user("python function returns value")], []),
    ]
    return target, draft, prompts


@pytest.mark.parametrize("ensemble", ["ibed", "tabed"])
def test_greedy_ensemble_equals_plain_decoding(llava, ensemble):
    target, draft, prompts = llava
    for prompt in prompts:
        ar = generate(target, None, prompt, DecodeConfig(method="ar", max_new_tokens=24, eos_token_ids=()))
        config = DecodeConfig(method="chain", k=4, max_new_tokens=24, eos_token_ids=(), ensemble=ensemble,
                              variants=("M", "T", "P"), tabed_window=8)
        out = generate(target, draft, prompt, config)
        assert out.tokens == ar.tokens
        assert len(out.cycles) >= 1


def test_single_m_row_is_the_plain_chain(llava):
    """A one-row ensemble of M drafts what the plain chain decoder drafts."""
    target, draft, prompts = llava
    for prompt in prompts:
        plain = generate(target, draft, prompt, DecodeConfig(method="chain", k=4, max_new_tokens=16, eos_token_ids=()))
        one = generate(target, draft, prompt, DecodeConfig(method="chain", k=4, max_new_tokens=16, eos_token_ids=(),
                                                           ensemble="ibed", variants=("M",)))
        assert [c.accepted for c in one.cycles] == [c.accepted for c in plain.cycles]


def test_batched_rows_match_each_variant_alone(llava):
    """Per-row next-token distributions of the left-padded batch equal each variant's own
    (one-row) run, for the prefill and for a draft step after it."""
    target, draft, prompts = llava
    variants = ("M", "T", "P")
    for prompt in prompts[:2]:
        batch = prefill_ensemble(target, draft, prompt, variants, "ibed", 8)
        assert bool((~batch.ensemble.valid).any())  # T and P are shorter: padding is exercised
        singles = [prefill_ensemble(target, draft, prompt, (v,), "ibed", 8) for v in variants]
        x = torch.tensor([[5]])
        pos = target.continue_positions(batch.draft_len, 1, None)
        from msd_train.decoding.ensemble import _rows_forward

        e, h = target.embed_tokens(x), batch.pending_hidden[None]
        got = _rows_forward(draft, batch, e.expand(3, -1, -1), h.expand(3, -1, -1), pos.expand(3, -1))[:, -1]
        for i, s in enumerate(singles):
            want = _rows_forward(draft, s, e, h, target.continue_positions(s.draft_len, 1, None))[0, -1]
            torch.testing.assert_close(target.lm_head(got[i]).softmax(-1), target.lm_head(want).softmax(-1),
                                       atol=1e-5, rtol=1e-4)
        # the variants really differ (T drops 16 image positions, P keeps 4 per image)
        pooled = variant_inputs(target, draft, "P", *_target_pass(target, prompt))
        text = variant_inputs(target, draft, "T", *_target_pass(target, prompt))
        n_img = int((prompt.input_ids == target.image_token_id).sum())
        assert pooled[0].shape[1] == prompt.input_ids.shape[0] - 1 - n_img + n_img // 4
        assert text[0].shape[1] == prompt.input_ids.shape[0] - 1 - n_img


def _target_pass(target, prompt):
    ids = prompt.input_ids[None]
    embeds = target.embed(ids, prompt.pixel)
    pos, _ = target.position_ids(ids, None, prompt.pixel)
    hidden, _ = target.run_language_model(embeds, pos)
    return embeds, hidden, pos, ids == target.image_token_id


# ----- TABED's weight rule ------------------------------------------------------------


def _onehotish(tokens: list[int], v: int = 4, peak: float = 0.7) -> torch.Tensor:
    out = torch.full((len(tokens), v), (1 - peak) / (v - 1))
    out[torch.arange(len(tokens)), torch.tensor(tokens)] = peak
    return out


def test_simplex_grid():
    g = simplex_grid(3)
    assert g.shape == (66, 3) and torch.allclose(g.sum(-1), torch.ones(66))
    assert simplex_grid(2).shape == (11, 2)


def test_tabed_uniform_without_history():
    assert torch.equal(tabed_weights(torch.zeros(0, 3, 4), torch.zeros(0, 4)), torch.full((3,), 1 / 3))


def test_tabed_argmax_matches_decide():
    """Row 0 is right at 3 positions, row 1 at 1: the most matches need w0 high enough
    that row 0's argmax wins at all three, yet row 1 wins the fourth where row 0 is flat."""
    target = _onehotish([0, 1, 2, 3])
    row0 = torch.stack([_onehotish([0])[0], _onehotish([1])[0], _onehotish([2])[0], torch.full((4,), 0.25)])
    row1 = _onehotish([3, 3, 3, 3], peak=0.4)
    w = tabed_weights(torch.stack([row0, row1], 1), target)
    # mixture argmax per position: w0*0.7 + w1*0.2 vs w0*0.1 + w1*0.4 -> row 0 wins iff w0 > 1/3
    # (positions 0-2); position 3: w0*0.25 + w1*0.4 at token 3 always wins unless w1 = 0 (a tie,
    # argmax -> token 0). Four matches need 1/3 < w0 < 1; among those, KL picks one value.
    mixes = simplex_grid(2)
    best = []
    for g in mixes:
        m = g[0] * row0 + g[1] * row1
        best.append(((m.argmax(-1) == target.argmax(-1)).sum().item(),
                     -(target * (target.log() - m.log())).sum().item()))
    expected = mixes[max(range(len(mixes)), key=lambda i: best[i])]
    assert torch.allclose(w, expected)
    assert 1 / 3 < w[0] < 1


def test_tabed_kl_breaks_ties():
    """Both rows put their argmax on the target's token at every position, so every
    weight ties on matches; the target equals row 1 exactly, so KL picks w = (0, 1)."""
    row0 = _onehotish([0, 1, 2], peak=0.9)
    row1 = _onehotish([0, 1, 2], peak=0.6)
    w = tabed_weights(torch.stack([row0, row1], 1), row1.clone())
    assert torch.allclose(w, torch.tensor([0.0, 1.0]))
    # and with the target halfway between, the middle weight wins
    w = tabed_weights(torch.stack([row0, row1], 1), 0.5 * row0 + 0.5 * row1)
    assert torch.allclose(w, torch.tensor([0.5, 0.5]))


def test_tabed_window_bounds_history(llava):
    target, draft, prompts = llava
    config = DecodeConfig(method="chain", k=4, max_new_tokens=40, eos_token_ids=(), ensemble="tabed",
                          variants=("M", "T"), tabed_window=5)
    from msd_train.decoding.ensemble import prefill_ensemble as pe

    state = pe(target, draft, prompts[0], config.variants, "tabed", 5)
    decode(target, draft, state, config)
    assert 0 < len(state.ensemble.history_rows) <= 5
    assert torch.isclose(state.ensemble.weights.sum(), torch.tensor(1.0))


def test_bad_configs():
    with pytest.raises(ValueError, match="ensemble"):
        DecodeConfig(method="chain", ensemble="vote")
    with pytest.raises(ValueError, match="variants"):
        DecodeConfig(method="chain", ensemble="ibed", variants=("M", "C"))
    with pytest.raises(ValueError, match="chain"):
        DecodeConfig(method="tree", ensemble="tabed")


# ----- sampling stays lossless ----------------------------------------------------------


class ImageTokenTarget(TinyTarget):
    """The tiny target of test_sampling, with token 5 treated as an image position, so
    the T row's prefix differs from M's (the target itself reads it as a token)."""

    image_token_id = 5


@pytest.mark.parametrize("ensemble, head, prompt", [
    ("ibed", "bad", [1, 5, 5, 5, 5, 2, 7, 3]),
    ("tabed", "good", [5, 5, 5, 5, 1, 3]),
])
def test_sampling_with_an_ensemble_is_lossless(ensemble, head, prompt, monkeypatch):
    """Prompts chosen so that the M and T rows disagree (L1 distance 0.4-0.8): drafting
    from the mixture but testing against one row would fail here."""
    import test_sampling

    prompt = torch.tensor(prompt)
    monkeypatch.setattr(test_sampling, "PROMPT", prompt)  # exact_continuations reads it
    target = ImageTokenTarget(seed=0)
    draft = bad_head(seed=1) if head == "bad" else TinyHead(target.lm)
    sampling = SamplingParams(temperature=1.0)
    config = DecodeConfig(method="chain", k=2, max_new_tokens=2, eos_token_ids=(), sampling=sampling,
                          ensemble=ensemble, variants=("M", "T"), tabed_window=4)
    state0 = prefill_ensemble(target, draft, Encoded(prompt, torch.zeros_like(prompt)), config.variants, ensemble, 4)
    gen = torch.Generator().manual_seed(0)
    draws = 2500  # two new tokens (64 cells): enough power at a few seconds a test
    counts: dict[tuple, int] = {}
    for _ in range(draws):
        out = decode(target, draft, state0.clone(), config, gen)
        counts[tuple(out.tokens)] = counts.get(tuple(out.tokens), 0) + 1
    assert_same_distribution(counts, exact_continuations(target, sampling, n=2), draws)


# ----- reporting ----------------------------------------------------------------------


def test_ensemble_report_has_every_variant(llava):
    from msd_train.evaluation.bench import BenchItem
    from msd_train.evaluation.ensemble import ensemble_report

    target, draft, _ = llava
    items = [BenchItem("a", "image_question", ["<image>\nwhat colour is the circle?"], [random_image(1)]),
             BenchItem("b", "text", ["python function returns value", "and the value"])]
    config = DecodeConfig(method="chain", k=3, max_new_tokens=8, eos_token_ids=(), ensemble="tabed",
                          variants=("M", "T", "P"))
    rep = ensemble_report(target, draft, items, config, warmup=0)
    assert list(rep["tau"]) == ["M", "T", "P", "tabed-MTP"]
    assert set(rep["tau_per_category"]["T"]) == {"image_question", "text"}
    assert rep["outputs_identical"] is True  # greedy: every drafting gives the target's output
    assert rep["draft_overhead_vs_M"]["M"] == 0
    assert all(t >= 1 for t in rep["tau"].values())
