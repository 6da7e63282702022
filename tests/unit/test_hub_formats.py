"""The head-format registry (msd_train/hub/formats.py), scripts/export.py dispatching
through it, and the EAGLE-3 export as SGLang reads it."""

import json
import sys
from pathlib import Path

import pytest
import torch
from builders.heads import msd3_head, msd_head, released_head
from safetensors.torch import load_file

from msd_train.draft import MSD3DraftModel, MSDDraftConfig, MSDDraftModel
from msd_train.hub import HeadFormat, detect_layout, formats, load_head
from msd_train.hub.eagle3 import export_eagle3, import_eagle3, same_tensors

ROOT = Path(__file__).resolve().parents[2]
H, INTER, HEADS, KV, VOCAB, DRAFT_VOCAB = 32, 64, 4, 2, 40, 16


def run_export(args, monkeypatch):
    """scripts/export.py in-process, with the command line a user types (Hydra reads sys.argv)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("export", ROOT / "scripts" / "export.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", ["export.py", *args])
    module.main()


# --- the registry -----------------------------------------------------------------------------


def test_registry_lists_the_formats_and_each_folder_is_detected_as_its_own(tmp_path):
    assert formats.names()[:3] == ["msd", "reference", "eagle3"]
    assert formats.get("eagle3").heads == ("msd3",) and formats.get("reference").heads == ("msd",)
    assert formats.get("msd").heads is None and all(formats.get("msd").holds(a) for a in ("msd", "msd3"))

    msd_head().save_pretrained(tmp_path / "msd")
    released_head(tmp_path / "reference", "qwen2_vl", "safetensors")
    export_eagle3(msd3_head(), tmp_path / "eagle3")
    for name in ("msd", "reference", "eagle3"):
        config = json.loads((tmp_path / name / "config.json").read_text())
        assert [f.name for f in formats.FORMATS.values() if f.detect(config)] == [name]
        assert detect_layout(tmp_path / name) == name
    # vLLM's speculators layout names an Eagle3 architecture too, but is not this one
    speculators = {"architectures": ["Eagle3Speculator"], "speculators_config": {"algorithm": "eagle3"}}
    assert not formats.get("eagle3").detect(speculators)


def test_a_registered_format_is_detected_and_a_write_only_one_is_not_loaded(tmp_path, monkeypatch):
    """Adding a format is one register call: detect_layout, load_head and the export
    script's list of names all see it."""
    def write(head, out, **options):
        Path(out).mkdir(parents=True)
        (Path(out) / "config.json").write_text(json.dumps({"architectures": ["SomeEngineDraft"]}))
        return {"out": str(out)}

    fmt = HeadFormat(name="someengine", heads=("msd3",), write=write, describe="architectures ['SomeEngineDraft']",
                     detect=lambda config: config.get("architectures") == ["SomeEngineDraft"])
    monkeypatch.setitem(formats.FORMATS, fmt.name, fmt)
    assert fmt.export(msd3_head(), tmp_path / "x") == {"format": "someengine", "out": str(tmp_path / "x")}
    assert detect_layout(tmp_path / "x") == "someengine"
    with pytest.raises(ValueError, match="someengine format is written for another engine"):
        load_head(tmp_path / "x")
    with pytest.raises(ValueError, match=f"use one of {', '.join(formats.names())}"):
        formats.get("vlm")
    with pytest.raises(ValueError, match="already registered"):
        formats.register(fmt)


def test_the_docs_formats_table_is_the_registry():
    """docs/hub.md's table: one row per registered format, its heads and options as registered."""
    lines = (ROOT / "docs" / "hub.md").read_text().splitlines()
    start = lines.index("| `format=` | heads | the folder | options |") + 2  # past the header and |---|
    rows = [line.split("|")[1:-1] for line in lines[start:lines.index("", start)]]
    table = {r[0].strip(" `"): ([h.strip() for h in r[1].split(",")], [o.strip(" `") for o in r[3].split(",")])
             for r in rows}
    from msd_train.draft import HEADS

    heads = {f.name: sorted(HEADS) if f.heads is None else list(f.heads) for f in formats.FORMATS.values()}
    assert table == {f.name: (heads[f.name], list(f.options)) for f in formats.FORMATS.values()}

# --- scripts/export.py ------------------------------------------------------------------------


