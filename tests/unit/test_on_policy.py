"""On-policy training (``train.objective=on_policy``, stage 3): the head's chains along the
target's answer, each step trained toward the target where it drafts.

A tiny random LLaVA with one image prompt and a few text tokens after it; the checks go
through the objective as the recipe calls it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from builders import random_image

from msd_train.draft import HEADS
from msd_train.draft.loss import loss_index
from msd_train.draft.vocabulary import most_frequent
from msd_train.targets import Features
from msd_train.training.objective import MSDOnPolicy, objective_for

pytestmark = pytest.mark.usefixtures("one_thread")


def train_cfg(**kw):
    return SimpleNamespace(**{"w_feat": 1.0, "w_tok": 0.1, "rollout_steps": 1, "rollout_weight": "reach", **kw})


def make_head(architecture, target, **overrides):
    torch.manual_seed(0)
    cls = HEADS[architecture]
    config = cls.config_class.from_target_config(target.config, target.name, target_vocab_size=target.vocab_size,
                                                 **overrides)
    head = cls(config)
    with torch.no_grad():  # non-trivial norms, and a head that is not uniform over the vocabulary
        for name, p in head.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
    return head.train()


def a_pass(target, head, n_text: int = 12):
    """The target over an image prompt and ``n_text`` text tokens after it (the answer)."""
    user = {"role": "user", "content": "<image>\nwhat colour is the circle?"}
    enc = target.encode_prompt([user], [random_image(3)])
    extra = torch.arange(5, 5 + n_text)
    with torch.no_grad():
        embeds = torch.cat([target.embed(enc.input_ids[None], enc.pixel), target.embed_tokens(extra[None])], 1)
        pos, deltas = target.position_ids(enc.input_ids[None], None, enc.pixel)
        pos = torch.cat([pos, target.continue_positions(len(enc.input_ids), n_text, deltas)], -1)
        hidden, _, states = target.run_for_head(embeds, pos, layers=head.feature_layers)
    visual = torch.cat([enc.input_ids == target.image_token_id, torch.zeros_like(extra, dtype=torch.bool)])
    feats = Features(embeds, hidden, visual[None], pos, deltas, states if head.feature_layers else None)
    T = embeds.shape[1] - 1
    mask = torch.zeros(1, T, dtype=torch.bool)
    mask[0, T - n_text + 1:] = True  # the draft positions whose token t+2 is in the answer
    return feats, mask


def grads(head):
    return {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("train_vocab", [None, 40])
def test_one_step_is_the_supervised_loss(llava_target, train_vocab):
    """k=1: the on-policy loss, its parts and its gradients are the supervised ones; its token
    term is the forward KL from the target at the same positions plus the target's entropy."""
    target = llava_target
    head = make_head("msd", target)
    feats, mask = a_pass(target, head)
    index = loss_index(mask)
    runs = []
    for kind in ("supervised", "on_policy"):
        objective = objective_for(head, kind)
        if train_vocab:
            objective.set_train_vocabulary(target, most_frequent(torch.arange(target.vocab_size).float(), train_vocab))
        head.zero_grad()
        loss, sums = objective.training_loss(target, feats, index, 7.0, train_cfg())
        loss.backward()
        runs.append((loss.detach(), sums, grads(head)))
    (sup, s_sums, s_grads), (onp, o_sums, o_grads) = runs
    assert isinstance(objective, MSDOnPolicy)
    assert torch.equal(sup, onp)
    assert torch.equal(s_sums["tok_sum"], o_sums["tok_0"]) and torch.equal(s_sums["feat_sum"], o_sums["feat_0"])
    # the same loss; step 0 runs under an explicit causal mask (the later steps read its cache): equal to rounding
    assert all(torch.allclose(s_grads[n], o_grads[n], rtol=1e-5, atol=1e-7) for n in s_grads)
    if train_vocab is None:  # by hand: sum over the loss positions of KL(p_target || p_draft) + H(p_target)
        with torch.no_grad():
            inputs = head.target_inputs(feats, target)
            out = head(**inputs).last_hidden_state[mask]
            logp = torch.log_softmax(target.lm_head(feats.hidden_states[:, 1:][mask]).float(), -1)
            logq = torch.log_softmax(head.logits(out, target).float(), -1)
            kl = (logp.exp() * (logp - logq)).sum(-1)
            entropy = -(logp.exp() * logp).sum(-1)
        assert torch.allclose(o_sums["tok_0"], (kl + entropy).sum(), rtol=1e-5)


