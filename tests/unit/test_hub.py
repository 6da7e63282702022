"""Shipping heads: import of released heads, export both ways, load_head, push."""

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from builders.heads import KV_HEADS, released_head
from safetensors.torch import load_file, save_file

from msd_train.draft import MSDDraftConfig, MSDDraftModel
from msd_train.hub import (
    IncompleteHeadError,
    TargetInfo,
    VocabMap,
    check_embedding,
    export_msd,
    export_reference,
    import_reference,
    load_head,
    plan_push,
    push_head,
)
from msd_train.hub import folders as hub_folders
from msd_train.trust import UnsafeFileError

ROOT = Path(__file__).resolve().parents[2]
H, INTER, HEADS, VOCAB = 32, 64, 4, 40
TOKEN = "hf_NeverPrintThisToken0123456789"


# --- a released head at tiny size, written the way the published ones are laid out --------------


def released_weights(folder: Path) -> dict:
    if (folder / "model.safetensors").is_file():
        return load_file(folder / "model.safetensors")
    return torch.load(folder / "pytorch_model.bin", weights_only=True)


# --- the released head's forward, written out from the raw tensors ------------------------------


def rms_norm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, theta):
    """Rotary embedding at positions 0..T-1 (halves rotated, the Llama weight layout)."""
    T, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


