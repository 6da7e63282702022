"""The MSD draft head: export format, decoupling conventions, KV cache and tree masks."""

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModel, LlamaConfig, LlavaConfig
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLTextConfig
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLTextModel

from msd_train.draft import MSDDraftConfig, MSDDraftModel, align_inputs, crop_cache

H = 32


def tiny_config(family: str = "llama", **overrides) -> MSDDraftConfig:
    """4 heads of 8 dims, GQA 2; qwen2 gets M-RoPE sections (sum 4 = head_dim / 2)."""
    fields = dict(
        hidden_size=H,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_family=family,
        mrope_section=[1, 1, 2] if family == "qwen2" else None,
        target_name_or_path=f"tiny-{family}",
        target_vocab_size=100,
        target_hidden_size=H,
    )
    fields.update(overrides)
    return MSDDraftConfig(**fields)


def tiny_model(family: str = "llama", attn: str = "sdpa", **overrides) -> MSDDraftModel:
    torch.manual_seed(0)
    config = tiny_config(family, **overrides)
    config._attn_implementation = attn
    model = MSDDraftModel(config).eval()
    # Non-zero norm weights and biases so that every parameter matters in comparisons.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
    return model


def mrope_positions(batch: int, length: int) -> torch.Tensor:
    """M-RoPE-like ids [3, B, L]: text, then a 2x2 image block, then text again."""
    t = torch.arange(length)
    pos = torch.stack([t, t, t])
    pos[1, 3:7] = torch.tensor([3, 3, 4, 4])  # height
    pos[2, 3:7] = torch.tensor([3, 4, 3, 4])  # width
    pos[0, 3:7] = 3  # temporal
    pos[:, 7:] = t[7:] - 2  # text after the image resumes at max + 1
    return pos[:, None].expand(3, batch, length).clone()


def positions_for(model: MSDDraftModel, batch: int, length: int) -> torch.Tensor:
    if model.config.uses_mrope:
        return mrope_positions(batch, length)
    return torch.arange(length)[None].expand(batch, length)


def take(pos: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    return pos[..., start:stop]


# --- export -------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_save_load_round_trip(tmp_path, family):
    model = tiny_model(family, visual_offset="paper", target_adapter="lora/dir")
    model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert not any("embed" in k or "lm_head" in k for k in keys)
    assert "fc.weight" in keys and "fc.bias" in keys
    if family == "llama":  # EAGLE convention: no input norm on the first layer
        assert "layers.0.input_layernorm.weight" not in keys
        assert "layers.0.self_attn.q_proj.bias" not in keys
    else:
        assert "layers.0.input_layernorm.weight" in keys
        assert "layers.0.self_attn.q_proj.bias" in keys

    loaded = MSDDraftModel.from_pretrained(tmp_path).eval()
    assert isinstance(AutoModel.from_pretrained(tmp_path), MSDDraftModel)
    for field in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "num_hidden_layers",
        "rope_parameters",
        "mrope_section",
        "layer_family",
        "fc_bias",
        "first_layer_input_norm",
        "decouple_visual",
        "visual_offset",
        "target_name_or_path",
        "target_vocab_size",
        "target_hidden_size",
        "target_adapter",
    ):
        assert getattr(loaded.config, field) == getattr(model.config, field), field

    e, h = torch.randn(2, 6, H), torch.randn(2, 6, H)
    torch.testing.assert_close(loaded(e, h).last_hidden_state, model(e, h).last_hidden_state, rtol=0, atol=0)


def test_parameter_count_at_7b_sizes():
    """LLaVA-1.5-7B head: fc 2H*H+H, q/k/v/o 4H^2, MLP 3*H*11008, one norm = 235,937,792 (~236M).
    Qwen2-VL-7B head (H=3584, 4 KV heads of 128, Qwen2 layers: q/k/v biases and both norms):
    fc 2H*H+H, q H*H+H, k and v 2*(512H+512), o H*H, MLP 3*H*18944, norms 2H = 258,751,488."""
    with torch.device("meta"):
        llava7b = MSDDraftModel(MSDDraftConfig(hidden_size=4096, intermediate_size=11008, num_attention_heads=32))
        qwen2vl7b = MSDDraftModel(
            MSDDraftConfig(
                hidden_size=3584,
                intermediate_size=18944,
                num_attention_heads=28,
                num_key_value_heads=4,
                layer_family="qwen2",
                mrope_section=[16, 24, 24],
            )
        )
    assert llava7b.num_parameters() == 235_937_792
    assert qwen2vl7b.num_parameters() == 258_751_488


