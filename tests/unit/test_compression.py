"""Draft-side visual compression (``draft.visual_compression``): the head keeps K slots per
image, the target the whole image, so decoding stays exact; K >= N is no compression."""

from __future__ import annotations

import json

import pytest
import torch
from builders.heads import CHAIN, TREE, assert_tree_children_are_the_heads_top_k, run
from builders.runs import recipe
from builders.sampling import assert_same_distribution

from msd_train.decoding import DecodeConfig, HeadDrafter, decode, prefill
from msd_train.decoding.sampling import SamplingParams, logits_to_probs
from msd_train.draft import MSD3DraftConfig, MSD3DraftModel, MSDDraftConfig, MSDDraftModel
from msd_train.draft.compression import SlotMap, kmeans, slot_map
from msd_train.targets import Features
from msd_train.training.objective import objective_for

pytestmark = pytest.mark.usefixtures("one_thread")

N_VISUAL = 16  # visual tokens per image of both tiny random targets (builders.py)


def compressed(target, head, method: str, k: int) -> MSDDraftModel:
    """``head``'s weights under a config that compresses images to ``k`` slots."""
    config = MSDDraftConfig.from_target_config(target.config, target.name, visual_compression=method,
                                               visual_compression_tokens=k)
    out = MSDDraftModel(config).eval().requires_grad_(False)
    out.load_state_dict(head.state_dict())
    return out


def prompt_features(target, prompt) -> Features:
    ids = prompt.input_ids[None]
    embeds = target.embed(ids, prompt.pixel)
    pos, _ = target.position_ids(ids, None, prompt.pixel)
    hidden, _ = target.run_language_model(embeds, pos)
    return Features(embeds, hidden, ids == target.image_token_id, pos)


# ----- the slot map -------------------------------------------------------------------


def test_pool_groups_merge_in_order_and_positions_are_member_means():
    slots = torch.tensor([[False, True, True, True, True, True, False, False]])
    plan = slot_map("pool", 2, slots, torch.zeros(1, 8, 4))
    assert plan.length == 5 and plan.dest.tolist() == [[0, 1, 1, 1, 2, 2, 3, 4]]
    x = torch.arange(8.0).view(1, 8, 1)
    assert plan.compress(x).flatten().tolist() == [0.0, 2.0, 4.5, 6.0, 7.0]
    pos = torch.stack([torch.arange(8), torch.arange(8) * 2, torch.tensor([0, 9, 8, 7, 6, 5, 20, 21])])[:, None]
    got = plan.compress_positions(pos)  # M-RoPE: each row's floor of the members' mean; later ids kept
    assert got.shape == (3, 1, 5)
    assert got[:, 0].tolist() == [[0, 2, 4, 6, 7], [0, 4, 9, 12, 14], [0, 8, 5, 20, 21]]
    assert plan.expand(plan.compress(x)).flatten().tolist() == [0.0, 2.0, 2.0, 2.0, 4.5, 4.5, 6.0, 7.0]
    # rows of a batch compress to different lengths: the shorter is right-padded
    two = slot_map("pool", 2, torch.stack([slots[0], torch.zeros(8, dtype=torch.bool)]), torch.zeros(2, 8, 4))
    assert two.length == 8 and two.dest[0].tolist() == plan.dest[0].tolist() and two.dest[1].tolist() == list(range(8))


def test_kmeans_finds_separated_clusters_deterministically():
    g = torch.Generator().manual_seed(0)
    centres = torch.tensor([[5.0, 0.0], [-5.0, 0.0], [0.0, 5.0]])
    which = torch.tensor([2, 2, 0, 1, 2, 0, 1, 0, 1, 0, 1, 2])
    x = centres[which] + 0.1 * torch.randn(12, 2, generator=g)
    labels = kmeans(x, 3)
    assert torch.equal(labels, kmeans(x, 3))
    # each true cluster is one k-means cluster (labels are a permutation of the truth)
    assert len({(int(a), int(b)) for a, b in zip(which, labels)}) == 3
    plan = slot_map("kmeans", 3, torch.ones(1, 12, dtype=torch.bool), x[None])
    # slots ordered by their members' mean index: cluster 2 (4.0), cluster 0 (5.75), cluster 1 (6.75)
    first = {int(which[t]): int(plan.dest[0, t]) for t in range(12)}
    assert plan.length == 3 and first == {2: 0, 0: 1, 1: 2}


# ----- decoding -----------------------------------------------------------------------


