"""Ensemble drafting over input variants (M, T, P, C): exactness (chain and tree),
losslessness, TABED weights, and that batching the variants changes nothing per row."""

from __future__ import annotations

import pytest
import torch
from builders import random_image, tiny_llava_target
from builders.sampling import TinyHead, TinyTarget, assert_same_distribution, bad_head, exact_continuations

from msd_train.decoding import DecodeConfig, PromptPass, SamplingParams, decode, generate, prefill
from msd_train.decoding.ensemble import EnsembleDrafter, simplex_grid, tabed_weights, variant_inputs
from msd_train.draft import MSDDraftConfig, MSDDraftModel, align_inputs
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


CAPTIONS = [["a red circle on white"], ["a red circle", "two blue squares"], []]
METHODS = {"chain": dict(method="chain", k=4), "tree": dict(method="tree", depth=3, top_k=3, total_tokens=10)}


@pytest.mark.parametrize("method", ["chain", "tree"])
@pytest.mark.parametrize("ensemble", ["ibed", "tabed"])
def test_greedy_ensemble_equals_plain_decoding(llava, ensemble, method):
    target, draft, prompts = llava
    for prompt, captions in zip(prompts, CAPTIONS):
        ar = generate(target, None, prompt, DecodeConfig(method="ar", max_new_tokens=24, eos_token_ids=()))
        config = DecodeConfig(max_new_tokens=24, eos_token_ids=(), ensemble=ensemble,
                              variants=("M", "T", "P", "C"), tabed_window=8, **METHODS[method])
        out = generate(target, draft, prompt, config, captions=captions)
        assert out.tokens == ar.tokens
        assert len(out.cycles) >= 1


@pytest.mark.parametrize("method", ["chain", "tree"])
def test_single_m_row_is_the_plain_decoder(llava, method):
    """A one-row ensemble of M drafts what the plain decoder drafts."""
    target, draft, prompts = llava
    for prompt in prompts:
        config = DecodeConfig(max_new_tokens=16, eos_token_ids=(), **METHODS[method])
        plain = generate(target, draft, prompt, config)
        one = generate(target, draft, prompt, DecodeConfig(max_new_tokens=16, eos_token_ids=(), ensemble="ibed",
                                                           variants=("M",), **METHODS[method]))
        assert [c.accepted for c in one.cycles] == [c.accepted for c in plain.cycles]
        assert [c.tree_size for c in one.cycles] == [c.tree_size for c in plain.cycles]


def prefill_ensemble(target, draft, prompt, variants, mode, window, captions=None):
    """A prefilled state whose drafter is the head over ``variants``."""
    return prefill(target, EnsembleDrafter(draft, variants, mode, window, captions), prompt, capacity=256)


def _head(state, embeds, hidden, pos, seen=None):
    """The drafter's rows over T new positions; ``seen`` (T, A) which of the A newest
    slots each query sees (default: causal over the T)."""
    t = embeds.shape[1]
    seen = torch.ones(t, t, dtype=torch.bool).tril() if seen is None else seen
    return state.drafter.head(embeds, hidden, pos, seen)


def _target_pass(target, prompt) -> PromptPass:
    ids = prompt.input_ids[None]
    embeds = target.embed(ids, prompt.pixel)
    pos, deltas = target.position_ids(ids, None, prompt.pixel)
    hidden, _ = target.run_language_model(embeds, pos)
    return PromptPass(ids, embeds, hidden, pos, ids == target.image_token_id, prompt.pixel, deltas)


