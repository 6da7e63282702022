"""The tiny Qwen2-VL folder of lab/studies/draft_positions.py: the trained tiny LLaVA's
language model under M-RoPE, loadable as any Qwen2-VL folder."""

from pathlib import Path

import torch
from PIL import Image

from lab.targets.tiny_qwen import save_tiny_qwen2vl
from msd_train.targets import load_target

ROOT = Path(__file__).resolve().parents[2]


def test_folder_loads_and_keeps_the_trained_language_model(tmp_path):
    from transformers import LlavaForConditionalGeneration

    folder = save_tiny_qwen2vl(tmp_path / "qwen", ROOT / "data" / "tiny-llava")
    target = load_target(str(folder), "auto", "cpu", chat_template="chatml_qwen")
    assert type(target.model).__name__ == "Qwen2VLForConditionalGeneration"

    # on text (equal M-RoPE rows) the Qwen model computes what the LLaVA language model does
    llava = LlavaForConditionalGeneration.from_pretrained(ROOT / "data" / "tiny-llava").eval()
    ids = target.tokenizer("What does os.path.join do?", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = llava(input_ids=ids).logits
        got = target.model(input_ids=ids).logits[..., : want.shape[-1]]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    # a 48x48 image is a 6x6 grid of 36 tokens, after which M-RoPE ids leave the token
    # index behind: the two draft_positions conventions really differ on this target
    image = Image.new("RGB", (48, 48), (200, 30, 30))
    enc = target.encode_prompt([{"role": "user", "content": "<image>\nWhat colour is it?"}], [image])
    assert int((enc.input_ids == target.image_token_id).sum()) == 36
    pos, deltas = target.position_ids(enc.input_ids[None], None, enc.pixel)
    assert int(deltas.flatten()[0]) == 6 - 36
    assert int(pos[0, 0, -1]) == enc.input_ids.shape[0] - 1 + 6 - 36
