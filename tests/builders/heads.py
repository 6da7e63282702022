"""Heads for tests: fitted to a target's greedy continuations (``train_head``), released
heads at tiny size laid out as the published ones (``released_head``), tiny msd / msd3
heads with random weights, and the decoding helpers the decoder's tests share."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from builders import fit_head, random_image
from msd_train.decoding import DecodeConfig, HeadDrafter, draft_tree, generate, prefill
from msd_train.draft import MSD3DraftConfig, MSD3DraftModel, MSDDraftConfig, MSDDraftModel, draft_rope_deltas
from msd_train.draft.vocabulary import draft_vocabulary
from msd_train.targets import Encoded, Features

#: the tiny size of released and random heads (hub tests)
H, INTER, HEADS, KV, VOCAB, DRAFT_VOCAB = 32, 64, 4, 2, 40, 16

TREE = dict(method="tree", depth=3, top_k=4, total_tokens=16)

CHAIN = dict(method="chain", k=4)


def conversations(target) -> dict[str, Encoded]:
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    return {
        "text": target.encode_prompt([user("python function returns value")], []),
        "image": target.encode_prompt([user("<image>\nwhat colour is the circle?")], [random_image(1)]),
        "two_images": target.encode_prompt([user("<image>\n<image>\nthere are two red circle")],
                                           [random_image(2), random_image(3)]),
        "second_turn": target.encode_prompt(
            [user("<image>\ndescribe this image"), {"role": "assistant", "content": "a red circle"},
             user("how many squares are there")], [random_image(4)]),
    }


def train_head(target, prompts: list[Encoded], steps: int = 120) -> MSDDraftModel:
    """A head fitted to the target's greedy continuations of ``prompts`` (top-1 CE)."""
    torch.manual_seed(0)
    head = MSDDraftModel(MSDDraftConfig.from_target_config(target.config, target.name))
    batch = []
    for enc in prompts:
        out = generate(target, None, enc, DecodeConfig(method="ar", max_new_tokens=48, eos_token_ids=()))
        new = torch.tensor(out.tokens)
        with torch.no_grad():
            state = prefill(target, None, enc)
            embeds = torch.cat([target.embed(enc.input_ids[None], enc.pixel), target.embed_tokens(new[None])], 1)
            pos, deltas = target.position_ids(enc.input_ids[None], None, enc.pixel)
            pos = torch.cat([pos, target.continue_positions(len(enc.input_ids), len(new), deltas)], -1)
            hidden, _ = target.run_language_model(embeds, pos)
        assert state.prompt_len == len(enc.input_ids)
        visual = torch.cat([enc.input_ids == target.image_token_id, torch.zeros_like(new, dtype=torch.bool)])
        inputs = head.target_inputs(Features(embeds, hidden, visual[None], pos))
        batch.append((inputs, target.lm_head(hidden[0, 1:]).argmax(-1)))
    return fit_head(head, target, batch, steps)


