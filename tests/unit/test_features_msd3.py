"""Offline features for an msd3 head: the store keeps the inputs of its layers per token."""

import pytest
import torch
from builders import CONV, merged_by_hand
from builders.runs import batch_of, gen_cfg, split_rows, train_cfg

from msd_train.features.generate import generate
from msd_train.features.offline import OfflineFeatures
from msd_train.features.store import FeatureStoreError
from msd_train.training.objective import objective_for


@pytest.mark.slow
def test_a_store_with_layers_gives_the_online_layer_inputs(mini_run, mini_target, tmp_path):
    target = mini_target
    layers = [0, 1]  # the mini target's two layers: what an msd3 head reads by default
    plain = generate(gen_cfg(mini_run, tmp_path / "plain", "splits=[multimodal]"), target=target)
    manifest = generate(gen_cfg(mini_run, tmp_path / "k", "splits=[multimodal]", "features.layers=[0,1]"),
                        target=target)
    assert manifest["layers"] == layers and "layers" not in plain
    # k layers plus the last: the hidden rows take (k+1) times the bytes, the rest (visual rows, ids) as before
    assert plain["totals"]["bytes"] < manifest["totals"]["bytes"] < 3 * plain["totals"]["bytes"]

    cfg = train_cfg(mini_run, tmp_path / "k", "stage.splits=[multimodal]")
    source = OfflineFeatures(cfg, target, layers)
    rows = split_rows(mini_run, target, "multimodal")[:3]
    batch = batch_of(target, rows)
    on = target.features(batch["input_ids"], batch["attention_mask"], batch["pixel"], layers=layers)
    off = source({**batch, "pixel": {}})
    for i, r in enumerate(rows):
        last = max(j for j, m in enumerate(r["loss_mask"]) if m)
        torch.testing.assert_close(off.hidden_states[i, :last], on.hidden_states[i, :last], rtol=0, atol=1e-5)
        torch.testing.assert_close(off.layer_states[i, :last], on.layer_states[i, :last], rtol=0, atol=1e-5)

    # the store's top-1 ids spare the head's loss the full-vocabulary argmax, and change nothing
    import dataclasses

    from msd_train.draft import MSD3DraftConfig, MSD3DraftModel
    from msd_train.draft.loss import draft_loss_mask, loss_index

    torch.manual_seed(0)
    head = MSD3DraftModel(MSD3DraftConfig.from_target_config(target.config, target.name, target_vocab_size=target.vocab_size,
                                                             draft_vocab_size=16, ttt_steps=2))
    index = loss_index(draft_loss_mask(batch["loss_mask"]))
    train = type("T", (), {"w_feat": 1.0, "w_tok": 0.1})()
    assert off.target_top is not None
    with_top, parts = objective_for(head).training_loss(target, off, index, 10.0, train)
    without, _ = objective_for(head).training_loss(target, dataclasses.replace(off, target_top=None), index, 10.0, train)
    torch.testing.assert_close(with_top, without)
    assert parts["valid_0"] > 0

    # an msd head (no layers) trains from the same store: each row's last output, as a plain store gives
    msd_off = OfflineFeatures(cfg, target)({**batch, "pixel": {}})
    plain_off = OfflineFeatures(train_cfg(mini_run, tmp_path / "plain", "stage.splits=[multimodal]"), target)(
        {**batch, "pixel": {}})
    assert msd_off.layer_states is None
    torch.testing.assert_close(msd_off.hidden_states, plain_off.hidden_states, rtol=0, atol=0)

    with pytest.raises(FeatureStoreError, match=r"features.layers=\[1\]"):
        OfflineFeatures(cfg, target, [1])
    with pytest.raises(FeatureStoreError, match="holds the inputs of target layers none"):
        OfflineFeatures(train_cfg(mini_run, tmp_path / "plain", "stage.splits=[multimodal]"), target, layers)


def test_a_lora_targets_layer_inputs_are_the_adapted_ones(base_and_adapter):
    """An msd3 head of a LoRA target reads the adapted model's layer inputs (as merging by hand gives)."""
    from builders import random_image

    from msd_train.targets import load_target

    base, adapter, processor = base_and_adapter
    plain = load_target(str(base), dtype="fp32")
    tuned = load_target(str(base), dtype="fp32", adapter=str(adapter))
    by_hand, _ = merged_by_hand(base, adapter, processor)
    enc = plain.encode(CONV, [random_image(1)])
    layers = [0, 1]
    f = {name: t.features(enc.input_ids[None], None, enc.pixel, layers=layers)
         for name, t in (("plain", plain), ("tuned", tuned), ("hand", by_hand))}
    H = plain.hidden_size
    assert torch.equal(f["tuned"].layer_states[..., :H], f["plain"].layer_states[..., :H])  # layer 0's input
    assert (f["tuned"].layer_states[..., H:] - f["plain"].layer_states[..., H:]).abs().max() > 1e-3
    torch.testing.assert_close(f["tuned"].layer_states, f["hand"].layer_states, rtol=1e-6, atol=1e-6)


def test_a_batch_mixing_text_and_image_samples_reads_from_a_store_with_layers(mini_run, mini_target, tmp_path):
    """A stage-2 batch takes text samples (from shards without images) and image samples
    from one store with layers: both an msd head (last output only) and an msd3 head read it,
    the visual rows at the embedding's width."""
    target = mini_target
    path = tmp_path / "mixed"
    generate(gen_cfg(mini_run, path, "splits=[text,multimodal]", "features.layers=[0,1]"), target=target)
    rows = split_rows(mini_run, target, "text")[:2] + split_rows(mini_run, target, "multimodal")[:2]
    batch = {**batch_of(target, rows), "pixel": {}}
    cfg = train_cfg(mini_run, path, "stage.splits=[text,multimodal]")
    n_image = int((batch["input_ids"] == target.image_token_id).sum())
    assert n_image > 0
    for layers in (None, [0, 1]):
        part = OfflineFeatures(cfg, target, layers).host(batch)
        assert part["visual"].shape == (n_image, target.hidden_size)
        f = OfflineFeatures(cfg, target, layers)(batch)
        assert (f.layer_states is None) == (layers is None)