def test_unroll_is_the_chain_drafting_runs(llava_target):
    """Step i at anchor t of ``unroll`` is what drafting computes from t with a cache: the
    target's features committed up to t, then the head's own states along the answer's tokens."""
    from transformers import DynamicCache

    target = llava_target
    head = make_head("msd", target).eval()
    feats, mask = a_pass(target, head)
    inputs = head.target_inputs(feats, target)
    steps = 3
    with torch.no_grad():
        outs = head.unroll(inputs, steps)
        T = inputs["input_embeds"].shape[1]
        for t in (T - 10, T - 6):
            cache = DynamicCache()
            first = {k: (v[..., : t + 1] if k == "position_ids" else v[:, : t + 1]) for k, v in inputs.items()
                     if v is not None}
            state = head(**first, past_key_values=cache, use_cache=True).last_hidden_state[:, -1:]
            assert torch.allclose(state, outs[0][:, t:t + 1], atol=1e-5)
            for i in range(1, steps):
                state = head.step(inputs["input_embeds"][:, t + i:t + i + 1], state,
                                  position_ids=inputs["position_ids"][..., t:t + 1] + i, past_key_values=cache)
                assert torch.allclose(state, outs[i][:, t:t + 1], atol=1e-5), (t, i)


def test_later_steps_weigh_the_probability_of_reaching_them(llava_target):
    """k=3: every step adds terms; weighted by reach (each a probability below 1) they weigh
    less than uniformly; metrics name each step."""
    target = llava_target
    head = make_head("msd", target)
    feats, mask = a_pass(target, head)
    index = loss_index(mask)
    objective = objective_for(head, "on_policy")
    with torch.no_grad():
        one, _ = objective.training_loss(target, feats, index, 7.0, train_cfg())
        uniform, u_sums = objective.training_loss(target, feats, index, 7.0, train_cfg(rollout_steps=3,
                                                                                       rollout_weight="uniform"))
        reach, r_sums = objective.training_loss(target, feats, index, 7.0, train_cfg(rollout_steps=3))
    assert one < reach < uniform
    assert u_sums["valid_2"] == mask.sum() - 2  # a chain stops where the answer does
    metrics = objective.training_metrics({k: float(v) for k, v in r_sums.items()}, train_cfg(rollout_steps=3))
    assert metrics["reach_0"] == 1.0 and 0 < metrics["reach_2"] < metrics["reach_1"] < 1.0
    assert {"acc_0", "acc_1", "acc_2", "loss", "top1", "feat_loss", "tok_loss"} <= set(metrics)


def test_msd3_on_policy_is_its_training_time_test_reweighted(llava_target):
    """msd3 through the same switch: uniform weights over ttt_steps steps equal the
    training-time test with no decay."""
    target = llava_target
    head = make_head("msd3", target, draft_vocab_size=target.vocab_size, ttt_steps=3, ttt_decay=1.0)
    feats, mask = a_pass(target, head)
    index = loss_index(mask)
    with torch.no_grad():
        ttt, _ = objective_for(head).training_loss(target, feats, index, 7.0, train_cfg())
        onp, sums = objective_for(head, "on_policy").training_loss(
            target, feats, index, 7.0, train_cfg(rollout_steps=3, rollout_weight="uniform"))
        reach, _ = objective_for(head, "on_policy").training_loss(target, feats, index, 7.0,
                                                                  train_cfg(rollout_steps=3))
    assert torch.allclose(ttt, onp) and reach < onp and "hit_2" in sums
