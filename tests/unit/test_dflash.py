"""The dflash head (``draft/dflash.py``) and its block decoding (``decoding/block.py``): the
block seen from every anchor in training is the block decoding drafts, decoding is greedy
exact, bad settings are refused naming the fix, and the head exports and loads back."""

from __future__ import annotations

import pytest
import torch
from builders import ROOT
from builders.heads import conversations, train_dflash_head
from transformers import DynamicCache

from msd_train.decoding import BlockDrafter, DecodeConfig, generate, prefill
from msd_train.draft import HEADS, DFlashDraftConfig, DFlashDraftModel, MSDDraftModel
from msd_train.draft.dflash import dflash_layers
from msd_train.draft.loss import draft_loss_mask
from msd_train.errors import ConfigError
from msd_train.training.objective import OBJECTIVES, objective_for

pytestmark = pytest.mark.usefixtures("one_thread")


def small_head(**kw) -> DFlashDraftModel:
    torch.manual_seed(0)
    fields = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                  target_vocab_size=40, target_num_layers=8, block_size=4, num_hidden_layers=2)
    return DFlashDraftModel(DFlashDraftConfig(**{**fields, **kw})).eval()


def test_default_layers_are_dflashs_named_by_their_inputs():
    # DFlash: outputs of layers evenly spaced over 1 .. N-3 (Qwen3-8B, 36 layers, 5 draft layers:
    # 1, 9, 17, 25, 33); here the input of the next layer
    assert dflash_layers(36, 5) == [2, 10, 18, 26, 34]
    assert dflash_layers(36, 1) == [19]  # one draft layer: the middle layer's output
    assert dflash_layers(4, 1) == [3] and dflash_layers(4, 2) == [2]  # a shallow target: no repeats
    assert small_head().feature_layers == dflash_layers(8, 2) == [2, 6]
    assert HEADS["dflash"] is DFlashDraftModel and ("dflash", "supervised") in OBJECTIVES


def test_one_block_among_all_anchors_is_the_block_decoding_drafts():
    """Training runs every anchor's block at once (each seeing the context up to its anchor);
    decoding writes the context to a cache and runs one block: the same states."""
    head = small_head()
    B, L = 2, 10
    ctx = head.context(torch.randn(B, L, 2 * 32))
    roots, pos = torch.randn(B, L, 32), torch.arange(L)[None].expand(B, L)
    seen = torch.arange(L)[None, None, :] <= torch.arange(L)[None, :, None]
    every = head(roots, ctx, pos, pos, seen.expand(B, L, L)).last_hidden_state  # (B, L, S, H)
    cache = DynamicCache()
    head(roots[:, :0], ctx[:, :3], pos[:, :0], pos[:, :3], past_key_values=cache, use_cache=True)  # a prefill
    one = head(roots[:, 5:6], ctx[:, 3:6], pos[:, 5:6], pos[:, 3:6], past_key_values=cache, use_cache=True)
    torch.testing.assert_close(one.last_hidden_state[:, 0], every[:, 5], rtol=0, atol=1e-5)
    assert cache.get_seq_length() == 6  # the context only: no block entry is kept


def test_decoupling_changes_the_context_at_image_positions_only():
    on, off = small_head(decouple_visual=True), small_head(decouple_visual=False)
    off.load_state_dict(on.state_dict())
    feats, embeds = torch.randn(1, 6, 64), torch.randn(1, 6, 32)
    visual = torch.tensor([[False, True, True, False, False, False]])
    a, b = on.context(feats, embeds, visual), off.context(feats, embeds, visual)
    assert torch.equal(a[:, ~visual[0]], b[:, ~visual[0]]) and not torch.allclose(a[:, visual[0]], b[:, visual[0]])
    torch.testing.assert_close(a[:, visual[0]], on.visual_norm(embeds[:, visual[0]]))