def test_export_script_eagle3_writes_a_folder_that_imports_back_bit_exactly(tmp_path, monkeypatch, capsys):
    head = msd3_head()
    head.save_pretrained(tmp_path / "run" / "stage2" / "final")
    run_export([f"checkpoint={tmp_path}/run/stage2/final", "format=eagle3", f"out={tmp_path}/eagle3"], monkeypatch)
    summary = json.loads(capsys.readouterr().out)
    assert summary["format"] == "eagle3" and summary["warnings"] == []
    assert sorted(p.name for p in (tmp_path / "eagle3").iterdir()) == ["config.json", "model.safetensors"]
    back = load_head(tmp_path / "eagle3")
    assert isinstance(back, MSD3DraftModel) and same_tensors(back.state_dict(), head.state_dict())
    assert back.config.feature_layers == head.config.feature_layers
    assert back.config.decouple_visual == head.config.decouple_visual

    # and back into this project's folder, through the registry's eagle3 loader
    run_export([f"checkpoint={tmp_path}/eagle3", "format=msd", f"out={tmp_path}/ours"], monkeypatch)
    assert same_tensors(MSD3DraftModel.from_pretrained(tmp_path / "ours").state_dict(), head.state_dict())


def test_export_script_refuses_an_unknown_format_a_wrong_head_and_a_foreign_option(tmp_path, monkeypatch, capsys):
    msd_head().save_pretrained(tmp_path / "msd")
    msd3_head().save_pretrained(tmp_path / "msd3")
    cases = [
        (["checkpoint=msd", "format=onnx"], "format=onnx: no such head format; use one of msd, reference, eagle3, vllm"),
        (["checkpoint=msd", "format=eagle3"],
         "format=eagle3 holds msd3 heads; msd is an msd head (use format=msd or format=reference or format=vllm)"),
        (["checkpoint=msd3", "format=reference", "embed_from=msd"],
         "format=reference holds msd heads; msd3 is an msd3 head (use format=msd or format=eagle3 or format=vllm)"),
        (["checkpoint=msd3", "format=eagle3", "weights=bin"], "format=eagle3 takes no weights= (it takes dtype=)"),
    ]
    monkeypatch.chdir(tmp_path)
    for args, message in cases:
        with pytest.raises(SystemExit, match="1"):
            run_export([*args, "out=out"], monkeypatch)
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


# --- SGLang's LlamaForCausalLMEagle3 ------------------------------------------------------------
#
# Read in sgl-project/sglang, python/sglang/srt/models/llama_eagle3.py (and, for the layer
# ids, model_runner.py and models/llama.py); listed here, not copied:
# * LlamaModel builds `fc` as Linear(3 * target_hidden_size (else hidden_size), hidden_size,
#   bias=config.bias, default false), one `midlayer` whose q/k/v take 2 * hidden_size with no
#   bias, the norms `input_layernorm` (on the embeddings), `hidden_norm` (on the hidden
#   states), `post_attention_layernorm`, and a final `norm`; `embed_tokens` is the target's.
# * LlamaForCausalLMEagle3 reads config.draft_vocab_size (None: lm_head taken from the target)
#   and config.tie_word_embeddings (true: lm_head = embed_tokens), and enables M-RoPE (the
#   target's mrope positions) when rope_scaling names "mrope_section".
# * load_weights: a name containing "d2t" becomes hot_token_id = d2t + arange; "t2d" is
#   skipped; q/k/v_proj are stacked into qkv_proj and gate/up_proj into gate_up_proj; every
#   other name is looked up as is or under "model."; a name that matches no parameter is
#   dropped without a word (so every tensor we write must match one).
# * model_runner reads the draft config's eagle_config["eagle_aux_hidden_state_layer_ids"] and
#   passes it to the target's set_eagle3_layers_to_capture, which captures layer id + 1's input
#   (layer id's output); with no ids it captures the inputs of layers 2, N/2, N-3.

SGLANG_PARAMS = {
    "model.fc.weight", "model.midlayer.self_attn.qkv_proj.weight", "model.midlayer.self_attn.o_proj.weight",
    "model.midlayer.mlp.gate_up_proj.weight", "model.midlayer.mlp.down_proj.weight",
    "model.midlayer.input_layernorm.weight", "model.midlayer.hidden_norm.weight",
    "model.midlayer.post_attention_layernorm.weight", "model.norm.weight", "lm_head.weight",
}
SGLANG_STACKED = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj",
                  ".gate_proj": ".gate_up_proj", ".up_proj": ".gate_up_proj"}


def sglang_name(key: str) -> str:
    for shard, stacked in SGLANG_STACKED.items():
        key = key.replace(shard, stacked)
    return key if key == "lm_head.weight" else f"model.{key}"