@torch.inference_mode()
def test_batched_rows_match_each_variant_alone(llava):
    """Per-row next-token distributions of the left-padded batch equal each variant's own
    (one-row) run: one draft step after the prefill, and a tree step over 3 frontier nodes."""
    target, draft, prompts = llava
    variants = ("M", "T", "P", "C")
    for prompt, captions in zip(prompts[:2], CAPTIONS):
        batch = prefill_ensemble(target, draft, prompt, variants, "ibed", 8, captions)
        assert batch.drafter.pad_bias is not None  # the rows differ in length: padding is exercised
        singles = [prefill_ensemble(target, draft, prompt, (v,), "ibed", 8, captions) for v in variants]
        x = torch.tensor([[5]])
        e, h = target.embed_tokens(x), batch.pending_hidden[None]
        pos = target.continue_positions(batch.drafter.cache.length, 1, None)
        got = _head(batch, e, h.expand(4, -1, -1), pos)[:, -1]
        # a tree step: 3 nodes that see the step above and themselves
        nodes = torch.tensor([[7, 8, 9]])
        anc = torch.cat([torch.ones(3, 1, dtype=torch.bool), torch.eye(3, dtype=torch.bool)], 1)
        tree_pos = target.continue_positions(batch.drafter.cache.length + 1, 1, None).expand(1, 3)
        got_tree = _head(batch, target.embed_tokens(nodes), got[:, None].expand(-1, 3, -1), tree_pos, anc)
        for i, s in enumerate(singles):
            want = _head(s, e, h, target.continue_positions(s.drafter.cache.length, 1, None))[:, -1]
            torch.testing.assert_close(target.lm_head(got[i]).softmax(-1), target.lm_head(want[0]).softmax(-1),
                                       atol=1e-5, rtol=1e-4)
            want_tree = _head(s, target.embed_tokens(nodes), want[:, None].expand(-1, 3, -1),
                              target.continue_positions(s.drafter.cache.length, 1, None).expand(1, 3), anc)
            torch.testing.assert_close(target.lm_head(got_tree[i]).softmax(-1),
                                       target.lm_head(want_tree[0]).softmax(-1), atol=1e-5, rtol=1e-4)
        # the variants really differ: T drops the image positions, P keeps a quarter, C the caption's tokens
        p = _target_pass(target, prompt)
        n_img = int(p.visual.sum())
        n_cap = sum(len(target.tokenizer(c, add_special_tokens=False)["input_ids"]) for c in captions)
        length = prompt.input_ids.shape[0] - 1
        assert variant_inputs(target, draft, "P", p)["input_embeds"].shape[1] == length - n_img + n_img // 4
        assert variant_inputs(target, draft, "T", p)["input_embeds"].shape[1] == length - n_img
        assert variant_inputs(target, draft, "C", p, captions)["input_embeds"].shape[1] == length - n_img + n_cap


@torch.inference_mode()
def test_caption_row_reads_the_captioned_prompt(llava):
    """The C row's prefill equals a plain head prefill over the prompt with the caption
    written in place of the image (same features, positions shifted to end together)."""
    target, draft, _ = llava
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    captioned = target.encode_prompt([user("a red circle on white\nwhat colour is the circle?")], [])
    with_image = target.encode_prompt([user("<image>\nwhat colour is the circle?")], [random_image(1)])
    c = variant_inputs(target, draft, "C", _target_pass(target, with_image), ["a red circle on white"])
    plain = _target_pass(target, captioned)
    e, h, _, _ = align_inputs(draft.config, plain.embeds, plain.hidden, plain.visual)
    torch.testing.assert_close(c["input_embeds"], e)
    torch.testing.assert_close(c["hidden_states"], h)
    shift = with_image.input_ids.shape[0] - captioned.input_ids.shape[0]
    assert torch.equal(c["position_ids"], plain.pos[..., :-1] + shift)


def test_caption_variant_needs_captions(llava):
    target, draft, prompts = llava
    config = DecodeConfig(method="chain", k=2, max_new_tokens=4, ensemble="ibed", variants=("M", "C"))
    with pytest.raises(ValueError, match="caption"):
        generate(target, draft, prompts[0], config)
    # a text-only prompt needs none: its C row is its M row
    out = generate(target, draft, prompts[2], config)
    assert len(out.tokens) == 4