def by_hand(t: dict, config: dict, e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """fc(cat(e, h)), then one decoder layer, in float64 from the released tensors."""
    t = {k: v.double() for k, v in t.items()}
    e, h = e.double(), h.double()
    eps, theta = config["rms_norm_eps"], config["rope_theta"]
    kv, d = config["num_key_value_heads"], H // HEADS
    B, T, _ = e.shape
    x = torch.cat([e, h], -1) @ t["fc.weight"].T + t["fc.bias"]
    a = rms_norm(x, t["layers.0.input_layernorm.weight"], eps) if config["model_type"] == "qwen2_vl" else x

    def proj(name, heads):
        y = a @ t[f"layers.0.self_attn.{name}.weight"].T
        if f"layers.0.self_attn.{name}.bias" in t:
            y = y + t[f"layers.0.self_attn.{name}.bias"]
        return y.view(B, T, heads, d).transpose(1, 2)

    q, k, v = rope(proj("q_proj", HEADS), theta), rope(proj("k_proj", kv), theta), proj("v_proj", kv)
    k, v = k.repeat_interleave(HEADS // kv, 1), v.repeat_interleave(HEADS // kv, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, HEADS * d)
    x = x + attn @ t["layers.0.self_attn.o_proj.weight"].T
    n = rms_norm(x, t["layers.0.post_attention_layernorm.weight"], eps)
    mlp = (torch.nn.functional.silu(n @ t["layers.0.mlp.gate_proj.weight"].T) * (n @ t["layers.0.mlp.up_proj.weight"].T))
    return x + mlp @ t["layers.0.mlp.down_proj.weight"].T


def inputs(seed=3, B=2, T=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, H, generator=g), torch.randn(B, T, H, generator=g)


# --- import ------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["llava", "qwen2_vl"])
@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_import_matches_hand_computation(tmp_path, model_type, fmt):
    src, out = tmp_path / "released", tmp_path / "ours"
    raw = released_head(src, model_type, fmt)
    config = json.loads((src / "config.json").read_text())
    report = import_reference(src, out)

    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "reference_import.json"]
    head = MSDDraftModel.from_pretrained(out).eval()
    c = head.config
    qwen = model_type == "qwen2_vl"
    assert c.layer_family == ("qwen2" if qwen else "llama")
    assert c.first_layer_input_norm is qwen
    assert c.fc_bias and c.decouple_visual and c.visual_offset == "released"
    assert c.mrope_section == ([2, 1, 1] if qwen else None)
    assert c.num_key_value_heads == KV_HEADS[model_type] and c.rms_norm_eps == config["rms_norm_eps"]
    stored = load_file(out / "model.safetensors")
    assert "embed_tokens.weight" not in stored  # the head uses the target's table
    assert set(stored) == set(raw) - {"embed_tokens.weight"}
    for k, v in stored.items():
        assert torch.equal(v, raw[k]), k
    assert report.embed_rows == VOCAB and report.embedding is None  # no target given

    e, h = inputs()
    expected = by_hand(raw, config, e, h)
    with torch.no_grad():
        got = head(e, h).last_hidden_state
        on_the_fly = load_head(src)(e, h).last_hidden_state  # converted in memory
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(on_the_fly, got)
    # fc and the attention projections, checked one by one
    x = torch.cat([e, h], -1) @ raw["fc.weight"].T + raw["fc.bias"]
    torch.testing.assert_close(head.fuse(e, h), x)
    for p in "qkvo":
        torch.testing.assert_close(getattr(head.layers[0].self_attn, f"{p}_proj").weight,
                                   raw[f"layers.0.self_attn.{p}_proj.weight"], rtol=0, atol=0)


def test_llava_first_layer_norm_is_dropped(tmp_path):
    """The released LLaVA code keeps layers.0.input_layernorm but never applies it."""
    extra = {"layers.0.input_layernorm.weight": torch.full((H,), 3.0)}
    raw = released_head(tmp_path / "src", "llava", "safetensors", extra=extra)
    report = import_reference(tmp_path / "src", tmp_path / "out")
    assert report.dropped_keys == ["layers.0.input_layernorm.weight"]
    head = MSDDraftModel.from_pretrained(tmp_path / "out")
    e, h = inputs()
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    torch.testing.assert_close(head(e, h).last_hidden_state.double(), by_hand(raw, config, e, h), rtol=1e-5, atol=1e-5)


def test_bin_is_never_unpickled(tmp_path):
    """pytorch_model.bin goes through torch.load(weights_only=True): a pickled object is refused."""
    released_head(tmp_path, "llava", "bin")
    state = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    state["payload"] = Path("/etc/passwd")  # any non-tensor class
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(UnsafeFileError, match=r"pytorch_model.bin: .*\(Unsupported global: GLOBAL pathlib.PosixPath"
                                              r" was not an allowed global by default\).*weights_only=True"):
        import_reference(tmp_path, tmp_path / "out")


@pytest.mark.parametrize("marks", [
    {"architectures": ["DFlashDraftModel"], "dflash_config": {"mask_token_id": 5, "target_layer_ids": [1]},
     "block_size": 16},  # z-lab's layout (model_type stays the draft layers' family)
    {"architectures": ["DFlashDraftModel"]},
])
def test_a_block_draft_is_not_imported_as_a_released_head(tmp_path, marks):
    """A DFlash checkpoint has fc.weight and Llama/Qwen layer names like a released MSD head:
    it is refused by what its config says, before any weight is read."""
    released_head(tmp_path / "dflash", "llava", "safetensors")
    config = json.loads((tmp_path / "dflash" / "config.json").read_text())
    (tmp_path / "dflash" / "config.json").write_text(json.dumps({**config, **marks}))
    with pytest.raises(IncompleteHeadError, match=r"config.json describes a DFlash block draft .*train one with "
                                                  r"head=dflash"):
        import_reference(tmp_path / "dflash", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_import_refuses_incomplete_heads(tmp_path):
    raw = released_head(tmp_path / "a", "qwen2_vl", "safetensors")
    del raw["layers.0.input_layernorm.weight"]
    save_file(raw, tmp_path / "a" / "model.safetensors")
    with pytest.raises(IncompleteHeadError, match="input_layernorm"):
        import_reference(tmp_path / "a", tmp_path / "out")
    raw = released_head(tmp_path / "b", "llava", "safetensors")
    del raw["layers.0.mlp.up_proj.weight"]
    save_file(raw, tmp_path / "b" / "model.safetensors")
    with pytest.raises(IncompleteHeadError, match="up_proj"):
        import_reference(tmp_path / "b", tmp_path / "out")
    (tmp_path / "c").mkdir()
    with pytest.raises(IncompleteHeadError, match="config.json"):
        import_reference(tmp_path / "c", tmp_path / "out")


def test_import_ignores_rope_buffers_but_refuses_unknown_missing_and_misshapen_weights(tmp_path, capsys, monkeypatch):
    """Heads saved by older transformers / EAGLE code carry `rotary_emb.inv_freq`: the
    released loader ignores it (strict=False); so does the importer, with a printed note.
    Anything that is a weight and does not fit is still refused."""
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, H // HEADS, 2).float() / (H // HEADS))
    raw = released_head(tmp_path / "buf", "llava", "bin",
                        extra={"layers.0.self_attn.rotary_emb.inv_freq": inv_freq})
    _run_script("import_reference", [f"src={tmp_path}/buf", f"out={tmp_path}/ours"], monkeypatch)
    printed = capsys.readouterr().out
    assert "layers.0.self_attn.rotary_emb.inv_freq ignored" in printed and "equals config.json" in printed
    stored = load_file(tmp_path / "ours" / "model.safetensors")
    assert set(stored) == set(raw) - {"embed_tokens.weight", "layers.0.self_attn.rotary_emb.inv_freq"}
    e, h = inputs()
    config = json.loads((tmp_path / "buf" / "config.json").read_text())
    with torch.no_grad():
        got = load_head(tmp_path / "buf")(e, h).last_hidden_state  # on the fly too
    torch.testing.assert_close(got.double(), by_hand(raw, config, e, h), rtol=1e-5, atol=1e-5)

    # A buffer that disagrees with config.json's rope_theta is imported with a warning in the notes.
    report = import_reference(*_with_extra(tmp_path, "theta", {"layers.0.self_attn.rotary_emb.inv_freq": inv_freq * 2}))
    assert any("WARNING" in n and "rotary_emb.inv_freq" in n for n in report.notes)
    # An unknown weight, a wrong shape: refused as before.
    with pytest.raises(IncompleteHeadError, match=r"unexpected: \['layers.0.self_attn.gate.weight'\]"):
        import_reference(*_with_extra(tmp_path, "unknown", {"layers.0.self_attn.gate.weight": torch.zeros(H, H)}))
    with pytest.raises(IncompleteHeadError, match=r"shapes do not match(.|\n)*fc.weight"):
        import_reference(*_with_extra(tmp_path, "shape", {"fc.weight": torch.zeros(H, 2 * H + 1)}))


def _with_extra(tmp_path: Path, name: str, extra: dict) -> tuple[Path, Path]:
    released_head(tmp_path / name, "llava", "safetensors", extra=extra)
    return tmp_path / name, tmp_path / f"{name}-out"


def test_qwen_head_without_mrope_sections_takes_the_targets(tmp_path):
    """A Qwen2-VL head whose config.json names no M-RoPE sections gets the target's, since
    this project feeds Qwen2-VL heads the target's M-RoPE position ids."""
    from builders import tiny_qwen2vl_target

    target = tiny_qwen2vl_target()
    released_head(tmp_path / "src", "qwen2_vl", "safetensors", embed=target.embed_tokens.weight.detach())
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    config["rope_scaling"] = None
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    report = import_reference(tmp_path / "src", tmp_path / "out", target=TargetInfo.of(target))
    assert report.embedding.ok and report.config["mrope_section"] == [2, 1, 1]
    assert any("names no M-RoPE sections" in n for n in report.notes)
    head = load_head(tmp_path / "out", target=target)
    pos = torch.arange(5)[None, None].expand(3, 1, 5)
    assert head(*inputs(B=1, T=5), position_ids=pos).last_hidden_state.shape == (1, 5, H)


# --- vocabulary -------------------------------------------------------------------------------


@pytest.mark.slow
def test_vocab_mapping_row_by_row():
    """Original LLaVA (32000) <-> llava-hf (32064: <image>, <pad>, padding appended)."""
    vmap = VocabMap(32000, 32064)
    g = torch.Generator().manual_seed(0)
    released = torch.randn(32000, 4, generator=g)
    target = torch.randn(32064, 4, generator=g)
    target[:32000] = released
    mapped = vmap.rows_to_target(released, fill=target)
    back = vmap.rows_to_released(target)
    ids = torch.arange(32000)
    assert torch.equal(vmap.ids_to_target(ids), ids) and torch.equal(vmap.ids_to_released(ids), ids)
    for i in range(32000):  # every shared id: same row on both sides, both ways
        j = int(vmap.ids_to_target(torch.tensor(i)))
        assert j == i and torch.equal(mapped[j], released[i]) and torch.equal(back[i], target[j]), i
    for i in range(32000, 32064):  # appended ids have no released row: the target's own is kept
        assert torch.equal(mapped[i], target[i])
        with pytest.raises(ValueError, match="no counterpart"):
            vmap.ids_to_released(torch.tensor([i]))
        assert int(vmap.ids_to_released(torch.tensor([i]), missing=0)[0]) == 0
    assert torch.equal(vmap.rows_to_target(released)[32000:], torch.zeros(64, 4))
    with pytest.raises(ValueError, match="outside"):
        vmap.ids_to_target(torch.tensor([32000]))

    assert check_embedding(released, target).ok
    # a fp16 head against a target loaded in bf16 from the same fp16 weights: compared on the bf16 grid
    assert check_embedding(released.half(), target.half().bfloat16()).ok
    target[123, 2] += 1.0
    check = check_embedding(released, target)
    assert not check.ok and check.mismatched_rows == 1 and "1 of 32000" in check.message()


def test_import_checks_embedding_against_target(tmp_path, caplog):
    from builders import tiny_llava_target

    target = tiny_llava_target()
    table = target.embed_tokens.weight.detach()
    rows = table.shape[0] - 3  # as if the target had appended three tokens
    released_head(tmp_path / "good", "llava", "safetensors", embed=table[:rows])
    report = import_reference(tmp_path / "good", tmp_path / "out", target=TargetInfo.of(target))
    assert report.embedding.ok and report.embedding.compared_rows == rows
    head = load_head(tmp_path / "out", target=target)
    assert head.config.target_name_or_path == target.name and head.config.target_vocab_size == table.shape[0]
    record = json.loads((tmp_path / "out" / "reference_import.json").read_text())
    assert record["embedding_check"]["ok"] and record["embed_tokens"]["rows"] == rows

    wrong = table[:rows].clone()
    wrong[5] += 1
    released_head(tmp_path / "bad", "llava", "safetensors", embed=wrong)
    with caplog.at_level("WARNING"):
        report = import_reference(tmp_path / "bad", tmp_path / "out2", target=TargetInfo.of(target))
    assert not report.embedding.ok and report.embedding.mismatched_rows == 1
    assert "differ from the target" in caplog.text
    with caplog.at_level("WARNING"):
        load_head(tmp_path / "bad", target=target)  # on the fly: the same check
    assert caplog.text.count("differ from the target") == 2


# --- export -----------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type,fmt", [("llava", "bin"), ("qwen2_vl", "safetensors")])
def test_reference_round_trip_is_bit_exact(tmp_path, model_type, fmt):
    src = tmp_path / "released"
    raw = released_head(src, model_type, fmt, dtype=torch.float16)
    import_reference(src, tmp_path / "ours")
    ours = MSDDraftModel.from_pretrained(tmp_path / "ours")
    assert ours.dtype == torch.float16
    on_the_fly = load_head(src)  # the same head, rotary buffers included
    assert on_the_fly.rotary_emb.inv_freq.dtype == ours.rotary_emb.inv_freq.dtype == torch.float32
    e, h = inputs()
    with torch.no_grad():
        assert torch.equal(on_the_fly(e.half(), h.half()).last_hidden_state, ours(e.half(), h.half()).last_hidden_state)

    summary = export_reference(tmp_path / "ours", tmp_path / "back")  # embed_tokens from the recorded source
    weights = "pytorch_model.bin" if fmt == "bin" else "model.safetensors"
    assert sorted(p.name for p in (tmp_path / "back").iterdir()) == ["config.json", weights]
    back = released_weights(tmp_path / "back")
    assert set(back) == set(raw)
    for k in raw:
        assert back[k].dtype == raw[k].dtype and torch.equal(back[k], raw[k]), k
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    assert summary["warnings"] == []

    # The same with the embedding named explicitly, after the source moved away.
    shutil.move(src, tmp_path / "moved")
    with pytest.raises(FileNotFoundError, match="embed_from"):
        export_reference(tmp_path / "ours", tmp_path / "back2")
    export_reference(tmp_path / "ours", tmp_path / "back2", embed_from=tmp_path / "moved", weights="safetensors")
    back2 = load_file(tmp_path / "back2" / "model.safetensors")
    assert all(torch.equal(back2[k], raw[k]) for k in raw)
    # embed_from wins over target=: the target's table (a 7B shard download) is never read.
    def unread():
        raise AssertionError("the target's embedding was read although embed_from names one")

    hidden = json.loads((tmp_path / "moved" / "config.json").read_text())["hidden_size"]
    target = TargetInfo("some/target", model_type, VOCAB, hidden, read_embedding=unread)
    summary = export_reference(tmp_path / "ours", tmp_path / "back3", target=target, embed_from=tmp_path / "moved")
    assert summary["embed_tokens_from"] == str(tmp_path / "moved")


def test_trained_head_exports_to_reference_with_target_embedding(tmp_path):
    """A head trained here (no embedding stored) -> released layout, embed_tokens from the target."""
    from builders import tiny_llava

    model, processor = tiny_llava()
    model.save_pretrained(tmp_path / "target")
    processor.save_pretrained(tmp_path / "target")
    torch.manual_seed(0)
    head = MSDDraftModel(MSDDraftConfig.from_target_config(model.config, str(tmp_path / "target")))
    head.save_pretrained(tmp_path / "final")
    (tmp_path / "final" / "training.json").write_text(json.dumps({"stage": 2, "step": 5, "command": "x", "config": {}}))

    with pytest.raises(ValueError, match="target="):
        export_reference(tmp_path / "final", tmp_path / "ref")
    summary = export_reference(tmp_path / "final", tmp_path / "ref", target=TargetInfo.from_files(tmp_path / "target"))
    table = model.get_input_embeddings().weight.detach()
    ref = load_file(tmp_path / "ref" / "model.safetensors")
    assert torch.equal(ref["embed_tokens.weight"], table[: ref["embed_tokens.weight"].shape[0]])
    assert summary["embed_rows"] == processor.tokenizer.vocab_size
    config = json.loads((tmp_path / "ref" / "config.json").read_text())
    assert config["model_type"] == "llava" and config["vocab_size"] == summary["embed_rows"] and config["bias"]

    # ...and back: the imported head computes exactly what the original does.
    import_reference(tmp_path / "ref", tmp_path / "again", target=TargetInfo.from_files(tmp_path / "target"))
    again = MSDDraftModel.from_pretrained(tmp_path / "again")
    e, h = inputs()
    assert torch.equal(again(e, h).last_hidden_state, head(e, h).last_hidden_state)
    assert again.config.target_name_or_path == str(tmp_path / "target")


def test_export_msd_casts_and_keeps_records(tmp_path):
    released_head(tmp_path / "src", "qwen2_vl", "bin")
    summary = export_msd(tmp_path / "src", tmp_path / "ours")  # a released folder is imported
    assert "reference_import.json" in summary["files"]
    (tmp_path / "ours" / "training.json").write_text("{}")
    export_msd(tmp_path / "ours", tmp_path / "bf16", dtype="bf16")
    head = MSDDraftModel.from_pretrained(tmp_path / "bf16")  # one call
    assert head.dtype == torch.bfloat16
    assert {"training.json", "reference_import.json"} <= {p.name for p in (tmp_path / "bf16").iterdir()}


def test_export_refuses_what_the_released_layout_cannot_express(tmp_path):
    config = MSDDraftConfig(hidden_size=H, intermediate_size=INTER, num_attention_heads=HEADS,
                            first_layer_input_norm=True)
    MSDDraftModel(config).save_pretrained(tmp_path / "head")
    with pytest.raises(ValueError, match="first_layer_input_norm"):
        export_reference(tmp_path / "head", tmp_path / "ref", embed_from=tmp_path)


# --- load_head --------------------------------------------------------------------------------


def test_load_head_from_hub_repo_id(tmp_path, monkeypatch):
    released_head(tmp_path / "snap", "llava", "bin")
    calls = []

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None):
        calls.append((repo_id, revision, allow_patterns))
        return str(tmp_path / "snap")

    monkeypatch.setattr("huggingface_hub.snapshot_download", fake_snapshot_download)
    head = load_head("lucylyn/MSD-LLaVA1.5-7B")
    assert calls == [("lucylyn/MSD-LLaVA1.5-7B", None, hub_folders.HEAD_FILE_PATTERNS)]
    assert head.config.layer_family == "llama" and head.config.visual_offset == "released"
    with pytest.raises(FileNotFoundError, match="no such folder"):
        load_head(str(tmp_path / "nowhere" / "x" / "y"))


def test_load_head_fits_target(tmp_path):
    from builders import tiny_llava_target

    llava_target = tiny_llava_target()
    head = MSDDraftModel(MSDDraftConfig.from_target_config(llava_target.config, llava_target.name))
    head.save_pretrained(tmp_path / "ok")
    loaded = load_head(tmp_path / "ok", target=llava_target)
    assert loaded.dtype == llava_target.dtype and not loaded.training
    llava_target.model.to(torch.bfloat16)  # a bf16 target: the head follows, its RoPE frequencies stay fp32
    loaded = load_head(tmp_path / "ok", target=llava_target)
    assert loaded.dtype == torch.bfloat16 and loaded.rotary_emb.inv_freq.dtype == torch.float32
    MSDDraftModel(MSDDraftConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2)).save_pretrained(
        tmp_path / "narrow")
    with pytest.raises(ValueError, match="hidden size 16"):
        load_head(tmp_path / "narrow", target=llava_target)


