"""PEFT targets: `load_target(adapter=...)` merges a LoRA adapter exactly as W + B @ A * scale."""

import json

import pytest
import torch
from builders import random_image, tiny_llava
from safetensors.torch import load_file

from msd_train.targets import load_target, wrap_target

CONV = [
    {"role": "user", "content": "<image>\nwhat colour is the shape"},
    {"role": "assistant", "content": "it is red"},
]


@pytest.fixture(scope="module")
def base_and_adapter(tmp_path_factory):
    """A tiny LLaVA saved as a model folder, and a LoRA adapter made for it with peft."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("peft")
    model, processor = tiny_llava()
    model.save_pretrained(root / "base")
    processor.save_pretrained(root / "base")
    config = LoraConfig(r=4, lora_alpha=12, lora_dropout=0.0,
                        target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)")
    peft_model = get_peft_model(tiny_llava()[0], config)
    torch.manual_seed(1)
    with torch.no_grad():  # lora_B starts at zero; a trained adapter would not be
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.2)
    peft_model.save_pretrained(root / "lora")
    return root / "base", root / "lora", processor


def merged_by_hand(base, adapter, processor):
    """The base model with every adapted weight replaced by W + B @ A * (lora_alpha / r)."""
    from transformers import LlavaForConditionalGeneration

    cfg = json.loads((adapter / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / cfg["r"]
    lora = load_file(adapter / "adapter_model.safetensors")
    model = LlavaForConditionalGeneration.from_pretrained(base, dtype=torch.float32).eval()
    merged = []
    with torch.no_grad():
        for key in sorted(k for k in lora if k.endswith(".lora_A.weight")):
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            A, B = lora[key], lora[key.replace(".lora_A.", ".lora_B.")]
            weight = model.get_submodule(module).weight
            weight.copy_(weight + (B @ A) * scale)
            merged.append(module)
    return wrap_target(model, processor, "by-hand"), merged


def test_lora_adapter_changes_features_as_merging_by_hand(base_and_adapter):
    base, adapter, processor = base_and_adapter
    plain = load_target(str(base), dtype="fp32")
    tuned = load_target(str(base), dtype="fp32", adapter=str(adapter))
    by_hand, merged = merged_by_hand(base, adapter, processor)
    assert tuned.adapter == str(adapter)
    assert len(merged) == 3 * plain.text_config.num_hidden_layers  # q, v, down in every layer, nothing else
    assert all("language_model" in m for m in merged)

    enc = plain.encode(CONV, [random_image(1)])
    ids = enc.input_ids[None]
    f_plain = plain.features(ids, None, enc.pixel)
    f_tuned = tuned.features(ids, None, enc.pixel)
    f_hand = by_hand.features(ids, None, enc.pixel)

    # The adapter touches the language model only: inputs (text and visual) are unchanged...
    assert torch.equal(f_tuned.inputs_embeds, f_plain.inputs_embeds)
    # ...the features move, and exactly where the hand-merged weights put them.
    assert (f_tuned.hidden_states - f_plain.hidden_states).abs().max() > 1e-2
    torch.testing.assert_close(f_tuned.hidden_states, f_hand.hidden_states, rtol=1e-6, atol=1e-6)
    for name, p in by_hand.model.named_parameters():
        torch.testing.assert_close(tuned.model.get_parameter(name), p, rtol=0, atol=1e-7, msg=name)
