"""The head interface (msd_train.draft.head), met by every architecture, and the msd3 head.

Tiny random LLaVA (1-D RoPE) and Qwen2-VL (M-RoPE) targets with one image; every check
goes through the interface the trainer, the validation and the decoder use.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from builders import random_image

from msd_train.decoding import DecodeConfig, generate
from msd_train.decoding.ensemble import EnsembleDrafter
from msd_train.draft import HEADS, MSD3DraftConfig, MSDDraftConfig, MSDDraftModel
from msd_train.draft.loss import loss_index
from msd_train.draft.vocabulary import draft_vocabulary, token_counts
from msd_train.targets import Features
from msd_train.training.objective import objective_for

pytestmark = pytest.mark.usefixtures("one_thread")

TRAIN = SimpleNamespace(w_feat=1.0, w_tok=0.1)


def prompt(target, seed: int = 1):
    user = {"role": "user", "content": "<image>\nwhat colour is the circle?"}
    return target.encode_prompt([user], [random_image(seed)])


def make_head(architecture: str, target, **overrides):
    torch.manual_seed(0)
    config_class = HEADS[architecture].config_class
    config = config_class.from_target_config(target.config, target.name, target_vocab_size=target.vocab_size,
                                             **overrides)
    head = HEADS[architecture](config)
    with torch.no_grad():  # non-trivial norms so that every parameter matters
        for name, p in head.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    return head.eval()


def pass_of(target, head, enc, extra: torch.Tensor | None = None):
    """A target pass over the prompt (and ``extra`` generated tokens after it, which are
    text whatever their ids), with the head's features."""
    if extra is None:
        return target.features(enc.input_ids[None], None, enc.pixel, layers=head.feature_layers)
    with torch.no_grad():
        embeds = torch.cat([target.embed(enc.input_ids[None], enc.pixel), target.embed_tokens(extra[None])], 1)
        pos, deltas = target.position_ids(enc.input_ids[None], None, enc.pixel)
        pos = torch.cat([pos, target.continue_positions(len(enc.input_ids), len(extra), deltas)], -1)
        hidden, _, states = target.run_for_head(embeds, pos, layers=head.feature_layers)
    visual = torch.cat([enc.input_ids == target.image_token_id, torch.zeros_like(extra, dtype=torch.bool)])
    return Features(embeds, hidden, visual[None], pos, deltas, states if head.feature_layers else None)


@pytest.fixture(params=["llava", "qwen2_vl"])
def target(request):
    return request.getfixturevalue("llava_target" if request.param == "llava" else "qwen_target")


# ----- the contract ---------------------------------------------------------------------