# --- push -------------------------------------------------------------------------------------


class RecordingHub:
    """Stands in for huggingface_hub.HfApi: records calls and what the folder held."""

    def __init__(self, fail_with: Exception | None = None):
        self.calls, self.uploaded, self.fail_with = [], {}, fail_with

    def create_repo(self, **kwargs):
        self.calls.append(("create_repo", kwargs))
        return f"https://huggingface.co/{kwargs['repo_id']}"

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", kwargs))
        if self.fail_with:
            raise self.fail_with
        folder = Path(kwargs["folder_path"])
        self.uploaded = {p.name: p.read_bytes() for p in folder.iterdir()}
        return None


REPORT = {
    "draft": None,
    "command": "python eval.py draft=runs/x/stage2/final out=runs/x/stage2/eval bench=tiny",
    "device": "NVIDIA H100 80GB HBM3",
    "decoding": {"mode": "tree", "depth": 5, "top_k": 10, "total_tokens": 60, "temperature": 0.0},
    "overall": {"tau": 3.4567, "accept_at_pos": [0.8, 0.6, 0.5], "tokens_per_s": 101.25, "ar_tokens_per_s": 45.0,
                "speedup": 2.25, "outputs_match_ar": True, "n_samples": 12, "new_tokens": 1536},
    "per_category": {"coco": {"tau": 3.9, "speedup": 2.5, "tokens_per_s": 110.0, "ar_tokens_per_s": 44.0,
                              "outputs_match_ar": True, "n_samples": 6, "new_tokens": 700,
                              "accept_at_pos": [0.9, None], "accept_trials": [120, 0]}},
}