def test_eagle3_export_is_what_sglang_loads(tmp_path):
    head = msd3_head()
    summary = export_eagle3(head, tmp_path / "e")
    config = json.loads((tmp_path / "e" / "config.json").read_text())
    state = load_file(tmp_path / "e" / "model.safetensors")

    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert config["draft_vocab_size"] == DRAFT_VOCAB == state["lm_head.weight"].shape[0]
    assert config["vocab_size"] == VOCAB
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "hidden_act", "max_position_embeddings", "rope_theta"):
        assert config[key] is not None, key
    assert not config.get("bias", False) and config.get("target_hidden_size", H) == H

    # every tensor fills an SGLang parameter (none dropped), and every parameter but the
    # target's embedding is filled
    weights = {k for k in state if k not in ("d2t", "t2d")}
    assert {sglang_name(k) for k in weights} == SGLANG_PARAMS
    assert state["fc.weight"].shape == (H, 3 * H)
    assert all(state[f"midlayer.self_attn.{p}_proj.weight"].shape[1] == 2 * H for p in "qkv")
    assert state["d2t"].dtype == torch.int64 and torch.equal(state["d2t"] + torch.arange(DRAFT_VOCAB), head.draft_ids)

    # SGLang captures the output of each named layer: the head reads the inputs of the next ones
    ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert [i + 1 for i in ids] == head.config.feature_layers == [2, 4, 5]
    assert config["rope_scaling"] is None and summary["warnings"] == []


def test_eagle3_export_of_a_qwen_head_says_what_sglang_does_differently(tmp_path):
    """M-RoPE sections are written only for a head that drafts with the target's M-RoPE
    ids (SGLang switches to those whenever they are named); the q/k/v bias SGLang's layer
    lacks and a fused-layer count other than 3 are warnings, not silent."""
    for positions, sections in (("mrope", [2, 1, 1]), ("1d", None)):
        head = msd3_head(layer_family="qwen2", mrope_section=[2, 1, 1], draft_positions=positions)
        summary = export_eagle3(head, tmp_path / positions)
        config = json.loads((tmp_path / positions / "config.json").read_text())
        assert (config["rope_scaling"] or {}).get("mrope_section") == sections
        assert any("no q/k/v bias" in w for w in summary["warnings"])
        back = import_eagle3(tmp_path / positions)
        assert back.config.mrope_section == [2, 1, 1] and back.config.draft_positions == positions
        assert same_tensors(back.state_dict(), head.state_dict())

    summary = export_eagle3(msd3_head(feature_layers=[3, 6]), tmp_path / "two")
    assert any("fuses 2 target layers" in w and "SGLang will not load this fc.weight" in w for w in summary["warnings"])


def test_every_format_keeps_or_refuses_visual_compression(tmp_path):
    """A compressing head exports to msd and eagle3 with the setting kept (eagle3
    in its "msd" block, with a warning that SGLang drafts over whole images); reference and
    vllm refuse it, naming the setting and format=msd."""
    head3 = msd3_head(visual_compression="pool", visual_compression_tokens=8)
    for name in ("msd", "eagle3"):
        summary = formats.get(name).export(head3, tmp_path / name)
        back = load_head(tmp_path / name)
        assert (back.config.visual_compression, back.config.visual_compression_tokens) == ("pool", 8)
        assert same_tensors(back.state_dict(), head3.state_dict())
    assert any("SGLang drafts over every visual token" in w for w in summary["warnings"])
    head = MSDDraftModel(MSDDraftConfig(hidden_size=H, intermediate_size=2 * H, num_attention_heads=4,
                                        visual_compression="pool", visual_compression_tokens=8))
    with pytest.raises(ValueError, match=r"format=reference cannot keep .*visual_compression=pool.*format=msd keeps"):
        formats.get("reference").export(head, tmp_path / "reference", embed_from=tmp_path)
    with pytest.raises(ValueError, match=r"format=vllm cannot serve .*visual_compression=pool.*format=msd keeps"):
        formats.get("vllm").export(head, tmp_path / "vllm")


def test_eagle3_layer_ids_of_third_party_and_older_exports(tmp_path):
    head = msd3_head()
    export_eagle3(head, tmp_path / "e")
    path = tmp_path / "e" / "config.json"
    config = json.loads(path.read_text())

    # a SpecForge head names SGLang's ids and has no "msd" block: it reads layers ids + 1
    del config["msd"]
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 3, 6]
    path.write_text(json.dumps(config))
    assert import_eagle3(tmp_path / "e").config.feature_layers == [2, 4, 7]

    # an export of ours from before the ids were written SGLang's way: "msd" block without
    # feature_layers, ids that already are the layers read
    config["msd"] = {"target_num_layers": 8}
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]
    path.write_text(json.dumps(config))
    assert import_eagle3(tmp_path / "e").config.feature_layers == [2, 4, 5]
