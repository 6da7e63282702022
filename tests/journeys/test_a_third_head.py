"""A head kind added from outside the product: registered in this test only, it trains through
the recipe on the embedded tiny target, decodes losslessly, exports, loads back and gets a
model card, with no product file naming it. What a new head needs is its config, its head
class, its objective and a conf/head file (here written to a temporary folder that Hydra
searches); the trainer, the decoder, the exporters and the card ask the head, they do not list.
"""

from __future__ import annotations

import pytest
import torch
from builders import random_image
from builders.runs import recipe
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

from msd_train.decoding import DecodeConfig, generate
from msd_train.draft import HEADS, MSDDraftConfig, MSDDraftModel
from msd_train.draft.families import layer_family
from msd_train.draft.head import DraftHead, pair, shift
from msd_train.draft.loss import lm_head_argmax, msd_loss
from msd_train.draft.model import MSDDraftOutput, attention_bias
from msd_train.draft.positions import draft_position_ids
from msd_train.hf_compat import cache_kwargs
from msd_train.training.objective import OBJECTIVES, Objective, feature_noise

pytestmark = pytest.mark.usefixtures("in_process")


@strict
class SumConfig(MSDDraftConfig):
    """A head that adds two projections instead of concatenating: x = A e_{t+1} + B h_t."""

    model_type = "sum_draft"
    stage_overridable = ("draft_positions",)
    layout_extras = ("layer_family", "target_name_or_path")

    feature_scale: float = 1.0  # a field of its own, saved with it


class SumHead(DraftHead):
    architecture = "sum"
    config_class = SumConfig

    def __init__(self, config: SumConfig):
        super().__init__(config)
        hidden = config.hidden_size
        self.embed_proj = nn.Linear(hidden, hidden, bias=False)
        self.feature_proj = nn.Linear(hidden, hidden, bias=False)
        self.layer = layer_family(config.layer_family).decoder_layer(config, layer_idx=0)
        self.rotary_emb = (Qwen2VLRotaryEmbedding if config.uses_mrope else LlamaRotaryEmbedding)(config)
        self.post_init()

    def target_inputs(self, features, target=None, position_ids=None):
        embeds, hidden = pair(features.inputs_embeds, features.hidden_states)
        pos = position_ids
        if pos is None and features.position_ids is not None:
            pos = draft_position_ids(self.config, features.position_ids)
        return {"input_embeds": embeds, "hidden_states": hidden, "position_ids": None if pos is None else pos[..., :-1]}

    def forward(self, input_embeds, hidden_states, position_ids=None, attention_mask=None, past_key_values=None,
                use_cache=False):
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        B, T = input_embeds.shape[:2]
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        dtype = self.embed_proj.weight.dtype
        x = self.embed_proj(input_embeds.to(dtype)) + self.config.feature_scale * self.feature_proj(
            hidden_states.to(dtype))
        pos = self._position_ids(position_ids, B, T, past, x.device)
        bias = attention_bias(attention_mask, B, T, past, x.dtype, x.device)
        x = self.layer(x, attention_mask=bias, position_embeddings=self.rotary_emb(x, pos), use_cache=use_cache,
                       **cache_kwargs(past_key_values))
        return MSDDraftOutput(last_hidden_state=x, cache=past_key_values)

    def logits(self, states, target):
        return target.lm_head(states.to(target.dtype))


class SumObjective(Objective):
    """Feature regression and the token term at every loss position (the EAGLE loss)."""

    architecture = "sum"

    def training_loss(self, target, features, index, n_tokens, train, noise_seed=None, forward=None):
        inputs, _ = self.head.read_pass(features, target)
        inputs["hidden_states"] = feature_noise(inputs["hidden_states"], train, noise_seed)
        out = (forward or self.head)(**inputs).last_hidden_state
        loss, parts = msd_loss(out, features.hidden_states[:, 1:], target.lm_head, None, n_tokens, train.w_feat,
                               train.w_tok, index=index)
        return loss, {k: parts[k] for k in ("feat_sum", "tok_sum", "agree_sum", "n")}

    def training_metrics(self, sums, train):
        n = max(sums["n"], 1.0)
        return {"loss": (train.w_feat * sums["feat_sum"] + train.w_tok * sums["tok_sum"]) / n,
                "top1": sums["agree_sum"] / n}

    def eval_loss(self, target, features, mask):
        inputs, _ = self.head.read_pass(features, target)
        out = self.head(**inputs).last_hidden_state
        return msd_loss(out, features.hidden_states[:, 1:], target.lm_head, mask, n_tokens=1.0)[0]

    def rollout_hits(self, target, features, k):
        inputs, _ = self.head.read_pass(features, target)
        top = lm_head_argmax(target.lm_head, features.hidden_states[:, 1:])
        outs = self.head.unroll(inputs, k)
        return [lm_head_argmax(target.lm_head, s) == shift(top, j, -1) for j, s in enumerate(outs)]


