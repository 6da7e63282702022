"""Qwen2.5-VL end to end on a tiny random target: features, positions, decoding, training.

The target (tests/builders.py) has Qwen2.5-VL's window-attention vision tower with windows
smaller than the images, and M-RoPE; images of different sizes (and a non-square one)
give different grids, so positions after each image are offset differently.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from builders import (
    fit_head,
    image_prompts,
    model_inputs,
    padded,
    random_image,
    tiny_qwen25vl,
    tiny_qwen25vl_target,
    wide_image,
    write_mini_data,
)

from msd_train.decoding import DecodeConfig, generate
from msd_train.draft import MSDDraftConfig, MSDDraftModel

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_thread")

TREE = dict(method="tree", depth=3, top_k=4, total_tokens=16)
CHAIN = dict(method="chain", k=4)
CONV = [
    {"role": "user", "content": "<image>\nwhat colour is the shape"},
    {"role": "assistant", "content": "it is red"},
    {"role": "user", "content": "and the <image> second one"},
    {"role": "assistant", "content": "a blue circle"},
]


@pytest.fixture(scope="module")
def target():
    return tiny_qwen25vl_target()


# ----- features and positions ---------------------------------------------------------


def test_features_equal_the_models_own_forward(target):
    """Embeddings (window-attention vision tower outputs at the image slots), post-norm
    hidden states and logits equal the model's own forward, alone and in a padded batch."""
    a = target.encode(CONV, [random_image(1, 32), wide_image(2)])
    b = target.encode(CONV[:2], [random_image(3, 24)])
    grids = target.image_grids(a.pixel)
    assert grids == [(4, 4), (3, 5)]  # windows of 2x2 merged tokens: both images span several
    vision = target.config.vision_config
    assert vision.window_size // vision.spatial_merge_size // vision.patch_size == 2
    visual = a.input_ids == target.image_token_id
    assert int(visual.sum()) == 16 + 15

    feats = target.features(a.input_ids[None], None, a.pixel)
    out = target.model(**model_inputs(target, a.input_ids[None], a.pixel), output_hidden_states=True)
    own_visual = torch.cat(target.model.model.get_image_features(a.pixel["pixel_values"], a.pixel["image_grid_thw"],
                                                                  return_dict=True).pooler_output)
    assert torch.equal(feats.inputs_embeds[0][visual], own_visual)
    torch.testing.assert_close(feats.hidden_states, out.hidden_states[-1], rtol=0, atol=1e-5)
    torch.testing.assert_close(target.lm_head(feats.hidden_states), out.logits, rtol=0, atol=1e-5)
    assert torch.equal(feats.visual_mask[0], visual)

    ids, att, pixel = padded([a, b])
    feats = target.features(ids, att, pixel)
    out = target.model(**model_inputs(target, ids, pixel, att), output_hidden_states=True)
    real = att.bool()
    torch.testing.assert_close(feats.hidden_states[real], out.hidden_states[-1][real], rtol=0, atol=1e-5)
    torch.testing.assert_close(target.lm_head(feats.hidden_states)[real], out.logits[real], rtol=0, atol=1e-5)


def test_positions_equal_get_rope_index(target):
    """M-RoPE ids and rope deltas are the model's own (``get_rope_index`` and the ids its
    forward builds), for one sample and for a right-padded batch."""
    a = target.encode(CONV, [wide_image(4), random_image(5, 32)])
    b = target.encode(CONV[:2], [random_image(6, 24)])
    model = target.model.model
    for ids, att, pixel in [(a.input_ids[None], None, a.pixel), padded([a, b])]:
        pos, deltas = target.position_ids(ids, att, pixel)
        types = (ids == target.image_token_id).int()
        own, own_deltas = model.get_rope_index(ids, types, image_grid_thw=pixel["image_grid_thw"],
                                               attention_mask=att)
        real = att.bool() if att is not None else torch.ones_like(ids, dtype=torch.bool)
        assert torch.equal(pos[:, real], own[:, real])
        assert deltas.tolist() == own_deltas.flatten().tolist()
        model.rope_deltas = None
        built = model.compute_3d_position_ids(input_ids=ids, image_grid_thw=pixel["image_grid_thw"],
                                              video_grid_thw=None, inputs_embeds=target.embed(ids, pixel),
                                              attention_mask=att, past_key_values=None, mm_token_type_ids=types)
        model.rope_deltas = None
        assert torch.equal(pos[:, real], built[:, real])
    # the wide image spans 3 rows and 5 columns: text after it continues from the larger side
    pos, deltas = target.position_ids(a.input_ids[None], None, a.pixel)
    first = int((a.input_ids == target.image_token_id).nonzero()[0])
    assert pos[:, 0, first + 15].tolist() == [pos[0, 0, first] + 5] * 3
    assert int(deltas[0]) < 0


# ----- decoding -----------------------------------------------------------------------


def prompts(target) -> dict:
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    return {
        **image_prompts(target),
        "second_turn": target.encode_prompt(
            [user("<image>\ndescribe this image"), {"role": "assistant", "content": "a red circle"},
             user("and <image> how many squares are there")], [random_image(4, 32), random_image(5, 24)]),
    }