@pytest.mark.parametrize("architecture", sorted(HEADS))
def test_contract(architecture, target):
    """Features in, logits over the target vocabulary out, a finite loss with gradients,
    and a drafting step (cache + one position) equals that position of a whole pass."""
    head = make_head(architecture, target, **({"draft_vocab_size": target.vocab_size - 5}
                                              if HEADS[architecture].has_draft_vocabulary else {}))
    feats = pass_of(target, head, prompt(target))
    inputs = head.target_inputs(feats, target)
    T = inputs["input_embeds"].shape[1]
    from transformers import DynamicCache

    cache = DynamicCache()
    if "block" in head.decoding_methods:  # a block head: every anchor's block, then the last one after a cache
        S = head.config.block_size
        seen = torch.arange(T)[None, None, :] <= torch.arange(T)[None, :, None]
        with torch.no_grad():
            whole = head(**inputs, context_mask=seen).last_hidden_state
            logits = head.logits(whole, target)
            assert logits.shape == (1, T, S, target.vocab_size)
            ctx_pos = inputs["context_position_ids"]
            head(inputs["input_embeds"][:, :0], inputs["hidden_states"][:, :-1], inputs["position_ids"][..., :0],
                 ctx_pos[..., :-1], past_key_values=cache, use_cache=True)
            last = head(inputs["input_embeds"][:, -1:], inputs["hidden_states"][:, -1:],
                        inputs["position_ids"][..., -1:], ctx_pos[..., -1:], past_key_values=cache,
                        use_cache=True).last_hidden_state  # (1, 1, S, H)
    else:
        with torch.no_grad():
            whole = head(**inputs).last_hidden_state
            logits = head.logits(whole, target)
        assert logits.shape == (1, T, target.vocab_size)
        if head.has_draft_vocabulary:  # the 5 ids outside the draft vocabulary are never drafted
            assert torch.isneginf(logits[..., ~head.t2d]).all() and torch.isfinite(logits[..., head.t2d]).all()

        # the same last position, drafted after a cache of the first T-1
        with torch.no_grad():
            first = {k: v[..., :-1] if k == "position_ids" else v[:, :-1] for k, v in inputs.items() if v is not None}
            head(**first, past_key_values=cache, use_cache=True)
            last = head.step(inputs["input_embeds"][:, -1:], inputs["hidden_states"][:, -1:],
                             position_ids=inputs["position_ids"][..., -1:], past_key_values=cache)
    assert torch.allclose(last[:, 0], whole[:, -1], atol=1e-5)

    head.train()
    mask = torch.ones(1, T, dtype=torch.bool)
    loss, sums = objective_for(head).training_loss(target, feats, loss_index(mask), float(T), TRAIN)
    assert torch.isfinite(loss) and loss > 0 and sums["n"] == T
    loss.backward()
    assert all(p.grad is not None for p in head.parameters() if p.requires_grad)
    metrics = objective_for(head).training_metrics({k: float(v) for k, v in sums.items()}, TRAIN)
    assert 0 <= metrics["top1"] <= 1 and metrics["loss"] > 0


@pytest.mark.parametrize("architecture", sorted(HEADS))
def test_the_architecture_is_chosen_by_name_and_saved(architecture, llava_target, tmp_path):
    """``MSDDraftModel.from_pretrained`` opens every head kind as the class its config.json
    names, weights (a draft vocabulary's maps included) bit for bit."""
    cls = HEADS[architecture]
    head = make_head(architecture, llava_target, **({"draft_vocab_size": 20} if cls.has_draft_vocabulary else {}))
    if cls.has_draft_vocabulary:
        head.set_vocabulary(*draft_vocabulary(torch.arange(llava_target.vocab_size) % 7, 20))
    head.save_pretrained(tmp_path)
    back = MSDDraftModel.from_pretrained(tmp_path)  # the class config.json names
    assert type(back) is cls and back.architecture == architecture
    for name, p in head.state_dict().items():
        assert torch.equal(back.state_dict()[name], p), name
    if not cls.has_draft_vocabulary:  # a capability the head does not declare is refused
        with pytest.raises(NotImplementedError):
            head.set_vocabulary(torch.zeros(3, dtype=torch.long), torch.ones(3, dtype=torch.bool))
    if not cls.supports_restrict_vocabulary:
        with pytest.raises(NotImplementedError):
            head.restrict_vocabulary(llava_target, torch.arange(3))
    assert type(MSDDraftModel(MSDDraftConfig.from_target_config(llava_target.config, "x"))) is MSDDraftModel


# ----- msd3 -----------------------------------------------------------------------------


def test_draft_vocabulary_maps_every_draft_id_to_a_target_id_and_back():
    counts = torch.tensor([0, 9, 3, 0, 7, 7, 1, 0, 2, 5])
    d2t, t2d = draft_vocabulary(counts, 5)
    target_ids = torch.arange(5) + d2t
    assert target_ids.tolist() == [1, 2, 4, 5, 9]  # the 5 most frequent, sorted
    assert t2d.sum() == 5 and t2d[target_ids].all()
    back = torch.cumsum(t2d.long(), 0) - 1  # a member's draft id: its rank among members
    assert torch.equal(back[target_ids], torch.arange(5))
    full_d2t, full_t2d = draft_vocabulary(counts, 10)  # the whole vocabulary: identity
    assert not full_d2t.any() and full_t2d.all()