@pytest.mark.parametrize("overrides, match", [
    ({"block_size": 2048}, r"draft.block_size=2048: the target's context holds 2048 positions"),
    ({"feature_layers": [1, 9]}, r"draft.feature_layers=\[1, 9\]: the target has 4 layers"),
    ({"feature_layers": [1, 4]}, r"or \[4\] alone for its last output"),  # the last output is read alone
    ({"block_size": 1}, r"draft.block_size=1: a block is the root plus at least one proposal"),
])
def test_settings_the_target_cannot_hold_are_refused(overrides, match):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(ROOT / "data" / "tiny-llava")  # 4 layers, 2048 positions
    with pytest.raises(ConfigError, match=match):
        DFlashDraftConfig.from_target_config(config, "tiny", **overrides)
    with pytest.raises(Exception, match="visual_compression=none"):
        small_head(visual_compression="kmeans")


@pytest.fixture(scope="module")
def fitted(llava_target):
    """A dflash head (block 4, one layer) fitted for 60 steps by its own objective to the
    random target's greedy continuations of the test prompts."""
    target = llava_target
    prompts = conversations(target)
    head = train_dflash_head(target, list(prompts.values()), steps=60, new_tokens=40, block_size=4,
                             num_hidden_layers=1, num_anchors=DFlashDraftConfig.num_anchors)  # every answer position
    return target, head, prompts


def test_a_head_reading_the_last_output_decodes_exactly(llava_target):
    """``feature_layers=[N]``: the context is the target's last output (msd's feature), in
    training's features and in the decoder's alike."""
    target = llava_target
    n = target.config.get_text_config(decoder=True).num_hidden_layers
    torch.manual_seed(0)
    head = DFlashDraftModel(DFlashDraftConfig.from_target_config(target.config, target.name, block_size=4,
                                                                 num_hidden_layers=1, feature_layers=[n])).eval()
    assert head.feature_layers is None and head.fc.in_features == head.config.hidden_size
    enc = conversations(target)["image"]
    plain = generate(target, None, enc, DecodeConfig(method="ar", max_new_tokens=24, eos_token_ids=()))
    out = generate(target, head, enc, DecodeConfig(method="block", k=3, max_new_tokens=24, eos_token_ids=()))
    assert out.tokens == plain.tokens
    feats = target.features(enc.input_ids[None], None, enc.pixel, layers=None)
    assert feats.layer_states is None  # what the head reads is the last output alone
    text = ~feats.visual_mask[0, :-1]  # image positions take the decoupled path
    torch.testing.assert_close(head.target_inputs(feats)["hidden_states"][:, text],
                               head.project(feats.hidden_states[:, :-1][:, text]))


def test_anchors_run_only_as_many_blocks_as_a_row_has_loss_positions():
    """Every loss position is an anchor when there are fewer than ``num_anchors``, and no block
    runs for slots that every row would mask out (a padded batch of 12 holding 5 and 3)."""
    objective = objective_for(small_head(num_anchors=8))
    mask = torch.zeros(2, 12, dtype=torch.bool)
    mask[0, 2:7], mask[1, 4:7] = True, True
    anchors, ok = objective._anchors(mask, seed=0)
    assert anchors.shape == (2, 5) and ok.sum() == 8
    assert anchors[0].tolist() == [2, 3, 4, 5, 6] and anchors[1][ok[1]].tolist() == [4, 5, 6]
    few = objective_for(small_head(num_anchors=2))._anchors(mask, seed=0)[0]
    assert few.shape == (2, 2) and all(mask[r, few[r]].all() for r in range(2))