def fitted_head(target, encs, steps: int = 200) -> MSDDraftModel:
    """A head fitted (top-1 cross-entropy) to the target's greedy continuations of ``encs``,
    so that drafts are often accepted: deep paths, non-first siblings, cache moves."""
    torch.manual_seed(0)
    head = MSDDraftModel(MSDDraftConfig.from_target_config(target.config, target.name))
    batch = []
    for enc in encs:
        new = torch.tensor(generate(target, None, enc, DecodeConfig(method="ar", max_new_tokens=40,
                                                                     eos_token_ids=())).tokens)
        ids = torch.cat([enc.input_ids, new])[None]
        with torch.no_grad():
            f = target.features(ids, None, enc.pixel)
        batch.append((head.target_inputs(f), target.lm_head(f.hidden_states[0, 1:]).argmax(-1)))
    return fit_head(head, target, batch, steps)


@pytest.fixture(scope="module")
def decoding_setup(target):
    encs = prompts(target)
    return encs, fitted_head(target, list(encs.values()))


@pytest.mark.slow
def test_plain_decoding_equals_transformers_generate(target, decoding_setup):
    """The baseline the speedup is measured against is the model's own greedy output."""
    encs, _ = decoding_setup
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=24, eos_token_id=None, pad_token_id=0)
    for name in ("one_image", "two_images"):
        enc = encs[name]
        ours = generate(target, None, enc, DecodeConfig(method="ar", max_new_tokens=24, eos_token_ids=()))
        theirs = target.model.generate(**model_inputs(target, enc.input_ids[None], enc.pixel), generation_config=gen)
        target.model.model.rope_deltas = None
        assert ours.tokens == theirs[0, len(enc.input_ids):].tolist(), name


def test_greedy_tree_and_chain_equal_plain_decoding(target, decoding_setup):
    encs, head = decoding_setup
    accepted = []
    for name, enc in encs.items():
        plain = generate(target, None, enc, DecodeConfig(method="ar", max_new_tokens=40, eos_token_ids=()))
        assert len(plain.tokens) == 40
        for method in (TREE, CHAIN):
            out = generate(target, head, enc, DecodeConfig(max_new_tokens=40, eos_token_ids=(), **method))
            assert out.tokens == plain.tokens, f"{name} {method['method']}"
            accepted += [c.accepted for c in out.cycles]
    assert max(accepted) >= 2 and sum(accepted) / len(accepted) > 0.5, "the head is hardly ever accepted"


# ----- training -----------------------------------------------------------------------


@pytest.mark.slow
def test_two_training_stages(tmp_path, target):
    """``python train.py stage=1`` then ``stage=2`` on a Qwen2.5-VL folder laid out as on the
    Hub (loaded through ``load_target``, no torchvision): both stages train, export and
    validate, stage 2 on image conversations too."""
    from msd_train.targets import load_target

    model, proc = tiny_qwen25vl(seed=1)
    model.save_pretrained(tmp_path / "target")
    proc.tokenizer.save_pretrained(tmp_path / "target")
    proc.image_processor.save_pretrained(tmp_path / "target")
    # the Hub's preprocessor_config.json names the full processor, whose video half needs torchvision
    config_file = tmp_path / "target" / "preprocessor_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "processor_class": "Qwen2_5_VLProcessor"}))
    loaded = load_target(str(tmp_path / "target"), "auto", "cpu", chat_template="chatml_qwen")
    want = target.encode(CONV, [random_image(1, 32), wide_image(2)])
    got = loaded.encode(CONV, [random_image(1, 32), wide_image(2)])
    assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.loss_mask, want.loss_mask)
    assert torch.equal(got.pixel["pixel_values"], want.pixel["pixel_values"])
    assert type(loaded.model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    data = write_mini_data(tmp_path, 12, 4, lambda i: wide_image(i) if i % 2 else random_image(100 + i, 32),
                           (4, 6, 3, 5))
    common = [f"target.name_or_path={tmp_path / 'target'}", "target.chat_template=chatml_qwen", *data,
              "logging.wandb.mode=disabled", "logging.progress=false",
              f"run_dir={tmp_path / 'run'}", "train.micro_batch_size=2", "train.max_steps=3", "eval.every=100",
              "checkpoint.every=100", "eval.batch_size=4"]
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    for stage in ("1", "2"):
        extra = ["stage.curriculum.start=0.5", "stage.curriculum.end=0.5"] if stage == "2" else []
        res = subprocess.run([sys.executable, str(ROOT / "train.py"), f"stage={stage}", *common, *extra], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]

    run = tmp_path / "run"
    s1 = MSDDraftModel.from_pretrained(run / "stage1" / "final")
    s2 = MSDDraftModel.from_pretrained(run / "stage2" / "final")
    assert s2.config.mrope_section == [2, 1, 1] and s2.config.layer_family == "qwen2"
    assert s2.config.target_name_or_path == "target"  # a folder outside the checkout: its name, no machine path
    moved = [k for k, v in s1.state_dict().items() if not torch.equal(v, s2.state_dict()[k])]
    assert "fc.weight" in moved, "stage 2 did not train the stage-1 head"
    rows = [json.loads(x) for x in (run / "stage2" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "mm_share" in r]
    assert len(steps) == 3 and all(r["mm_share"] == 0.5 and r["loss"] == r["loss"] for r in steps)
    val = [r for r in rows if "val/mm/sim_tau" in r]
    assert val and val[-1]["val/mm/sim_tau"] >= 1.0 and "val/text/sim_tau" in val[-1]
    assert not (run / "stage2" / "skipped_samples.jsonl").exists()