def trained_export(run: Path, adapter: str | None = None) -> Path:
    """RUN/stage1/final and RUN/stage2/final as the trainer writes them."""
    for stage in (1, 2):
        final = run / f"stage{stage}" / "final"
        config = MSDDraftConfig(hidden_size=H, intermediate_size=INTER, num_attention_heads=HEADS,
                                target_name_or_path="llava-hf/llava-1.5-7b-hf", target_vocab_size=32064,
                                target_adapter=adapter)
        MSDDraftModel(config).save_pretrained(final)
        curriculum = ({"start": 0.0, "end": 0.0, "ramp_steps": 0, "schedule": "linear"} if stage == 1 else
                      {"start": 0.0, "end": 0.5, "ramp_steps": 100, "schedule": "linear"})
        data = {"text": [{"path": "/data/ShareGPT_V3_unfiltered_cleaned_split.json"}],
                "multimodal": [{"path": "/data/llava_v1_5_mix665k.json", "image_root": "/data/images"}]}
        meta = {"stage": stage, "step": 300 * stage, "command": f"deepspeed train.py stage={stage} run_dir={run}",
                "config": {"run_dir": str(run), "stage": {"id": stage, "init_from": None, "curriculum": curriculum},
                           "data": data, "train": {"max_steps": 300, "lr": 5e-05, "micro_batch_size": 2}}}
        (final / "training.json").write_text(json.dumps(meta))
    return run / "stage2" / "final"


