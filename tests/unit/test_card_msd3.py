"""The model card of an msd3 head: what it is, how to load it, and its numbers."""

import json

from msd_train.draft import MSD3DraftConfig, MSD3DraftModel
from msd_train.hub import load_head, plan_push

H, INTER, HEADS, VOCAB = 32, 64, 4, 40


def _msd3_export(tmp_path, decouple: bool):
    final = tmp_path / ("on" if decouple else "off") / "stage2" / "final"
    config = MSD3DraftConfig(hidden_size=H, intermediate_size=INTER, num_attention_heads=HEADS,
                             target_name_or_path="llava-hf/llava-1.5-7b-hf", target_vocab_size=VOCAB,
                             draft_vocab_size=24, target_num_layers=32, decouple_visual=decouple, ttt_steps=5)
    MSD3DraftModel(config).save_pretrained(final)
    draft = {"architecture": "msd3", "ttt_steps": 5, "ttt_decay": 0.8, "decouple_visual": decouple,
             "feature_layers": None}
    meta = {"stage": 2, "step": 150, "command": "deepspeed train.py stage=2 head=msd3",
            "config": {"stage": {"id": 2, "init_from": None}, "draft": draft, "train": {"max_steps": 150}}}
    (final / "training.json").write_text(json.dumps(meta))
    report = {"draft": str(final), "device": "cpu", "decoding": {"method": "tree", "depth": 5},
              "overall": {"tau": 2.345, "accept_at_pos": [0.61, 0.42], "outputs_match_ar": True, "n_samples": 8},
              "per_category": {"image_question": {"tau": 2.101, "accept_at_pos": [0.5]}}}
    (final / "report.json").write_text(json.dumps(report))
    return final


def test_an_msd3_heads_card_says_what_it_is_how_to_load_it_and_its_numbers(tmp_path):
    final = _msd3_export(tmp_path, decouple=True)
    card = plan_push(final, "me/msd3-llava").card
    meta, body = card.split("---")[1], card.split("---", 2)[2]
    assert "eagle3" in meta and "base_model: llava-hf/llava-1.5-7b-hf" in meta
    assert "# MSD-3 draft head (EAGLE-3 style) for llava-hf/llava-1.5-7b-hf" in body
    # the architecture: EAGLE-3's fused layers (2, N/2, N-3 of 32), draft vocabulary, TTT steps, decoupling
    assert "| fused target layers | inputs of layers 2, 16, 29 of 32 |" in body
    assert "| draft vocabulary | 24 tokens of the target's 40 (`d2t`/`t2d` saved with the head) |" in body
    assert "| training-time test steps | 5 (step i's loss weighted 0.8^i) |" in body
    assert "| visual decoupling | on: the projector's outputs at image positions |" in body
    assert "its own `lm_head` over a draft vocabulary of 24" in body
    # the msd head's fields that an msd3 head does not read are not shown
    assert "fc bias" not in body and "visual offset" not in body and "`lm_head`, and the target" not in body
    # how to load it, and the EAGLE-3 layout
    assert "head = load_head('me/msd3-llava', target=target)" in body
    assert 'export_eagle3(head, "eagle3-head")' in body
    assert isinstance(load_head(final), MSD3DraftModel)
    # its numbers and how it was trained
    assert "| overall | 2.345 |" in body and "| image_question | 2.101 |" in body
    assert "- overall: [0.61, 0.42]" in body
    assert "- head: msd3, ttt_steps=5, ttt_decay=0.8, decouple_visual=True" in body


def test_an_msd3_card_without_decoupling_says_plain_eagle3(tmp_path):
    body = plan_push(_msd3_export(tmp_path, decouple=False), "me/eagle3-llava").card
    assert "| visual decoupling | off: the image placeholder's embedding at image positions (plain EAGLE-3) |" in body
    assert "the image placeholder token's embedding at image positions (plain EAGLE-3" in body
    assert "decoupled visual tokens" not in body and "| architecture | msd3 (EAGLE-3's head, visual decoupling off) |" in body