def test_token_counts_read_assistant_tokens_only():
    from datasets import Dataset

    rows = [{"input_ids": [1, 2, 2, 3], "loss_mask": [0, 1, 1, 0]}, {"input_ids": [3, 3], "loss_mask": [1, 0]}]
    assert token_counts([Dataset.from_list(rows)], 5).tolist() == [0, 0, 2, 1, 0]
    # rows of one length (numpy gives them as a 2-D batch), split across batches, and an empty split
    same = Dataset.from_list([{"input_ids": [4, 1], "loss_mask": [1, 1]}] * 3)
    assert token_counts([same, Dataset.from_list([])], 5, batch_size=2).tolist() == [0, 3, 0, 0, 3]


def test_feature_layers_default_to_eagle3s_and_clamp(llava_target):
    assert MSD3DraftConfig(hidden_size=32, num_attention_heads=4, target_num_layers=32).feature_layers == [2, 16, 29]
    head = make_head("msd3", llava_target)  # two layers: inputs of layers 0 and 1
    assert head.feature_layers == [0, 1] and head.fc.in_features == 2 * 32
    feats = pass_of(llava_target, head, prompt(llava_target))
    assert feats.layer_states.shape[-1] == 64
    # layer 0's input is the embeddings
    assert torch.equal(feats.layer_states[..., :32], feats.inputs_embeds)


def test_decoupled_visual_inputs_reach_the_head(llava_target):
    """With decoupling the embedding stream at image positions is the projector output;
    without it the image placeholder's embedding (plain EAGLE-3)."""
    target, enc = llava_target, prompt(llava_target)
    on, off = make_head("msd3", target), make_head("msd3", target, decouple_visual=False)
    feats = pass_of(target, on, enc)
    visual = target.visual_embeddings({k: v for k, v in enc.pixel.items()})
    slots = (enc.input_ids == target.image_token_id)[1:]  # draft position t reads e_{t+1}
    e_on = on.target_inputs(feats, target)["input_embeds"][0]
    e_off = off.target_inputs(feats, target)["input_embeds"][0]
    assert torch.equal(e_on[slots], visual.to(e_on.dtype))
    placeholder = target.embed_tokens.weight[target.image_token_id]
    assert torch.equal(e_off[slots], placeholder.expand_as(e_off[slots]))
    assert torch.equal(e_on[~slots], e_off[~slots])
    # and the head's outputs at those positions follow the image
    other = pass_of(target, on, prompt(target, seed=7))
    with torch.no_grad():
        a = on(**on.target_inputs(feats, target)).last_hidden_state
        b = on(**on.target_inputs(other, target)).last_hidden_state
    first = int(slots.nonzero()[0])
    assert not torch.allclose(a[0, first], b[0, first])


def test_decoupling_reaches_the_decoders_prefill(llava_target):
    """The decoder's prefill feeds the head the same embedding stream training does: two
    heads with equal weights that differ only in ``decouple_visual`` cache different keys
    at image positions and draft different first distributions after the prompt."""
    from msd_train.decoding import HeadDrafter, prefill

    target, enc = llava_target, prompt(llava_target)
    on, off = make_head("msd3", target), make_head("msd3", target, decouple_visual=False)
    off.load_state_dict(on.state_dict())
    slots = (enc.input_ids == target.image_token_id)[1:]  # draft position t reads e_{t+1}
    keys, firsts = [], []
    for head in (on, off):
        head.requires_grad_(False)
        state = prefill(target, HeadDrafter(head), enc)
        state.tokens.append(int(state.next_logits.argmax()))
        keys.append(state.drafter.cache.layers[0].keys[0, :, : len(slots)].clone())
        with torch.inference_mode():
            out = state.drafter.feed_pending(target, state.pending())
            firsts.append(head.logits(out[:, None], target)[0, 0])
    assert not torch.allclose(keys[0][:, slots], keys[1][:, slots])
    # text positions before the first image read the same inputs
    before = int(slots.nonzero()[0])
    assert torch.allclose(keys[0][:, :before], keys[1][:, :before])
    assert not torch.allclose(firsts[0], firsts[1])