# --- decoupling -----------------------------------------------------------------------


def target_pass(length: int = 10, p: int = 3, n: int = 4):
    """Fake target outputs: embeddings E, features Hs, image block at p .. p+n-1."""
    torch.manual_seed(1)
    embeds, feats = torch.randn(1, length, H), torch.randn(1, length, H)
    visual = torch.zeros(1, length, dtype=torch.bool)
    visual[0, p : p + n] = True
    return embeds, feats, visual, p, n


@pytest.mark.parametrize("offset", ["released", "paper"])
def test_decoupling_places_visual_block(offset):
    model = tiny_model(visual_offset=offset)
    E, Hs, V, p, n = target_pass()
    inputs = align_inputs(model.config, E, Hs, V)
    x = model(*inputs, return_layer_input=True).layer_input[0]

    block = range(p - 1, p + n - 1) if offset == "released" else range(p, p + n)
    for t in range(E.shape[1] - 1):
        fused = model.fc(torch.cat([E[0, t + 1], Hs[0, t]]))
        if t in block:
            source = t + 1 if offset == "released" else t  # the visual embedding E[source]
            torch.testing.assert_close(x[t], E[0, source], rtol=0, atol=0)
        else:
            torch.testing.assert_close(x[t], fused)
    # Neighbours of the block are fused vectors: released p+n-1 is fc(e_first_text_after, h_{p+n-1}).
    assert block[0] - 1 not in block and block[-1] + 1 not in block


def test_decoupling_off_fuses_everywhere():
    model = tiny_model(decouple_visual=False)
    E, Hs, V, _, _ = target_pass()
    embeds, hidden, replace, raw = align_inputs(model.config, E, Hs, V)
    assert not replace.any()
    x = model(embeds, hidden, replace, raw, return_layer_input=True).layer_input
    torch.testing.assert_close(x, model.fc(torch.cat([E[:, 1:], Hs[:, :-1]], -1)))


def test_align_inputs_shifts_by_one():
    config = tiny_config()
    E, Hs, V, _, _ = target_pass()
    embeds, hidden, replace, raw = align_inputs(config, E, Hs, None)
    assert torch.equal(embeds, E[:, 1:]) and torch.equal(hidden, Hs[:, :-1])
    assert replace.shape == (1, E.shape[1] - 1) and not replace.any()
    assert torch.equal(align_inputs(config, E, Hs, V)[2], V[:, 1:])


# --- KV cache and masks -----------------------------------------------------------------


CACHE_CASES = [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa"), ("qwen2", "eager")]


@pytest.mark.parametrize("family,attn", CACHE_CASES)
def test_incremental_forward_matches_full(family, attn):
    model = tiny_model(family, attn)
    B, L, prefix = 2, 10, 5
    e, h = torch.randn(B, L, H), torch.randn(B, L, H)
    pos = positions_for(model, B, L)
    full = model(e, h, position_ids=pos).last_hidden_state

    with torch.no_grad():
        out = model(e[:, :prefix], h[:, :prefix], position_ids=take(pos, 0, prefix), use_cache=True)
        cache, pieces = out.cache, [out.last_hidden_state]
        for t in range(prefix, L):  # one token at a time
            step = model(e[:, t : t + 1], h[:, t : t + 1], position_ids=take(pos, t, t + 1), past_key_values=cache)
            pieces.append(step.last_hidden_state)
    assert cache.get_seq_length() == L
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=1e-5)

    with torch.no_grad():  # prefix, then a causal block of several tokens over the cache
        cache = model(e[:, :prefix], h[:, :prefix], position_ids=take(pos, 0, prefix), use_cache=True).cache
        block = model(e[:, prefix:], h[:, prefix:], position_ids=take(pos, prefix, L), past_key_values=cache)
    torch.testing.assert_close(block.last_hidden_state, full[:, prefix:], rtol=0, atol=1e-5)