def test_held_out_loss_runs_blocks_at_loss_positions_only_and_sums_the_same(fitted):
    target, head, prompts = fitted
    objective = objective_for(head)
    enc = prompts["image"]
    feats = target.features(enc.input_ids[None], None, enc.pixel, layers=head.feature_layers)
    T = enc.input_ids.shape[0] - 1
    mask = torch.zeros(1, T, dtype=torch.bool)
    mask[:, T // 2:] = True  # an answer in the second half
    inputs, _ = head.read_pass(feats, target)
    every = torch.arange(T)[None]  # one block at every position, those outside the mask counting nothing
    whole, _, _ = objective._loss(target, feats, inputs, every, mask.gather(1, every), mask, 1.0)
    blocks = []
    real = head.forward
    head.forward = lambda *a, **kw: blocks.append(kw["input_embeds"].shape[1]) or real(*a, **kw)
    try:
        got = objective.eval_loss(target, feats, mask)
    finally:
        del head.forward
    torch.testing.assert_close(got, whole.detach(), rtol=1e-5, atol=1e-6)
    assert sum(blocks) == int(mask.sum())


def test_held_out_rollout_runs_blocks_at_loss_positions_only_and_counts_the_same(fitted):
    """Simulated tau's chains, as validation counts them (``rollout_stats``): blocks only at the
    anchors in the loss mask, the same counts as blocks at every position."""
    from msd_train.training.validation import rollout_stats

    target, head, prompts = fitted
    objective = objective_for(head)
    enc = prompts["image"]
    out = generate(target, None, enc, DecodeConfig(method="ar", max_new_tokens=40, eos_token_ids=()))
    ids = torch.cat([enc.input_ids, torch.tensor(out.tokens)])[None]  # the answer the head was fitted to
    feats = target.features(ids, None, enc.pixel, layers=head.feature_layers)
    L = ids.shape[1]
    loss_mask = torch.zeros(1, L, dtype=torch.long)
    loss_mask[:, len(enc.input_ids):] = 1
    every = objective.rollout_hits(target, feats, 3)
    blocks = []
    real = head.forward
    head.forward = lambda *a, **kw: blocks.append(kw["input_embeds"].shape[1]) or real(*a, **kw)
    try:
        stats = rollout_stats(objective, target, feats, loss_mask, 3)
    finally:
        del head.forward
    mask = draft_loss_mask(loss_mask).bool()
    assert sum(blocks) == int(mask.sum()) < L - 1
    assert stats["valid"][0] == mask.sum() and stats["correct_any"][0] == (every[0] & mask).sum() > 0


def test_block_decoding_equals_plain_greedy_decoding(fitted):
    target, head, prompts = fitted
    for name, enc in prompts.items():  # text, one and two images, a second turn
        plain = generate(target, None, enc, DecodeConfig(method="ar", max_new_tokens=40, eos_token_ids=()))
        for k in (1, 3, 15):  # 15: the head's whole block (3 proposals)
            out = generate(target, head, enc, DecodeConfig(method="block", k=k, max_new_tokens=40, eos_token_ids=()))
            assert out.tokens == plain.tokens, (name, k)
            assert all(c.tree_size == min(k, 3) + 1 for c in out.cycles)
    # How many proposals a 20-step fit gets accepted depends on the random target's continuations,
    # which differ between transformers releases: the accepting path is exercised by the sampling
    # test's block case (tests/unit/test_sampling.py), whose proposals are accepted and rejected.


def test_the_block_drafted_is_the_heads_argmax_after_the_prompt(fitted):
    """The first block: the head over the whole prompt as context (no cache), root = first token."""
    target, head, prompts = fitted
    enc = prompts["image"]
    state = prefill(target, BlockDrafter(head), enc)
    first = int(state.next_logits.argmax())
    state.tokens.append(first)
    tree = state.drafter.draft_block(target, state.pending(), DecodeConfig(method="block", k=15))
    ids = enc.input_ids[None]
    feats = target.features(ids, None, enc.pixel, layers=head.feature_layers)
    x = head.target_inputs(feats)
    L = ids.shape[1]
    ctx = torch.cat([x["hidden_states"], head.context(feats.layer_states[:, -1:])], 1)  # h_0 .. h_{L-1}
    out = head(target.embed_tokens(torch.tensor([[first]])), ctx, torch.tensor([[L]]),
               torch.arange(L)[None]).last_hidden_state
    assert tree.tokens.tolist() == [first] + target.lm_head(out[0, 0, 1:]).argmax(-1).tolist()


def test_a_tree_setting_is_refused_before_anything_loads(tmp_path):
    from msd_train.decoding.build import check_method
    from msd_train.validate import check_head

    folder = tmp_path / "dflash"
    small_head().save_pretrained(folder)
    with pytest.raises(ConfigError, match=r"dflash head proposes a whole block .* cannot draft a tree shape; use "
                                          r"decoding=block"):
        check_head(str(folder), method="tree")
    with pytest.raises(ConfigError, match="ensembles draft with stepped heads"):
        check_head(str(folder), method="block", ensemble="ibed")
    check_head(str(folder), method="block")
    msd = tmp_path / "msd"
    MSDDraftModel(MSDDraftConfig_small()).save_pretrained(msd)
    with pytest.raises(ConfigError, match="decoding=block drafts a block in one forward.* use decoding=tree"):
        check_head(str(msd), method="block")
    with pytest.raises(ConfigError, match="cannot draft a chain shape"):
        check_method(small_head(), DecodeConfig(method="chain"))


def MSDDraftConfig_small():
    from msd_train.draft import MSDDraftConfig

    return MSDDraftConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, target_vocab_size=40)