CONF = """# @package draft
architecture: sum
num_hidden_layers: 1
draft_positions: 1d
feature_scale: 0.5
"""


@pytest.fixture
def sum_head(monkeypatch, tmp_path):
    """The head registered for this test only, and the folder holding its conf/head/sum.yaml."""
    monkeypatch.setitem(HEADS, SumHead.architecture, SumHead)
    monkeypatch.setitem(OBJECTIVES, (SumObjective.architecture, SumObjective.kind), SumObjective)
    conf = tmp_path / "conf"
    (conf / "head").mkdir(parents=True)
    (conf / "head" / "sum.yaml").write_text(CONF)
    return conf


def test_a_head_registered_in_a_test_trains_decodes_exports_and_gets_a_card(sum_head, tmp_path):
    from msd_train.hub import detect_layout, formats, load_head
    from msd_train.hub.card import model_card
    from msd_train.hub.vllm import export_vllm

    run = tmp_path / "run"
    r = recipe(["stage='1'", "head=sum", f"hydra.searchpath=[file://{sum_head}]", "train.max_steps=3",
                "train.micro_batch_size=2", "eval.every=1000", "eval.rollout=2", "eval.batch_size=4",
                "data.max_heldout=4", f"run_dir={run}"])
    assert type(r.draft) is SumHead and r.draft.config.feature_scale == 0.5
    before = {k: v.clone() for k, v in r.draft.state_dict().items()}
    losses = []
    while r.step < r.cfg.train.max_steps:
        losses.append(r.train_step()["loss"])
        r.step += 1
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] > 0
    assert any(not torch.equal(before[k], v) for k, v in r.draft.state_dict().items()), "training changed nothing"
    val = r.validate()
    assert 1.0 <= val["sim_tau"] <= 3.0
    r.export("final")

    final = run / "stage1" / "final"
    assert detect_layout(final) == "msd"
    head = load_head(final, r.target)
    assert type(head) is SumHead and head.config.feature_scale == 0.5
    for k, v in r.draft.state_dict().items():
        assert torch.equal(head.state_dict()[k].cpu(), v.cpu()), k

    # lossless decoding with it: the tree and the chain give plain greedy decoding's tokens
    target = r.target
    user = {"role": "user", "content": "<image>\nwhat colour is the circle?"}
    enc = target.encode_prompt([user], [random_image(3)])
    plain = generate(target, None, enc, DecodeConfig(method="ar", max_new_tokens=16, eos_token_ids=()))
    for method in (dict(method="tree", depth=3, top_k=4, total_tokens=12), dict(method="chain", k=3)):
        out = generate(target, head, enc, DecodeConfig(max_new_tokens=16, eos_token_ids=(), **method))
        assert out.tokens == plain.tokens, method["method"]
        assert out.cycles, method["method"]

    # export: this project's folder holds every registered head; vLLM's layout refuses it by name
    summary = formats.get("msd").export(final, tmp_path / "exported", dtype="bf16")
    back = MSDDraftModel.from_pretrained(tmp_path / "exported")
    assert type(back) is SumHead and summary["dtype"] == "torch.bfloat16"
    with pytest.raises(ValueError, match="holds msd, msd3 and dflash heads; the head is an sum head"):
        export_vllm(head, tmp_path / "vllm")

    # the card describes the head by its own class, not as an msd head
    card = model_card(head.config, "me/sum-head", [], num_parameters=head.num_parameters(), dtype="float32")
    assert "# sum draft head for" in card and "| architecture | sum |" in card
    assert "MSD draft head" not in card and "fc bias" not in card
    assert "vLLM cannot serve this head" in card and "an sum head" in card