def test_push_uploads_folder_and_card(tmp_path, capsys):
    adapter = tmp_path / "lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                                                            "target_modules": ["v_proj", "q_proj"]}))
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    final = trained_export(tmp_path / "run", adapter=str(adapter))
    (final.parent / "eval").mkdir()
    (final.parent / "eval" / "report.json").write_text(json.dumps({**REPORT, "draft": str(final)}))
    hub = RecordingHub()
    push_head(final, "me/msd-tiny", private=True, token=TOKEN, client=hub)

    assert [c[0] for c in hub.calls] == ["create_repo", "upload_folder"]
    assert hub.calls[0][1] == {"repo_id": "me/msd-tiny", "private": True, "exist_ok": True, "repo_type": "model"}
    assert hub.calls[1][1]["repo_id"] == "me/msd-tiny"
    assert sorted(hub.uploaded) == ["README.md", "config.json", "model.safetensors", "report.json", "training.json"]
    assert hub.uploaded["model.safetensors"] == (final / "model.safetensors").read_bytes()
    card = hub.uploaded["README.md"].decode()
    meta = card.split("---")[1]
    assert "base_model: llava-hf/llava-1.5-7b-hf" in meta and "license: apache-2.0" in meta
    for tag in ("speculative-decoding", "msd", "eagle"):
        assert f"- {tag}" in meta
    assert "anon8231489123/ShareGPT_Vicuna_unfiltered" in meta and "liuhaotian/LLaVA-Instruct-150K" in meta
    for text in ("deepspeed train.py stage=1", "deepspeed train.py stage=2", "0.0 -> 0.5 over 100",
                 "text-only", REPORT["command"], "3.457", "2.25", "101.2", "| coco |", "NVIDIA H100",
                 "depth=5", "[0.80, 0.60, 0.50]", "`<local>/lora`", "lora_alpha: 16", "r: 8",
                 "sha256", "adapter='path/to/lora'", "run_dir=<local>/run", "- coco: 0.90 (120), - (0)"):
        assert text in card, text
    assert str(tmp_path) not in card  # the card travels: no path of the machine that trained the head
    out = capsys.readouterr()
    assert TOKEN not in out.out + out.err and TOKEN not in card


