"""The head's position convention (``draft_positions``): 1-D as the released Qwen heads, or the target's M-RoPE."""

import json

import pytest
import torch
from builders import random_image

from msd_train.draft import MSDDraftConfig, MSDDraftModel, draft_position_ids, draft_rope_deltas

PROMPT = [{"role": "user", "content": "what is <image> this shape and <image> that one"}]


def qwen_config(target, positions: str) -> MSDDraftConfig:
    return MSDDraftConfig.from_target_config(target.config, target.name, draft_positions=positions)


@pytest.fixture(scope="module")
def image_prompt(qwen_target):
    """Ids, target M-RoPE ids and rope deltas of a prompt with two images of different sizes."""
    enc = qwen_target.encode_prompt(PROMPT, [random_image(1, 32), random_image(2, 24)])
    ids = enc.input_ids[None]
    pos, deltas = qwen_target.position_ids(ids, None, enc.pixel)
    return ids, pos, deltas


def test_1d_is_the_token_index_in_all_three_rows(qwen_target, image_prompt):
    ids, pos, _ = image_prompt
    first_image = int((ids[0] == qwen_target.image_token_id).nonzero()[0])
    one_d = draft_position_ids(qwen_config(qwen_target, "1d"), pos)
    assert one_d.shape == pos.shape == (3, 1, ids.shape[1])
    assert (one_d == torch.arange(ids.shape[1])).all()
    # the conventions agree on the text before the first image, not on the image or after it
    assert torch.equal(one_d[..., :first_image], pos[..., :first_image])
    assert not torch.equal(one_d[..., first_image:], pos[..., first_image:])
    assert not torch.equal(one_d[..., -1], pos[..., -1])
    # "mrope" is the target's own ids, untouched
    assert draft_position_ids(qwen_config(qwen_target, "mrope"), pos) is pos


@pytest.mark.parametrize("positions", ["1d", "mrope"])
def test_continuing_after_a_prompt_equals_one_pass(qwen_target, image_prompt, positions):
    """What a decoder computes after the prompt (``continue_positions`` with the draft's rope
    deltas, plus a tree node's depth) equals the ids of one pass over prompt + new tokens."""
    ids, pos, deltas = image_prompt
    config = qwen_config(qwen_target, positions)
    L, new = ids.shape[1], torch.tensor([[7, 8, 9, 10]])
    enc = qwen_target.encode_prompt(PROMPT, [random_image(1, 32), random_image(2, 24)])
    full_pos, _ = qwen_target.position_ids(torch.cat([ids, new], 1), None, enc.pixel)
    whole = draft_position_ids(config, full_pos)
    head_deltas = draft_rope_deltas(config, deltas)
    assert torch.equal(whole[..., :L], draft_position_ids(config, pos))
    assert torch.equal(whole[..., L:], qwen_target.continue_positions(L, 4, head_deltas))
    node = qwen_target.continue_positions(L, 1, head_deltas) + torch.tensor([0, 1, 2, 3])  # a chain of depths 0..3
    assert torch.equal(node, whole[..., L:])
    if positions == "1d":
        assert head_deltas.tolist() == [0] and int(deltas[0]) < 0
    else:
        assert head_deltas is deltas


def test_1d_ignores_right_padding_and_llava_keeps_its_ids(qwen_target, llava_target):
    pos = torch.stack([torch.arange(6), torch.tensor([0, 1, 2, 3, 3, 3])])  # row 1 right-padded
    assert torch.equal(draft_position_ids(qwen_config(qwen_target, "1d"), pos[None].expand(3, -1, -1))[:, 1, :4],
                       torch.arange(4).expand(3, 4))
    for positions in ("1d", "mrope"):  # 1-D RoPE targets: their ids already are token indices
        config = MSDDraftConfig.from_target_config(llava_target.config, "x", draft_positions=positions)
        assert draft_position_ids(config, pos) is pos
        assert draft_rope_deltas(config, None) is None
    with pytest.raises(ValueError, match=r"\(3, B, L\)"):
        draft_position_ids(qwen_config(qwen_target, "1d"), torch.zeros(4, 1, 6, dtype=torch.long))


def test_a_head_drafts_alike_before_the_image_and_apart_after_it(qwen_target, image_prompt):
    """The measured symptom of feeding a head the other convention: identical outputs on the
    text before the first image, different ones on and after it."""
    ids, pos, _ = image_prompt
    first_image = int((ids[0] == qwen_target.image_token_id).nonzero()[0])
    torch.manual_seed(0)
    head = MSDDraftModel(qwen_config(qwen_target, "1d")).eval()
    with torch.no_grad():  # sharp attention, so that where a key sits matters visibly
        for proj in (head.layers[0].self_attn.q_proj, head.layers[0].self_attn.k_proj):
            proj.weight.mul_(30)
    e, h = torch.randn(2, 1, ids.shape[1], qwen_target.hidden_size).unbind(0)
    with torch.no_grad():
        a = head(e, h, position_ids=draft_position_ids(head.config, pos)).last_hidden_state
        b = head(e, h, position_ids=pos).last_hidden_state
    torch.testing.assert_close(a[:, :first_image], b[:, :first_image], rtol=0, atol=1e-6)
    assert (a[:, first_image + 1:] - b[:, first_image + 1:]).abs().amax(-1).min() > 1e-3


