"""PEFT targets: `load_target(adapter=...)` merges a LoRA adapter exactly as W + B @ A * scale."""


import torch
from builders import CONV, merged_by_hand, random_image

from msd_train.targets import load_target


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