@pytest.mark.parametrize("method", ["kmeans", "pool"])
def test_a_compressed_head_decodes_exactly(setup, method):
    """Tree and chain decoding with a head that keeps 4 of each image's 16 visual tokens
    give plain greedy decoding's tokens, with one and two images; the head's cache holds
    the compressed prompt and its drafts are still accepted."""
    target, head, prompts = setup
    head = compressed(target, head, method, 4)
    accepted = []
    for name, images in (("image", 1), ("two_images", 2)):
        prompt = prompts[name]
        state = prefill(target, HeadDrafter(head), prompt)
        assert state.drafter.cache.length == len(prompt.input_ids) - 1 - images * (N_VISUAL - 4)
        plain = run(target, None, prompt, method="ar", eos_token_ids=())
        for config in (TREE, CHAIN):
            out = run(target, head, prompt, eos_token_ids=(), **config)
            assert out.tokens == plain.tokens, f"{target.family} {name} {config['method']}"
            accepted += [c.accepted for c in out.cycles]
    assert max(accepted) >= 2 and sum(accepted) / len(accepted) > 0.5, "the head is hardly ever accepted"


@pytest.mark.parametrize("decouple", [True, False])
def test_a_compressed_msd3_head_decodes_exactly(qwen_setup, decouple):
    """The msd3 head reads its images through the same SlotMap (a random head: exactness only)."""
    target, _, prompts = qwen_setup
    torch.manual_seed(0)
    head = MSD3DraftModel(MSD3DraftConfig.from_target_config(
        target.config, target.name, visual_compression="kmeans", visual_compression_tokens=4,
        decouple_visual=decouple)).eval()
    prompt = prompts["two_images"]
    assert prefill(target, HeadDrafter(head), prompt).drafter.cache.length == len(prompt.input_ids) - 1 - 2 * (N_VISUAL - 4)
    plain = run(target, None, prompt, method="ar", eos_token_ids=())
    for config in (TREE, CHAIN):
        assert run(target, head, prompt, eos_token_ids=(), **config).tokens == plain.tokens


@pytest.mark.parametrize("method", ["kmeans", "pool"])
def test_a_compressed_head_drafts_what_it_reads_over_the_whole_sequence(setup, method):
    """Tree drafting from the compressed cache gives the children and scores of the head
    run from scratch over the compressed prompt and the path: after the image, the draft
    positions are the target's, although the head's cache is shorter than the target's."""
    target, head, prompts = setup
    assert_tree_children_are_the_heads_top_k(target, compressed(target, head, method, 4), prompts)


@pytest.mark.parametrize("method", ["kmeans", "pool"])
def test_k_at_least_the_visual_tokens_is_no_compression(llava_setup, method):
    """K >= N leaves every image whole: the same inputs, loss and decoding, bit for bit."""
    target, head, prompts = llava_setup
    feats = prompt_features(target, prompts["two_images"])
    mask = torch.ones(1, feats.hidden_states.shape[1] - 1)
    for k in (N_VISUAL, 1000):
        same = compressed(target, head, method, k)
        inputs, plan = same.read_pass(feats)
        assert plan is None
        for key, value in head.target_inputs(feats).items():
            assert torch.equal(inputs[key], value), key
        assert torch.equal(objective_for(same).eval_loss(target, feats, mask), objective_for(head).eval_loss(target, feats, mask))
        for config in (TREE, CHAIN):
            a = run(target, head, prompts["two_images"], eos_token_ids=(), **config)
            b = run(target, same, prompts["two_images"], eos_token_ids=(), **config)
            assert a.tokens == b.tokens and [c.accepted for c in a.cycles] == [c.accepted for c in b.cycles]
    fewer = compressed(target, head, method, N_VISUAL - 1)
    assert fewer.read_pass(feats)[1].length == feats.hidden_states.shape[1] - 1 - 2  # one slot fewer per image


def test_ensemble_drafting_refuses_a_compressed_head(llava_target):
    from msd_train.decoding.ensemble import EnsembleDrafter

    head = MSDDraftModel(MSDDraftConfig.from_target_config(llava_target.config, "x", visual_compression="pool"))
    with pytest.raises(ValueError, match="compresses images"):
        EnsembleDrafter(head, ("M", "P"), "ibed", 32)


def _exact_pairs(target, prompt, sampling) -> dict[tuple, float]:
    """P(first two new tokens) under the warped target, over every pair it can emit."""
    ids = prompt.input_ids[None]
    embeds = target.embed(ids, prompt.pixel)
    pos, deltas = target.position_ids(ids, None, prompt.pixel)
    with torch.no_grad():
        p1 = logits_to_probs(target.lm_head(target.run_language_model(embeds, pos)[0][0, -1]), sampling)
        out = {}
        for a in p1.nonzero().flatten().tolist():
            e = torch.cat([embeds, target.embed_tokens(torch.tensor([[a]]))], 1)
            p = torch.cat([pos, target.continue_positions(ids.shape[1], 1, deltas)], -1)
            p2 = logits_to_probs(target.lm_head(target.run_language_model(e, p)[0][0, -1]), sampling)
            out.update({(a, b): float(p1[a] * p2[b]) for b in p2.nonzero().flatten().tolist()})
    return out