@torch.inference_mode()
def test_pooled_variant_on_qwen2vl(qwen_target):
    """P derives each image's grid from Qwen2-VL's image_grid_thw (merged patches) and
    keeps M-RoPE positions; greedy decoding with the ensemble (C included) stays exact."""
    target = qwen_target
    torch.manual_seed(0)
    draft = MSDDraftModel(MSDDraftConfig.from_target_config(target.config, "x")).eval()
    prompt = target.encode_prompt([{"role": "user", "content": "<image>\nwhat is it?"}], [random_image(4)])
    grids = target.image_grids(prompt.pixel)
    p = _target_pass(target, prompt)
    assert sum(h * w for h, w in grids) == int(p.visual.sum())
    pooled = variant_inputs(target, draft, "P", p)
    kept = sum(-(-h // 2) * -(-w // 2) for h, w in grids)
    assert pooled["input_embeds"].shape[1] == prompt.input_ids.shape[0] - 1 - int(p.visual.sum()) + kept
    assert pooled["position_ids"].shape[0] == 3  # M-RoPE ids
    ar = generate(target, None, prompt, DecodeConfig(method="ar", max_new_tokens=12, eos_token_ids=()))
    for method in ("chain", "tree"):
        config = DecodeConfig(max_new_tokens=12, eos_token_ids=(), ensemble="tabed", variants=("M", "T", "P", "C"),
                              **METHODS[method])
        assert generate(target, draft, prompt, config, captions=["a red circle"]).tokens == ar.tokens


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


@pytest.mark.parametrize("method", ["chain", "tree"])
def test_tabed_history_follows_the_rule(llava, method):
    """The history is bounded by the window, and the weights drafted with are the rule's
    choice over the rows' and target's distributions at the verified positions."""
    target, draft, prompts = llava
    config = DecodeConfig(max_new_tokens=40, eos_token_ids=(), ensemble="tabed", variants=("M", "T"),
                          tabed_window=5, **METHODS[method])
    state = prefill_ensemble(target, draft, prompts[0], config.variants, "tabed", 5)
    decode(target, state, config)
    ens = state.drafter
    assert 0 < ens.history_match.shape[0] <= 5
    assert torch.isclose(ens.weights.sum(), torch.tensor(1.0))
    # recompute one block's scores from scratch through tabed_weights
    lm_head = torch.nn.Linear(6, 11)
    out = torch.randn(2, 3, 6)  # (rows, mixing positions, H)
    logits = torch.randn(4, 11)
    ens.history_match = ens.history_kl = None
    ens.block_out, ens.block_index = [out], torch.tensor([0, 1, 2, -1])
    with torch.inference_mode():
        ens.record_verified([0, 1, 3], logits, lm_head)  # nodes 0 and 1 were expanded, 3 was not
        ens.begin_block()
        want = tabed_weights(lm_head(out[:, :2]).softmax(-1).transpose(0, 1), logits[[0, 1]].softmax(-1))
    assert torch.equal(ens.weights, want)


def test_bad_configs():
    with pytest.raises(ValueError, match="ensemble"):
        DecodeConfig(method="chain", ensemble="vote")
    with pytest.raises(ValueError, match="variants"):
        DecodeConfig(method="chain", ensemble="ibed", variants=("M", "X"))
    with pytest.raises(ValueError, match="variants"):
        DecodeConfig(method="tree", ensemble="ibed", variants=("M", "M"))
    for window in (0, "last", 2.5):
        with pytest.raises(ValueError, match="tabed_window"):
            DecodeConfig(method="tree", ensemble="tabed", tabed_window=window)


def test_tabed_window_all_searches_the_whole_history():
    """40 verified positions: in the first 8 only weight (1, 0) matches the target's
    argmax; in the last 32 every weight matches and (0, 1) has the smallest KL. A
    window of 32 sees only the ties and picks (0, 1); ``all`` counts the 8 early matches
    and picks (1, 0)."""
    grid = simplex_grid(2)
    first = (grid[:, 0] == 1).expand(8, -1)  # (8, G): only w = (1, 0) matched
    late_kl = grid[:, 0].double().expand(32, -1)  # KL grows with w0: (0, 1) is smallest
    history = [(first, torch.zeros(8, len(grid), dtype=torch.float64)),
               (torch.ones(32, len(grid), dtype=torch.bool), late_kl)]
    chosen = {}
    for window in (32, "all"):
        ens = EnsembleDrafter(None, ("M", "T"), "tabed", window)
        ens.grid = grid
        for match, kl in history:  # verified in two blocks, oldest first
            ens.remember(match, kl)
        ens.begin_block()
        chosen[window] = ens.weights.tolist()
        assert ens.history_match.shape[0] == (32 if window == 32 else 40)
    assert chosen == {32: [0.0, 1.0], "all": [1.0, 0.0]}


# ----- sampling stays lossless ----------------------------------------------------------


class ImageTokenTarget(TinyTarget):
    """The tiny target of test_sampling, with token 5 treated as an image position, so
    the T row's prefix differs from M's (the target itself reads it as a token)."""

    image_token_id = 5


@pytest.mark.slow
@pytest.mark.parametrize("ensemble, head, prompt, method", [
    ("ibed", "bad", [1, 5, 5, 5, 5, 2, 7, 3], "chain"),
    ("tabed", "good", [5, 5, 5, 5, 1, 3], "chain"),
    ("tabed", "good", [5, 5, 5, 5, 1, 3], "tree"),
])
def test_sampling_with_an_ensemble_is_lossless(ensemble, head, prompt, method, monkeypatch):
    """Prompts chosen so that the M and T rows disagree (L1 distance 0.4-0.8): drafting
    from the mixture but testing against one row would fail here (chain). The tree's
    proposals are the mixture's top-k, tested as point masses."""
    import builders.sampling

    prompt = torch.tensor(prompt)
    monkeypatch.setattr(builders.sampling, "PROMPT", prompt)  # exact_continuations reads it
    target = ImageTokenTarget(seed=0)
    draft = bad_head(seed=1) if head == "bad" else TinyHead(target.lm)
    sampling = SamplingParams(temperature=1.0)
    shape = dict(k=2) if method == "chain" else dict(depth=1, top_k=2, total_tokens=5)
    config = DecodeConfig(method=method, max_new_tokens=2, eos_token_ids=(), sampling=sampling,
                          ensemble=ensemble, variants=("M", "T"), tabed_window=4, **shape)
    state0 = prefill_ensemble(target, draft, Encoded(prompt, torch.zeros_like(prompt)), config.variants, ensemble, 4)
    gen = torch.Generator().manual_seed(0)
    draws = 2500  # two new tokens (64 cells): enough power at a few seconds a test
    counts: dict[tuple, int] = {}
    for _ in range(draws):
        out = decode(target, state0.clone(), config, gen)
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
    # the overhead a user reads is the ensemble's drafting time per cycle over M's
    ms = rep["draft_ms_per_cycle"]
    assert all(v > 0 for v in ms.values()) and all(t >= 1 for t in rep["tau"].values())
    assert rep["draft_overhead_vs_M"]["tabed-MTP"] == pytest.approx(ms["tabed-MTP"] / ms["M"] - 1)
    assert all(t >= 1 for t in rep["tau"].values())


def test_ensemble_tree_ranks_by_the_raw_mixture_when_asked():
    """Sampling with rank_by=raw: the tree ranks by the log of the rows' raw softmaxes
    mixed (EAGLE-2's scores, per row), while the chain still samples from the warped mixture."""
    from types import SimpleNamespace

    lm_head = torch.nn.Linear(6, 11)
    out = torch.randn(2, 3, 6)
    head = SimpleNamespace(logits=lambda states, target: target.lm_head(states))  # an msd head's logits
    ens = EnsembleDrafter(head, ("M", "T"), "ibed", 32)
    ens.weights = torch.tensor([0.5, 0.5])
    target = SimpleNamespace(dtype=torch.float32, lm_head=lm_head)
    params = SamplingParams(temperature=0.3, top_k=3, rank_by="warped")
    with torch.inference_mode():
        raw = ens.distribution(target, out, SamplingParams(temperature=0.3, top_k=3, rank_by="raw"), log=True)
        warped = ens.distribution(target, out, params, log=True)
        drawn = ens.distribution(target, out, SamplingParams(temperature=0.3, top_k=3, rank_by="raw"))
        assert torch.allclose(raw, lm_head(out).softmax(-1).mean(0).log())
        assert warped.isinf().any() and not raw.isinf().any()  # top-k=3 removed tokens only in the warped one
        assert torch.equal(drawn, ens.distribution(target, out, params))  # what is sampled does not change