def test_default_positions_and_padding_mask():
    model = tiny_model()
    e, h = torch.randn(1, 6, H), torch.randn(1, 6, H)
    ref = model(e, h, position_ids=torch.arange(6)[None]).last_hidden_state
    torch.testing.assert_close(model(e, h).last_hidden_state, ref, rtol=0, atol=0)

    # Left padding by 2: valid positions match the unpadded run when positions start at 0.
    pad = torch.zeros(1, 2, H)
    mask = torch.tensor([[0, 0] + [1] * 6])
    pos = torch.tensor([[0, 0] + list(range(6))])
    padded = model(torch.cat([pad, e], 1), torch.cat([pad, h], 1), position_ids=pos, attention_mask=mask)
    torch.testing.assert_close(padded.last_hidden_state[:, 2:], ref, rtol=0, atol=1e-5)


# A small draft tree over a cached prefix: nodes in breadth-first order, parent -1 = root.
TREE_PARENTS = [-1, -1, 0, 0, 1, 2]


def tree_mask(parents: list[int], past: int) -> torch.Tensor:
    """Additive [1, 1, n, past + n]: each node sees the prefix, its ancestors and itself."""
    n = len(parents)
    allowed = torch.zeros(n, past + n, dtype=torch.bool)
    allowed[:, :past] = True
    for i in range(n):
        j = i
        while j != -1:
            allowed[i, past + j] = True
            j = parents[j]
    return torch.zeros(1, 1, n, past + n).masked_fill(~allowed, torch.finfo(torch.float32).min)


def path_to(node: int, parents: list[int]) -> list[int]:
    path = []
    while node != -1:
        path.append(node)
        node = parents[node]
    return path[::-1]


@pytest.mark.parametrize("family,attn", CACHE_CASES)
def test_tree_mask_matches_each_path(family, attn):
    model = tiny_model(family, attn)
    prefix, n = 8, len(TREE_PARENTS)  # the prefix holds the M-RoPE image block
    e, h = torch.randn(1, prefix, H), torch.randn(1, prefix, H)
    ne, nh = torch.randn(1, n, H), torch.randn(1, n, H)
    depth = torch.tensor([len(path_to(i, TREE_PARENTS)) - 1 for i in range(n)])
    pos = positions_for(model, 1, prefix)
    node_pos = int(pos.max()) + 1 + depth[None]  # text after the prefix; broadcast to 3 rows under M-RoPE

    with torch.no_grad():
        cache = model(e, h, position_ids=pos, use_cache=True).cache
        tree = model(
            ne, nh, position_ids=node_pos, attention_mask=tree_mask(TREE_PARENTS, prefix), past_key_values=cache
        ).last_hidden_state
        assert cache.get_seq_length() == prefix + n

        for leaf in range(n):
            path = path_to(leaf, TREE_PARENTS)
            crop_cache(cache, prefix)  # drop the tree (or the previous path) again
            assert cache.get_seq_length() == prefix
            seq = model(ne[:, path], nh[:, path], position_ids=node_pos[:, path], past_key_values=cache)
            torch.testing.assert_close(tree[:, path], seq.last_hidden_state, rtol=0, atol=1e-5)


def test_crop_then_continue_matches_full():
    model = tiny_model()
    e, h = torch.randn(1, 8, H), torch.randn(1, 8, H)
    full = model(e, h).last_hidden_state
    junk = torch.randn(1, 3, H)
    with torch.no_grad():
        cache = model(e[:, :5], h[:, :5], use_cache=True).cache
        model(junk, junk, past_key_values=cache)  # rejected draft tokens
        assert crop_cache(cache, 5) is cache and cache.get_seq_length() == 5
        rest = model(e[:, 5:], h[:, 5:], past_key_values=cache).last_hidden_state
    torch.testing.assert_close(rest, full[:, 5:], rtol=0, atol=1e-5)
    with pytest.raises(ValueError):
        crop_cache(cache, 100)


def test_gradient_checkpointing_gives_same_gradients():
    model = tiny_model().train()
    e, h = torch.randn(2, 6, H), torch.randn(2, 6, H)
    model(e, h).last_hidden_state.square().sum().backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model(e, h).last_hidden_state.square().sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, plain[name], msg=name)