def test_a_new_head_built_through_the_library_is_1d(qwen_target):
    """New heads draft at 1-D positions whichever way they are built: the library's builder
    (what scripts and training call) and the training config agree; only a saved head without
    the field reads as "mrope" (test_saved_with_the_head)."""
    from omegaconf import OmegaConf

    from msd_train.config import CONF_DIR
    from msd_train.draft import MSD3DraftConfig

    for config_class, head in ((MSDDraftConfig, "msd"), (MSD3DraftConfig, "msd3")):
        config = config_class.from_target_config(qwen_target.config, qwen_target.name)
        assert config.uses_mrope and config.draft_positions == "1d", head
        assert OmegaConf.load(CONF_DIR / "head" / f"{head}.yaml").draft_positions == "1d", head
    assert MSDDraftConfig.from_target_config(qwen_target.config, "x", draft_positions="mrope").draft_positions == "mrope"


def test_saved_with_the_head(qwen_target, tmp_path):
    head = MSDDraftModel(qwen_config(qwen_target, "1d"))
    head.save_pretrained(tmp_path / "a")
    assert json.loads((tmp_path / "a" / "config.json").read_text())["draft_positions"] == "1d"
    assert MSDDraftModel.from_pretrained(tmp_path / "a").config.draft_positions == "1d"
    # a head saved before the field existed was trained on the target's M-RoPE ids
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    del config["draft_positions"]
    (tmp_path / "a" / "config.json").write_text(json.dumps(config))
    assert MSDDraftModel.from_pretrained(tmp_path / "a").config.draft_positions == "mrope"
    from huggingface_hub.errors import StrictDataclassFieldValidationError

    with pytest.raises(StrictDataclassFieldValidationError, match=r"draft_positions[\s\S]*'mrope', '1d'"):
        MSDDraftConfig(draft_positions="2d")


def test_imported_qwen_head_says_1d(qwen_target, tmp_path):
    """A head in the released layout (written by the exporter) imports as a 1-D-position
    head; exporting an M-RoPE-position head to that layout is refused, since the released
    code drafts in 1-D (a format keeps what the head drafts with, or refuses)."""
    from msd_train.hub import TargetInfo, export_reference, import_reference, load_head

    MSDDraftModel(qwen_config(qwen_target, "mrope")).save_pretrained(tmp_path / "mrope")
    with pytest.raises(ValueError, match="draft_positions='mrope': the released code drafts with 1-D positions"):
        export_reference(tmp_path / "mrope", tmp_path / "refused", target=TargetInfo.of(qwen_target))
    MSDDraftModel(qwen_config(qwen_target, "1d")).save_pretrained(tmp_path / "ours")
    summary = export_reference(tmp_path / "ours", tmp_path / "released", target=TargetInfo.of(qwen_target))
    assert summary["warnings"] == []
    assert json.loads((tmp_path / "released" / "config.json").read_text())["model_type"] == "qwen2_vl"
    report = import_reference(tmp_path / "released", tmp_path / "imported", target=TargetInfo.of(qwen_target))
    assert report.config["draft_positions"] == "1d"
    assert MSDDraftModel.from_pretrained(tmp_path / "imported").config.draft_positions == "1d"
    assert load_head(tmp_path / "released", target=qwen_target).config.draft_positions == "1d"


@pytest.mark.parametrize("positions", ["1d", "mrope"])
def test_the_decoder_drafts_at_the_heads_positions(qwen_target, positions):
    """After the prefill, the head's prediction for the root's children is what the head
    gives over the whole sequence at its own convention's ids (a "1d" head: token indices,
    as the released Qwen heads run), and decoding stays exact."""
    from msd_train.decoding import DecodeConfig, HeadDrafter, generate, prefill
    from msd_train.targets import Features

    enc = qwen_target.encode_prompt(PROMPT, [random_image(1, 32), random_image(2, 24)])
    torch.manual_seed(0)
    head = MSDDraftModel(qwen_config(qwen_target, positions)).eval()
    state = prefill(qwen_target, HeadDrafter(head), enc)
    root = int(state.next_logits.argmax())
    state.tokens.append(root)
    state.pending_tokens = None
    with torch.inference_mode():  # the pending pair (h at the prompt's end, e(root))
        out = state.drafter.feed_pending(qwen_target, state.pending())[0]

    ids = torch.cat([enc.input_ids, torch.tensor([root])])[None]  # its last draft pair is that same pair
    f = qwen_target.features(ids, None, enc.pixel)
    f = Features(f.inputs_embeds, f.hidden_states, f.visual_mask, f.position_ids)
    with torch.no_grad():
        whole = head(**head.target_inputs(f)).last_hidden_state[0, -1]
    torch.testing.assert_close(out, whole, atol=1e-5, rtol=1e-4)

    plain = generate(qwen_target, None, enc, DecodeConfig(method="ar", max_new_tokens=12, eos_token_ids=()))
    for method in ({"method": "tree", "depth": 2, "top_k": 3, "total_tokens": 8}, {"method": "chain", "k": 3}):
        out = generate(qwen_target, head, enc, DecodeConfig(max_new_tokens=12, eos_token_ids=(), **method))
        assert out.tokens == plain.tokens