def test_eval_refuses_a_tree_for_a_dflash_head_before_loading(tmp_path):
    import subprocess
    import sys

    folder = tmp_path / "dflash"
    small_head().save_pretrained(folder)
    out = subprocess.run([sys.executable, "eval.py", f"draft={folder}", "decoding=tree", f"out={tmp_path / 'e'}"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert "decoding.method=tree: a dflash head proposes a whole block" in out.stderr + out.stdout
    assert "Loading weights" not in out.stderr + out.stdout


def test_exports_loads_back_and_gets_a_card(tmp_path):
    from msd_train.hub import formats
    from msd_train.hub.card import model_card

    head = small_head(decouple_visual=False)
    head.save_pretrained(tmp_path / "final")
    summary = formats.get("msd").export(tmp_path / "final", tmp_path / "exported", dtype="bf16")
    back = MSDDraftModel.from_pretrained(tmp_path / "exported")
    assert type(back) is DFlashDraftModel and summary["dtype"] == "torch.bfloat16"
    assert back.config.block_size == 4 and back.config.decouple_visual is False and back.feature_layers == [2, 6]
    for k, v in head.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k].float(), v.to(torch.bfloat16).float(), rtol=0, atol=0)
    card = model_card(back.config, "me/dflash", [], num_parameters=back.num_parameters(), dtype="bfloat16")
    assert "# DFlash draft head (block drafter)" in card and "| block size | 4 " in card
    assert "gamma = 7.0; 512 anchors" in card
    assert "visual decoupling off" in card and "decoding=block" in card


def test_nothing_outside_its_own_files_registers_or_branches_on_it():
    """What adding the head touched in the product: its module (config, head class,
    ``register_head``), its objective (``register_objective``), its conf file and the package's
    import. The decoder picks the block drafter by the head's declared ``decoding_methods``,
    never by its name: no other product file imports its classes or compares with "dflash", but
    for the vLLM layout, which holds each head architecture its own way (``hub/vllm.py``, as it
    holds msd and msd3; "dflash" is also vLLM's method) and the plugin's class for it."""
    code = {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "msd_train").rglob("*.py")}
    imports = sorted(f for f, text in code.items() if "DFlashDraft" in text or "draft.dflash" in text)
    assert imports == ["msd_train/draft/__init__.py", "msd_train/draft/dflash.py"], imports
    literal = sorted(f for f, text in code.items() if "\"dflash\"" in text or "'dflash'" in text)
    assert literal == ["msd_train/draft/dflash.py", "msd_train/hub/vllm.py", "msd_train/serving/vllm_models.py",
                       "msd_train/training/objective.py"], literal
    conf = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "conf").rglob("*.yaml")
                  if "architecture: dflash" in p.read_text())
    assert conf == ["conf/head/dflash.yaml"]