def train_dflash_head(target, prompts: list[Encoded], steps: int = 60, new_tokens: int = 48, **fields):
    """A dflash head (``fields``: its config's, e.g. block_size) fitted by its own objective to
    the target's greedy continuations of ``prompts`` (anchors inside the answers: as many as an
    answer has tokens, not the recipe's 512, which a pass computes whether valid or not)."""
    from types import SimpleNamespace

    from msd_train.draft import DFlashDraftConfig, DFlashDraftModel
    from msd_train.draft.loss import loss_index
    from msd_train.training.objective import objective_for

    torch.manual_seed(0)
    fields.setdefault("num_anchors", new_tokens)
    head = DFlashDraftModel(DFlashDraftConfig.from_target_config(target.config, target.name, **fields))
    objective, batch = objective_for(head), []
    for enc in prompts:
        out = generate(target, None, enc, DecodeConfig(method="ar", max_new_tokens=new_tokens, eos_token_ids=()))
        ids = torch.cat([enc.input_ids, torch.tensor(out.tokens)])[None]
        with torch.no_grad():
            feats = target.features(ids, None, enc.pixel, layers=head.feature_layers)
        mask = torch.zeros(1, ids.shape[1] - 1, dtype=torch.bool)
        mask[:, len(enc.input_ids) - 2:] = True  # the answer's tokens (draft position t predicts token t+2)
        batch.append((feats, loss_index(mask), float(mask.sum())))
    train = SimpleNamespace(noise="none", noise_scale=0.0)
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = sum(objective.training_loss(target, f, index, n, train)[0] for f, index, n in batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval().requires_grad_(False)


def run(target, head, prompt, workspace=None, **config):
    config.setdefault("max_new_tokens", 40)
    return generate(target, head, prompt, DecodeConfig(**config), workspace=workspace)


def head_logits_after(target, head, prompt, first: int, path: list[int]) -> torch.Tensor:
    """Reference: the head's next-token logits after ``path``, recomputed from scratch
    (no cache, causal attention): prompt pairs, then (h_{L-1}, e(first)), then one
    (own previous output, e(token)) pair per path token."""
    ids = prompt.input_ids[None]
    embeds = target.embed(ids, prompt.pixel)
    pos, deltas = target.position_ids(ids, None, prompt.pixel)
    hidden, _ = target.run_language_model(embeds, pos)
    deltas = draft_rope_deltas(head.config, deltas)  # the head's ids after the prompt (zeros for a 1d head)
    x, _ = head.read_pass(Features(embeds, hidden, ids == target.image_token_id, pos))  # images as the head reads them
    e, h, replace, raw, p = (x[k] for k in ("input_embeds", "hidden_states", "replace_mask", "raw_embeds",
                                            "position_ids"))
    L = ids.shape[1]
    e = torch.cat([e, target.embed_tokens(torch.tensor([[first]]))], 1)
    h = torch.cat([h, hidden[:, -1:]], 1)
    replace = torch.cat([replace, torch.zeros(1, 1, dtype=torch.bool)], 1)
    raw = torch.cat([raw, e[:, -1:]], 1)
    p = torch.cat([p, target.continue_positions(L - 1, 1, deltas)], -1)
    out = head(e, h, replace, raw, position_ids=p).last_hidden_state
    for i, tok in enumerate(path, start=1):
        e = torch.cat([e, target.embed_tokens(torch.tensor([[tok]]))], 1)
        h = torch.cat([h, out[:, -1:]], 1)
        replace = torch.cat([replace, torch.zeros(1, 1, dtype=torch.bool)], 1)
        raw = torch.cat([raw, e[:, -1:]], 1)
        p = torch.cat([p, target.continue_positions(L - 1 + i, 1, deltas)], -1)
        out = head(e, h, replace, raw, position_ids=p).last_hidden_state
    return target.lm_head(out[0, -1])

KV_HEADS = {"llava": 4, "qwen2_vl": 2}  # LLaVA-1.5 is multi-head, Qwen2-VL grouped-query


def released_head(folder: Path, model_type: str, fmt: str, seed: int = 0, dtype=torch.float32,
                  embed: torch.Tensor | None = None, extra: dict | None = None) -> dict:
    """config.json + pytorch_model.bin / model.safetensors with the released key names."""
    g = torch.Generator().manual_seed(seed)
    kv, d = KV_HEADS[model_type], H // HEADS
    qwen = model_type == "qwen2_vl"

    def rnd(*shape, scale=0.1):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    t = {
        "embed_tokens.weight": rnd(VOCAB, H, scale=1.0) if embed is None else embed.to(dtype),
        "fc.weight": rnd(H, 2 * H),
        "fc.bias": rnd(H),
        "layers.0.self_attn.q_proj.weight": rnd(HEADS * d, H, scale=0.3),
        "layers.0.self_attn.k_proj.weight": rnd(kv * d, H, scale=0.3),
        "layers.0.self_attn.v_proj.weight": rnd(kv * d, H),
        "layers.0.self_attn.o_proj.weight": rnd(H, HEADS * d),
        "layers.0.mlp.gate_proj.weight": rnd(INTER, H),
        "layers.0.mlp.up_proj.weight": rnd(INTER, H),
        "layers.0.mlp.down_proj.weight": rnd(H, INTER),
        "layers.0.post_attention_layernorm.weight": (1 + rnd(H)),
    }
    if qwen:
        for p in "qkv":
            t[f"layers.0.self_attn.{p}_proj.bias"] = rnd(t[f"layers.0.self_attn.{p}_proj.weight"].shape[0])
        t["layers.0.input_layernorm.weight"] = 1 + rnd(H)
    t.update(extra or {})
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": model_type, "hidden_size": H,
        "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": kv,
        "num_hidden_layers": 1, "hidden_act": "silu", "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5 if not qwen else 1e-6, "rope_theta": 10000.0 if not qwen else 1e6,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 1, 1]} if qwen else None,
        "vocab_size": t["embed_tokens.weight"].shape[0], "torch_dtype": str(dtype)[6:], "bias": True,
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if fmt == "bin":
        torch.save(t, folder / "pytorch_model.bin")
    else:
        save_file(t, folder / "model.safetensors", metadata={"format": "pt"})
    return t


def msd3_head(seed=0, **fields) -> MSD3DraftModel:
    """A tiny msd3 head with random weights and a draft vocabulary that is not the identity."""
    torch.manual_seed(seed)
    config = MSD3DraftConfig(hidden_size=H, intermediate_size=INTER, num_attention_heads=HEADS,
                             num_key_value_heads=KV, target_num_layers=8, target_vocab_size=VOCAB,
                             draft_vocab_size=DRAFT_VOCAB, **fields)
    head = MSD3DraftModel(config)
    for p in head.parameters():  # the norms start at ones: make every tensor tell itself apart
        torch.nn.init.normal_(p, std=0.1)
    head.set_vocabulary(*draft_vocabulary(torch.randint(0, 100, (VOCAB,)), DRAFT_VOCAB))
    return head.eval()


def msd_head() -> MSDDraftModel:
    torch.manual_seed(0)
    return MSDDraftModel(MSDDraftConfig(hidden_size=H, intermediate_size=INTER, num_attention_heads=HEADS,
                                        target_vocab_size=VOCAB)).eval()


def assert_tree_children_are_the_heads_top_k(target, head, prompts) -> None:
    """Each node's children are the head's top tokens after that node's path, with the
    cumulative log-probabilities a from-scratch head rollout gives (tree mask and node
    positions are right)."""
    prompt = prompts["image"]
    state = prefill(target, HeadDrafter(head), prompt)
    first = int(state.next_logits.argmax())
    state.tokens.append(first)
    tree = draft_tree(state.drafter, target, state.pending(), depth=2, top_k=3, total_tokens=12,
                      sampling=DecodeConfig().sampling)
    parents, tokens, kids = tree.parents.tolist(), tree.tokens.tolist(), tree.children()
    checked = 0
    for node in range(len(tree)):
        if not kids[node]:
            continue
        path, n = [], node
        while n > 0:
            path.insert(0, tokens[n])
            n = parents[n]
        ref = head_logits_after(target, head, prompt, first, path).log_softmax(-1)
        assert [tokens[c] for c in kids[node]] == ref.topk(3).indices.tolist()[: len(kids[node])], path
        for c in kids[node]:
            torch.testing.assert_close(tree.scores[c], tree.scores[node] + ref[tokens[c]], atol=1e-4, rtol=1e-4)
        checked += node > 0
    assert checked >= 2