def test_push_without_report_says_so(tmp_path):
    final = trained_export(tmp_path / "run")
    hub = RecordingHub()
    push_head(final, "me/msd-tiny", client=hub, token=TOKEN)
    card = hub.uploaded["README.md"].decode()
    assert "No evaluation was recorded" in card and "report.json" not in hub.uploaded
    assert "adapter: none" in card


def test_push_dry_run_touches_nothing(tmp_path, capsys):
    final = trained_export(tmp_path / "run")
    (final / "report.json").write_text(json.dumps(REPORT))
    hub = RecordingHub()
    plan = push_head(final, "me/msd-tiny", dry_run=True, token=TOKEN, client=hub)
    out = capsys.readouterr().out
    assert hub.calls == []
    for name in ("config.json", "model.safetensors", "training.json", "report.json", "README.md"):
        assert name in out
    assert plan.card in out and "---\nbase_model:" in out and TOKEN not in out


def test_a_push_uploads_no_path_of_this_machine_and_a_dry_run_stages_exactly_that(tmp_path, capsys):
    """training.json (data files, cache folder, run folder, the command line), report.json and an
    import record went up as they were: each named folders of the machine that trained the head."""
    final = trained_export(tmp_path / "run")
    meta = json.loads((final / "training.json").read_text())
    meta["config"]["data"]["cache_dir"] = str(tmp_path / "cache")
    meta["command"] = f"{tmp_path}/train.py stage=2 run_dir={tmp_path / 'run'} data.cache_dir=~/cache"
    (final / "training.json").write_text(json.dumps(meta))
    (final / "reference_import.json").write_text(json.dumps({"source": str(tmp_path / "released")}))
    (final / "report.json").write_text(json.dumps({**REPORT, "draft": str(final),
                                                   "command": f"python eval.py draft={final} out={tmp_path}/e"}))
    hub = RecordingHub()
    push_head(final, "me/msd-tiny", token=TOKEN, client=hub)
    assert sorted(hub.uploaded) == ["README.md", "config.json", "model.safetensors", "reference_import.json",
                                    "report.json", "training.json"]
    for name, data in hub.uploaded.items():
        if name.endswith(".json") or name.endswith(".md"):
            text = data.decode()
            assert str(tmp_path) not in text and "/data/" not in text and "~/" not in text, (name, text)
    training = json.loads(hub.uploaded["training.json"])
    assert training["config"]["data"]["cache_dir"] == "<local>/cache"
    assert training["config"]["data"]["multimodal"][0] == {"path": "<local>/llava_v1_5_mix665k.json",
                                                           "image_root": "<local>/images"}
    assert training["command"] == "<local>/train.py stage=2 run_dir=<local>/run data.cache_dir=<local>/cache"
    assert json.loads(hub.uploaded["report.json"])["overall"] == REPORT["overall"]  # the numbers as they were
    assert hub.uploaded["model.safetensors"] == (final / "model.safetensors").read_bytes()

    staging = tmp_path / "staged"  # a dry run stages the very same files, in a folder it names
    dry = RecordingHub()
    push_head(final, "me/msd-tiny", dry_run=True, token=TOKEN, client=dry, staging=staging)
    assert dry.calls == [] and f"staged in {staging}" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in staging.iterdir()} == hub.uploaded
    push_head(final, "me/msd-tiny", dry_run=True, token=TOKEN, client=dry)
    named = re.search(r"staged in (\S+):", capsys.readouterr().out).group(1)
    assert {p.name: p.read_bytes() for p in Path(named).iterdir()} == hub.uploaded
    shutil.rmtree(named)


