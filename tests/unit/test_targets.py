"""Conversation formatting, visual-token expansion and positions against the models' own forwards."""

import pytest
import torch
from builders import random_image

CONV = [
    {"role": "user", "content": "<image>\nwhat colour is the shape"},
    {"role": "assistant", "content": "it is red"},
    {"role": "user", "content": "and the <image> second one"},
    {"role": "assistant", "content": "a blue circle"},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "hello world"},
]


def _assistant_spans(ids, mask):
    spans, cur = [], []
    for i, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(i)
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    return spans


@pytest.mark.parametrize("name", ["llava_target", "qwen_target"])
def test_loss_mask_decodes_to_assistant_turns(name, request):
    target = request.getfixturevalue(name)
    enc = target.encode(CONV, [random_image(1), random_image(2)])
    spans = [target.tokenizer.decode(s) for s in _assistant_spans(enc.input_ids, enc.loss_mask)]
    eot = target.end_of_turn
    want = [m["content"] for m in CONV if m["role"] == "assistant"]
    prefix = " " if target.family == "llava" else ""  # Vicuna puts a space after "ASSISTANT:"
    assert spans == [prefix + w + eot for w in want]
    # the end-of-turn token is a single token and carries the loss
    assert enc.input_ids[enc.loss_mask.bool()].tolist().count(target.tokenizer.convert_tokens_to_ids(eot)) == 3


@pytest.mark.parametrize("name", ["llava_target", "qwen_target"])
def test_visual_tokens_match_model_forward(name, request):
    """The ids we build expand each image to exactly what the model fills in, in order."""
    target = request.getfixturevalue(name)
    images = [random_image(1, 32), random_image(2, 24)]
    enc = target.encode(CONV, images)
    visual = enc.input_ids == target.image_token_id
    per_image = target.image_inputs(images)[1]
    assert int(visual.sum()) == sum(per_image)
    feats = target.features(enc.input_ids[None], None, enc.pixel)
    # the visual rows of inputs_embeds are the projector outputs, in image order
    vis = target.visual_embeddings({k: v for k, v in enc.pixel.items()})
    assert torch.equal(feats.inputs_embeds[0][visual], vis.to(feats.inputs_embeds.dtype))
    # and the model's own forward (which expands and checks counts itself) agrees on the output
    kwargs = dict(enc.pixel)
    if target.family == "qwen2_vl":
        kwargs["mm_token_type_ids"] = visual[None].int()
    out = target.model(input_ids=enc.input_ids[None], output_hidden_states=True, **kwargs)
    torch.testing.assert_close(feats.hidden_states, out.hidden_states[-1], rtol=0, atol=1e-5)
    torch.testing.assert_close(target.lm_head(feats.hidden_states), out.logits, rtol=0, atol=1e-5)
    # two image blocks, contiguous, each of its image's size
    runs = torch.diff(torch.cat([torch.tensor([0]), visual.int(), torch.tensor([0])])).nonzero().flatten()
    lengths = (runs[1::2] - runs[::2]).tolist()
    assert lengths == per_image


def test_qwen_mrope_positions_equal_models_own(qwen_target):
    target = qwen_target
    enc = target.encode(CONV, [random_image(3, 32), random_image(4, 28)])
    ids = enc.input_ids[None]
    pos, deltas = target.position_ids(ids, None, enc.pixel)
    model_pos = target.model.model.compute_3d_position_ids(
        input_ids=ids, inputs_embeds=target.embed(ids, enc.pixel), image_grid_thw=enc.pixel["image_grid_thw"],
        mm_token_type_ids=(ids == target.image_token_id).int())
    assert pos.shape == (3, 1, ids.shape[1])
    assert torch.equal(pos, model_pos)
    # positions are not trivial: the image spans a 2-D grid, so text after it is offset
    assert int(deltas[0]) < 0
    # continuing after the prompt follows the model's own rule: index + delta on all axes
    nxt = target.continue_positions(ids.shape[1], 2, deltas)
    assert nxt[:, 0].tolist() == [[ids.shape[1] + int(deltas[0]) + i for i in range(2)]] * 3


def test_qwen_batch_positions_with_padding(qwen_target):
    """Right-padded batches get each row's own positions (as computed alone)."""
    target = qwen_target
    a = target.encode(CONV[:2], [random_image(5, 32)])
    b = target.encode(CONV[2:4], [random_image(6, 24)])
    L = max(len(a.input_ids), len(b.input_ids))
    ids = torch.zeros(2, L, dtype=torch.long)
    att = torch.zeros(2, L, dtype=torch.long)
    for i, e in enumerate((a, b)):
        ids[i, : len(e.input_ids)] = e.input_ids
        att[i, : len(e.input_ids)] = 1
    pixel = {"pixel_values": torch.cat([a.pixel["pixel_values"], b.pixel["pixel_values"]]),
             "image_grid_thw": torch.cat([a.pixel["image_grid_thw"], b.pixel["image_grid_thw"]])}
    pos, _ = target.position_ids(ids, att, pixel)
    for i, e in enumerate((a, b)):
        alone, _ = target.position_ids(e.input_ids[None], None, e.pixel)
        assert torch.equal(pos[:, i, : len(e.input_ids)], alone[:, 0])


def test_prompt_ends_with_generation_prompt(llava_target):
    enc = llava_target.encode_prompt(CONV[:3], [random_image(1), random_image(2)])
    text = llava_target.tokenizer.decode(enc.input_ids, skip_special_tokens=False)
    assert text.endswith("ASSISTANT:")
    assert int(enc.loss_mask.sum()) == 0


def test_qwen2vl_folder_loads_without_torchvision(tmp_path, qwen_target):
    """A saved Qwen2-VL folder loads through load_target; without torchvision (as here)
    its processor is the tokenizer plus the PIL image processor, which encode exactly
    what the full processor's pieces encode."""
    from builders import tiny_qwen2vl

    from msd_train.targets import load_target

    model, proc = tiny_qwen2vl()
    model.save_pretrained(tmp_path)
    proc.tokenizer.save_pretrained(tmp_path)
    proc.image_processor.save_pretrained(tmp_path)
    target = load_target(str(tmp_path), "auto", "cpu", chat_template="chatml_qwen")
    messages = [{"role": "user", "content": "<image>\nwhat is it?"}]
    got = target.encode_prompt(messages, [random_image(4)])
    want = qwen_target.encode_prompt(messages, [random_image(4)])
    assert torch.equal(got.input_ids, want.input_ids)
    assert torch.equal(got.pixel["pixel_values"], want.pixel["pixel_values"])
    assert target.image_grids(got.pixel) == qwen_target.image_grids(want.pixel)