@pytest.mark.parametrize("config", [TREE, CHAIN], ids=["tree", "chain"])
def test_sampling_with_a_compressed_head_is_lossless(llava_setup, config):
    """The first two sampled tokens (the second from a drafted, verified cycle) are drawn
    from the warped target's distribution."""
    target, head, prompts = llava_setup
    head = compressed(target, head, "kmeans", 4)
    sampling = SamplingParams(temperature=1.0, top_k=3)
    state0 = prefill(target, HeadDrafter(head), prompts["image"])
    settings = DecodeConfig(max_new_tokens=2, eos_token_ids=(), sampling=sampling, **config)
    gen = torch.Generator().manual_seed(0)
    counts: dict[tuple, int] = {}
    draws = 300
    for _ in range(draws):
        key = tuple(decode(target, state0.clone(), settings, gen).tokens)
        counts[key] = counts.get(key, 0) + 1
    assert_same_distribution(counts, _exact_pairs(target, prompts["image"], sampling), draws)


# ----- saving and training ------------------------------------------------------------


def test_the_setting_is_saved_with_the_head(llava_target, tmp_path):
    head = compressed(llava_target, MSDDraftModel(MSDDraftConfig.from_target_config(llava_target.config, "x")),
                      "pool", 8)
    head.save_pretrained(tmp_path / "c")
    back = MSDDraftModel.from_pretrained(tmp_path / "c")
    assert (back.config.visual_compression, back.config.visual_compression_tokens) == ("pool", 8)
    # a head exported before the setting existed has no such keys: it reads every visual token
    saved = json.loads((tmp_path / "c" / "config.json").read_text())
    del saved["visual_compression"], saved["visual_compression_tokens"]
    (tmp_path / "c" / "config.json").write_text(json.dumps(saved))
    assert MSDDraftModel.from_pretrained(tmp_path / "c").config.visual_compression == "none"
    with pytest.raises(Exception, match="visual_compression_tokens must be at least 1"):
        MSDDraftConfig.from_target_config(llava_target.config, "x", visual_compression="pool",
                                          visual_compression_tokens=0)


def test_a_wrong_setting_is_named_before_anything_loads():
    from msd_train.validate import ConfigError, check_train

    with pytest.raises(ConfigError, match="draft.visual_compression='median' is not one of none, kmeans, pool"):
        check_train({"draft": {"visual_compression": "median"}})
    with pytest.raises(ConfigError, match="draft.visual_compression_tokens=0 must be at least 1"):
        check_train({"draft": {"visual_compression": "pool", "visual_compression_tokens": 0}})


def test_the_released_layout_export_refuses_a_compressing_head(llava_target, tmp_path):
    """The released code drafts over every visual token and its layout has no field for
    compression: the export refuses, naming the setting and the format that keeps it
    (a warning would not do: the folder would import back as an uncompressed head)."""
    from msd_train.hub import TargetInfo, export_reference

    head = MSDDraftModel(MSDDraftConfig.from_target_config(llava_target.config, "x", visual_compression="kmeans"))
    head.save_pretrained(tmp_path / "ours")
    with pytest.raises(ValueError, match=r"visual_compression=kmeans \(visual_compression_tokens=32\).*format=msd "
                                         r"keeps it"):
        export_reference(tmp_path / "ours", tmp_path / "released", target=TargetInfo.of(llava_target))
    assert not (tmp_path / "released").exists()


@pytest.mark.usefixtures("in_process")
@pytest.mark.parametrize("head", ["msd", "msd3"])
def test_training_with_compression_runs_a_step(mini_run, tmp_path, monkeypatch, head):
    """A stage-2 step over image conversations and validation read the compressed images;
    the export keeps the setting."""
    import msd_train.draft.head as head_module

    plans = []

    def spy(*args):
        plans.append(slot_map(*args))
        return plans[-1]

    monkeypatch.setattr(head_module, "slot_map", spy)
    r = recipe(["stage='2'", *mini_run, f"head={head}", "stage.init_from=null", "draft.visual_compression=kmeans",
                "draft.visual_compression_tokens=4", "train.max_steps=1", "stage.curriculum.start=1.0",
                "stage.curriculum.end=1.0", "train.micro_batch_size=2", "eval.rollout=2", "eval.batch_size=4",
                "draft.ttt_steps=2" if head == "msd3" else "draft.num_hidden_layers=1", f"run_dir={tmp_path}"])
    m = r.train_step()
    assert m["loss"] > 0 and m["mm_share"] > 0
    assert any(isinstance(p, SlotMap) for p in plans), "no image was compressed in training"
    res = r.validate()
    assert res["mm"]["loss"] > 0 and 1.0 <= res["mm"]["sim_tau"]
    r.step = 1
    r.export("final")
    saved = json.loads((tmp_path / "stage2" / "final" / "config.json").read_text())
    assert (saved["visual_compression"], saved["visual_compression_tokens"]) == ("kmeans", 4)