def test_push_refuses_incomplete_folders(tmp_path):
    final = trained_export(tmp_path / "run")
    hub = RecordingHub()
    broken = tmp_path / "no-weights"
    shutil.copytree(final, broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(IncompleteHeadError, match="no weights"):
        push_head(broken, "me/x", client=hub)
    no_config = tmp_path / "no-config"
    shutil.copytree(final, no_config)
    (no_config / "config.json").unlink()
    with pytest.raises(IncompleteHeadError, match="no config.json"):
        push_head(no_config, "me/x", client=hub)
    bad = tmp_path / "bad-weights"
    shutil.copytree(final, bad)
    state = load_file(bad / "model.safetensors")
    del state["layers.0.mlp.down_proj.weight"]
    save_file(state, bad / "model.safetensors")
    with pytest.raises(IncompleteHeadError, match="down_proj"):
        push_head(bad, "me/x", client=hub)
    (bad / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(IncompleteHeadError, match="do not load"):
        push_head(bad, "me/x", client=hub)
    assert hub.calls == []


def test_push_never_prints_the_token_on_errors(tmp_path, capsys):
    final = trained_export(tmp_path / "run")
    hub = RecordingHub(fail_with=RuntimeError(f"401 Unauthorized for token {TOKEN}"))
    with pytest.raises(RuntimeError) as err:
        push_head(final, "me/msd-tiny", client=hub, token=TOKEN)
    assert TOKEN not in str(err.value) and "***" in str(err.value) and err.value.__cause__ is None
    out = capsys.readouterr()
    assert TOKEN not in out.out + out.err


# --- the scripts ------------------------------------------------------------------------------


def _script(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_script(name, args, monkeypatch):
    """In-process, with the command line a user types (Hydra reads sys.argv)."""
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *args])
    _script(name).main()


@pytest.mark.slow
def test_scripts_import_export_push(tmp_path, monkeypatch, capsys):
    """The three entry points as a user runs them (import and export in-process, push as a process)."""
    released_head(tmp_path / "released", "llava", "bin", dtype=torch.float16)
    _run_script("import_reference", [f"src={tmp_path}/released", f"out={tmp_path}/ours"], monkeypatch)
    _run_script("export", [f"checkpoint={tmp_path}/ours", "format=reference", f"out={tmp_path}/back"], monkeypatch)
    raw, back = released_weights(tmp_path / "released"), released_weights(tmp_path / "back")
    assert (tmp_path / "back" / "pytorch_model.bin").is_file() and all(torch.equal(back[k], raw[k]) for k in raw)
    with pytest.raises(SystemExit, match="1"):
        _run_script("export", [f"checkpoint={tmp_path}/ours"], monkeypatch)
    assert "error: export: missing required argument(s): out=..." in capsys.readouterr().err

    env = {**os.environ, "HF_TOKEN": TOKEN, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "push_to_hub.py"), "checkpoint=ours",
                           "repo_id=me/msd-imported", "dry_run=true"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert TOKEN not in proc.stdout + proc.stderr
    assert "would upload to me/msd-imported" in proc.stdout and "reference_import.json" in proc.stdout
    assert "No evaluation was recorded" in proc.stdout and "Imported from the released head" in proc.stdout


def _local_target_export(tmp_path: Path, target: str | None) -> Path:
    final = tmp_path / "run" / "stage2" / "final"
    config = MSDDraftConfig(hidden_size=H, intermediate_size=INTER, num_attention_heads=HEADS,
                            target_name_or_path=target, target_vocab_size=VOCAB)
    MSDDraftModel(config).save_pretrained(final)
    meta = {"stage": 2, "step": 10, "command": f"deepspeed train.py stage=2 target.name_or_path={target} "
                                               f"run_dir={tmp_path}/run", "config": {}}
    (final / "training.json").write_text(json.dumps(meta))
    return final


def test_card_for_a_local_target_has_no_absolute_path_and_uses_base_model(tmp_path):
    """A head trained on a local target: without base_model= the card says plainly which
    target to pass; with it, the Hub id is the metadata's base_model, the title and the
    snippet's target. Never the absolute path of the machine that trained it."""
    local = tmp_path / "models" / "tiny-llava"
    local.mkdir(parents=True)
    final = _local_target_export(tmp_path, str(local))

    card = plan_push(final, "me/msd-tiny").card
    assert str(tmp_path) not in card and "load_target(None" not in card
    assert "base_model" not in card.split("---")[1]  # no Hub id to put in the metadata
    assert "# MSD draft head for a local target (`tiny-llava`)" in card
    assert "load_target('path/to/tiny-llava'" in card
    assert "local model folder named `tiny-llava`" in card and f"hidden size {H}" in card
    assert "target.name_or_path=path/to/tiny-llava" in card  # the eval command the card suggests
    assert "target.name_or_path=<local>/tiny-llava run_dir=<local>/run" in card  # the training command

    card = plan_push(final, "me/msd-tiny", base_model="llava-hf/llava-1.5-7b-hf").card
    assert "base_model: llava-hf/llava-1.5-7b-hf" in card.split("---")[1]
    assert "# MSD draft head for llava-hf/llava-1.5-7b-hf" in card
    assert "load_target('llava-hf/llava-1.5-7b-hf'" in card and "local copy of it" in card
    assert str(tmp_path) not in card

    for bad in (str(local), "not-an-id"):
        with pytest.raises(ValueError, match="base_model=.*Hub model id"):
            plan_push(final, "me/msd-tiny", base_model=bad)


def test_card_of_an_imported_head_without_target_names_what_to_pass(tmp_path):
    final = _local_target_export(tmp_path, None)
    card = plan_push(final, "me/msd-imported").card
    assert "load_target(None" not in card and "target not recorded" in card
    assert f"hidden size {H} and a vocabulary of {VOCAB} tokens" in card


@pytest.mark.slow
def test_push_script_takes_base_model(tmp_path):
    local = tmp_path / "tiny-llava"
    local.mkdir()
    final = _local_target_export(tmp_path, str(local))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "push_to_hub.py"), f"checkpoint={final}",
                           "repo_id=me/msd-tiny", "dry_run=true", "base_model=llava-hf/llava-1.5-7b-hf"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    card = proc.stdout.split("----- README.md -----")[1]
    assert "base_model: llava-hf/llava-1.5-7b-hf" in card and str(tmp_path) not in card