def test_ttt_step_i_reads_the_heads_own_step_i_minus_1_output(target):
    """The unrolled step i at anchor t equals drafting a chain from t: the committed
    step-0 context up to t in the cache, then one step per depth reading the previous
    step's own output, at position id pos_t + i."""
    from transformers import DynamicCache

    head = make_head("msd3", target, ttt_steps=3)
    feats = pass_of(target, head, prompt(target), extra=torch.tensor([40, 41, 42, 43]))
    inputs = head.target_inputs(feats, target)
    with torch.no_grad():
        outs = head.unroll(inputs, 3)
        T = inputs["input_embeds"].shape[1]
        t = T - 4
        cache = DynamicCache()
        pos = inputs["position_ids"]
        head(inputs["input_embeds"][:, : t + 1], inputs["hidden_states"][:, : t + 1], position_ids=pos[..., : t + 1],
             past_key_values=cache, use_cache=True)
        state = outs[0][:, t : t + 1]
        for i in (1, 2):
            state = head.step(inputs["input_embeds"][:, t + i : t + i + 1], state,
                              position_ids=pos[..., t : t + 1] + i, past_key_values=cache)
            assert torch.allclose(state[:, 0], outs[i][:, t], atol=1e-5), i
        # reading the target's features instead of its own output gives another step 1
        wrong = head.unroll({**inputs}, 1)[0]
        assert not torch.allclose(wrong[:, t + 1], outs[1][:, t])


def test_ttt_loss_weights_steps_and_masks_tokens_outside_the_draft_vocabulary(llava_target):
    target = llava_target
    head = make_head("msd3", target, ttt_steps=2, ttt_decay=0.5, draft_vocab_size=target.vocab_size - 3)
    feats = pass_of(target, head, prompt(target), extra=torch.tensor([40, 41, 42]))
    T = feats.hidden_states.shape[1] - 1
    mask = torch.ones(1, T, dtype=torch.bool)
    with torch.no_grad():
        loss, sums = objective_for(head).training_loss(target, feats, loss_index(mask), 1.0, TRAIN)
        outs = head.unroll(head.target_inputs(feats, target), 2)
        tl = target.lm_head(feats.hidden_states[:, 1:]).float()
        ok = head.t2d[tl.argmax(-1)]
        p = tl[..., head.draft_ids].softmax(-1)
        want = 0.0
        for i, s in enumerate(outs):
            logp = head.draft_logits(s).float().log_softmax(-1)[:, : T - i]
            ce = -(p[:, i:] * logp).sum(-1)
            want += 0.5 ** i * ce[ok[:, i:]].sum()
    assert torch.allclose(loss, want, rtol=1e-5)
    assert sums["valid_1"] == ok[:, 1:].sum() and sums["valid_0"] == ok.sum()
    # acc_i over the in-vocabulary positions; acc_all_i (EAGLE-3's) counts the others as misses
    # (a 4-token draft vocabulary: the target's most frequent next token here and 3 it never
    # predicts, so some positions fall inside it and the others outside)
    top = tl.argmax(-1).flatten()
    frequent = torch.bincount(top, minlength=target.vocab_size).argmax()
    assert (top != frequent).any(), "every position has the same target token: nothing falls outside"
    counts = torch.zeros(target.vocab_size, dtype=torch.long)
    counts[frequent] = 10
    counts[[t for t in range(target.vocab_size) if t not in set(top.tolist())][:3]] = 1
    head = make_head("msd3", target, ttt_steps=2, draft_vocab_size=4)
    head.set_vocabulary(*draft_vocabulary(counts, 4))
    with torch.no_grad():
        _, sums = objective_for(head).training_loss(target, pass_of(target, head, prompt(target), extra=torch.tensor([40, 41, 42])), loss_index(mask),
                                                    1.0, TRAIN)
    assert sums["positions_0"] == T and sums["positions_1"] == T - 1 and 0 < sums["valid_0"] < T
    m = objective_for(head).training_metrics({k: float(v) for k, v in sums.items()}, TRAIN)
    for i in range(2):
        assert m[f"acc_{i}"] == float(sums[f"hit_{i}"]) / float(sums[f"valid_{i}"])
        assert m[f"acc_all_{i}"] == float(sums[f"hit_{i}"]) / float(sums[f"positions_{i}"])