# --- from a target's config ---------------------------------------------------------------


def test_from_llama_target_config():
    text = LlamaConfig(
        hidden_size=H,
        intermediate_size=80,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=3,
        vocab_size=120,
        rope_theta=5e5,
        rms_norm_eps=1e-5,
    )
    config = MSDDraftConfig.from_target_config(text, "tiny/llama", visual_offset="paper")
    assert (config.layer_family, config.first_layer_input_norm, config.mrope_section) == ("llama", False, None)
    assert (config.hidden_size, config.intermediate_size, config.num_key_value_heads) == (H, 80, 2)
    assert config.num_hidden_layers == 1 and config.rms_norm_eps == 1e-5
    assert config.rope_parameters["rope_theta"] == 5e5
    assert (config.target_vocab_size, config.target_hidden_size, config.target_name_or_path) == (120, H, "tiny/llama")
    assert config.visual_offset == "paper"

    # A composite LLaVA config works too: its text part is used.
    llava = LlavaConfig(text_config=text.to_dict(), vision_config={"model_type": "clip_vision_model"})
    assert MSDDraftConfig.from_target_config(llava, "tiny/llava").to_dict() | {"target_name_or_path": None} == (
        MSDDraftConfig.from_target_config(text, "tiny/llama").to_dict() | {"target_name_or_path": None}
    )
    MSDDraftModel(config)(torch.randn(1, 3, H), torch.randn(1, 3, H))


@pytest.mark.parametrize("text_class", [Qwen2VLTextConfig, Qwen2_5_VLTextConfig])
def test_from_qwen_vl_target_config(text_class):
    text = text_class(
        hidden_size=H,
        intermediate_size=80,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=150,
        max_position_embeddings=256,
        rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
        rope_theta=1e6,
    )
    config = MSDDraftConfig.from_target_config(text, "tiny/qwen")
    assert (config.layer_family, config.first_layer_input_norm, config.mrope_section) == ("qwen2", True, [1, 1, 2])
    assert config.rope_parameters["rope_theta"] == 1e6
    assert config.target_vocab_size == 150


def test_qwen2_draft_layer_matches_target_layer_under_mrope():
    """With fc set to pass the embedding through, the draft's layer equals the target's
    first decoder layer (same weights, same M-RoPE ids): our RoPE plumbing is the target's."""
    text = Qwen2VLTextConfig(
        hidden_size=H,
        intermediate_size=80,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=50,
        rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
    )
    torch.manual_seed(0)
    target = Qwen2VLTextModel(text).eval()
    draft = MSDDraftModel(MSDDraftConfig.from_target_config(text, "tiny/qwen")).eval()
    draft.layers[0].load_state_dict(target.layers[0].state_dict())
    with torch.no_grad():
        draft.fc.weight.copy_(torch.cat([torch.eye(H), torch.zeros(H, H)], 1))
        draft.fc.bias.zero_()
    e = torch.randn(1, 10, H)
    pos = mrope_positions(1, 10)
    want = target(inputs_embeds=e, position_ids=pos, output_hidden_states=True).hidden_states[1]
    got = draft(e, torch.randn(1, 10, H), position_ids=pos).last_hidden_state
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_the_layer_family_table_is_what_configs_and_heads_use():
    """One table (msd_train.draft.families) names each layer family's decoder layer and
    conventions; every family a config may name is in it, and a head is built from it."""
    import typing

    from msd_train.draft.families import LAYER_FAMILIES, family_with_qkv_bias, layer_family

    assert set(typing.get_args(MSDDraftConfig.__annotations__["layer_family"])) == set(LAYER_FAMILIES)
    for name, family in LAYER_FAMILIES.items():
        config = MSDDraftConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, layer_family=name)
        assert config.first_layer_input_norm == family.first_layer_input_norm
        head = MSDDraftModel(config)
        assert all(type(layer) is family.decoder_layer for layer in head.layers)
        assert (head.layers[0].self_attn.q_proj.bias is not None) == family.qkv_bias
        assert family_with_qkv_bias(family.qkv_bias) is family
    with pytest.raises(ValueError, match="layer_family='gpt2' is not a draft layer family"):
        layer_family("gpt2")