# ----- decoding -------------------------------------------------------------------------


def fit_msd3(target, prompts, steps: int = 80):
    """An msd3 head fitted by its own training loss to the target's greedy continuations."""
    head = make_head("msd3", target, ttt_steps=3)
    data = []
    for enc in prompts:
        out = generate(target, None, enc, DecodeConfig(method="ar", max_new_tokens=40, eos_token_ids=()))
        feats = pass_of(target, head, enc, extra=torch.tensor(out.tokens))
        data.append(feats)
    head.train()
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = 0
        for feats in data:
            T = feats.hidden_states.shape[1] - 1
            loss = loss + objective_for(head).training_loss(target, feats, loss_index(torch.ones(1, T, dtype=torch.bool)),
                                                            float(T), TRAIN)[0]
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def msd3_setups(llava_target, qwen_target):
    from builders import tiny_qwen25vl_target

    out = {}
    for name, target in (("llava", llava_target), ("qwen2_vl", qwen_target), ("qwen2_5_vl", tiny_qwen25vl_target())):
        prompts = [prompt(target, 1), prompt(target, 4)]
        out[name] = (target, fit_msd3(target, prompts), prompts)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "qwen2_5_vl"])
def test_greedy_decoding_with_an_msd3_head_equals_plain_decoding(msd3_setups, family):
    target, head, prompts = msd3_setups[family]
    accepted = []
    for enc in prompts:
        plain = generate(target, None, enc, DecodeConfig(method="ar", max_new_tokens=40, eos_token_ids=()))
        for method in (dict(method="tree", depth=3, top_k=4, total_tokens=16), dict(method="chain", k=4)):
            out = generate(target, head, enc, DecodeConfig(max_new_tokens=40, eos_token_ids=(), **method))
            assert out.tokens == plain.tokens, method["method"]
            accepted += [c.accepted for c in out.cycles]
    assert max(accepted) >= 2, "the head is never accepted: the test would not exercise the tree"


def test_ensembles_refuse_an_msd3_head(llava_target):
    with pytest.raises(ValueError, match="reads the inputs of target layers"):
        EnsembleDrafter(make_head("msd3", llava_target), ("M", "T"), "ibed", 32)


# ----- the EAGLE-3 layout -----------------------------------------------------------------


def test_eagle3_layout_round_trips_bit_exactly_and_decodes(msd3_setups, tmp_path):
    import json

    from safetensors.torch import load_file

    from msd_train.hub import detect_layout, load_head
    from msd_train.hub.eagle3 import export_eagle3, import_eagle3, same_tensors

    target, head, prompts = msd3_setups["llava"]
    export_eagle3(head, tmp_path / "a")
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == head.d2t.shape[0]
    stored = load_file(tmp_path / "a" / "model.safetensors")
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight",
            "midlayer.self_attn.q_proj.weight"} <= set(stored) and not any("embed" in k for k in stored)
    assert stored["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * head.config.hidden_size
    back = import_eagle3(tmp_path / "a")
    assert same_tensors(back.state_dict(), head.state_dict())
    assert back.config.decouple_visual == head.config.decouple_visual
    export_eagle3(back, tmp_path / "b")
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()

    # a third-party head (no "msd" block, no layer ids): EAGLE-3's layers of the target, placeholders at images
    del config["msd"], config["eagle_config"]
    (tmp_path / "a" / "config.json").write_text(json.dumps(config))
    assert detect_layout(tmp_path / "a") == "eagle3"
    released = load_head(tmp_path / "a", target)
    assert released.feature_layers == head.feature_layers and not released.config.decouple_visual
    plain = generate(target, None, prompts[0], DecodeConfig(method="ar", max_new_tokens=24, eos_token_ids=()))
    out = generate(target, released, prompts[0], DecodeConfig(method="tree", depth=3, top_k=4, total_tokens=16,
                                                               max_new_tokens=24, eos_token_ids=()))
    assert out.tokens == plain.tokens
