"""The training objective of each head architecture, apart from the head (the model).

A head (``msd_train.draft.DraftHead``) says how it reads a target pass and drafts; its
``Objective`` says how it is trained and measured:

    objective = objective_for(head)
    objective.training_loss(target, features, index, n_tokens, train)   (loss, named sums)
    objective.training_metrics(sums, train)                             the logged metrics
    objective.eval_loss(target, features, mask)                         held-out loss sum
    objective.rollout_hits(target, features, k)                         k-step chain hits

The recipe (``recipe.py``) and validation (``validation.py``) call only these. One class
per head architecture, registered under the head's ``architecture`` name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from msd_train.draft.head import pair
from msd_train.draft.loss import TrainVocab, lm_head_argmax, msd_loss

#: head architecture (``DraftHead.architecture``) -> its objective class
OBJECTIVES: dict[str, type[Objective]] = {}


def register_objective(cls):
    """Class decorator: the objective of heads whose architecture is ``cls.architecture``."""
    OBJECTIVES[cls.architecture] = cls
    return cls


def objective_for(head) -> Objective:
    """The training objective of ``head`` (its architecture's)."""
    if head.architecture not in OBJECTIVES:
        raise ValueError(f"no training objective for {head.architecture} heads; known: {sorted(OBJECTIVES)}")
    return OBJECTIVES[head.architecture](head)


class Objective(ABC):
    """How one head is trained and measured (see the module docstring)."""

    architecture: str = ""

    def __init__(self, head):
        self.head = head

    @abstractmethod
    def training_loss(self, target, features, index, n_tokens: float, train, noise=None, forward=None):
        """(loss, sums): the batch's loss, already divided by ``n_tokens`` (the global
        count of loss positions), and detached named sums (with "n") to log.
        ``index``: flat loss positions (``training.loss.loss_index``); ``noise``: applied
        to the target features; ``forward``: the callable that runs the head (the
        DeepSpeed engine in training)."""

    @abstractmethod
    def training_metrics(self, sums: dict[str, float], train) -> dict[str, float]:
        """The logged metrics of one step from its summed ``training_loss`` sums."""

    @abstractmethod
    def eval_loss(self, target, features, mask: torch.Tensor) -> torch.Tensor:
        """The held-out loss summed over ``mask`` (B, L-1) positions."""

    @abstractmethod
    def rollout_hits(self, target, features, k: int) -> list[torch.Tensor]:
        """For each step j < k of the chain anchored at draft position a: (B, L-1) bool,
        True where the head's top-1 token equals the target's (token a+2+j), by anchor."""


@register_objective
class MSDObjective(Objective):
    """Feature regression plus the token term (``draft.loss.msd_loss``), over a train
    vocabulary when one is set (``set_train_vocabulary``)."""

    architecture = "msd"

    def __init__(self, head):
        super().__init__(head)
        self.train_vocab: TrainVocab | None = None

    def set_train_vocabulary(self, target, ids: torch.Tensor | None) -> None:
        """Train the token term over target ids ``ids`` (``draft.train_vocab``; None: the whole
        vocabulary). Their lm_head rows are copied once; the head's saved config records the size."""
        self.train_vocab = None if ids is None else TrainVocab.of(target.lm_head, ids)
        self.head.config.train_vocab = None if ids is None else len(ids)

    def training_loss(self, target, features, index, n_tokens: float, train, noise=None, forward=None):
        head = self.head
        inputs, plan = head.read_pass(features, target)
        if noise is not None:
            inputs["hidden_states"] = noise(inputs["hidden_states"])
        out = (forward or head)(**inputs).last_hidden_state
        out = out if plan is None else plan.expand(out)
        top = features.target_top[:, 1:] if features.target_top is not None else None
        loss, parts = msd_loss(out, features.hidden_states[:, 1:], target.lm_head,
                               None, n_tokens, train.w_feat, train.w_tok, index=index,
                               vocab=self.train_vocab, target_top=top)
        return loss, {"feat_sum": parts["feat_sum"], "tok_sum": parts["tok_sum"], "agree_sum": parts["agree_sum"],
                      "n": parts["n"]}

    def training_metrics(self, sums: dict[str, float], train) -> dict[str, float]:
        n = max(sums["n"], 1.0)
        return {"loss": (train.w_feat * sums["feat_sum"] + train.w_tok * sums["tok_sum"]) / n,
                "feat_loss": sums["feat_sum"] / n, "tok_loss": sums["tok_sum"] / n, "top1": sums["agree_sum"] / n}

    def eval_loss(self, target, features, mask: torch.Tensor) -> torch.Tensor:
        head = self.head
        inputs, plan = head.read_pass(features, target)
        out = head(**inputs).last_hidden_state
        out = out if plan is None else plan.expand(out)
        loss, _ = msd_loss(out, features.hidden_states[:, 1:], target.lm_head, mask, n_tokens=1.0)
        return loss

    def rollout_hits(self, target, features, k: int) -> list[torch.Tensor]:
        """Step 1 reads the target's features, step j > 1 the head's own step j-1
        predictions at every earlier position (a proxy: real drafting keeps true features
        for committed tokens). Step j at position t belongs to the chain anchored at t-j."""
        head = self.head
        inputs, plan = head.read_pass(features, target)
        _, hidden = pair(features.inputs_embeds, features.hidden_states)
        target_top = lm_head_argmax(target.lm_head, features.hidden_states[:, 1:])
        hits, h_in = [], hidden
        for j in range(k):  # over the L-1 slots; a compressed head reads and writes through its SlotMap
            h = h_in.to(inputs["input_embeds"].dtype)
            out = head(**{**inputs, "hidden_states": h if plan is None else plan.compress(h)}).last_hidden_state
            out = out if plan is None else plan.expand(out)
            hit = lm_head_argmax(target.lm_head, out) == target_top  # the argmax of ``logits``, chunked
            by_anchor = torch.zeros_like(hit)
            by_anchor[:, : hit.shape[1] - j] = hit[:, j:]
            hits.append(by_anchor)
            nxt = hidden.clone()  # the next step reads this step's prediction of the following feature
            nxt[:, 1:] = out[:, :-1].to(hidden.dtype)
            h_in = nxt
        return hits


def _shift(x: torch.Tensor, i: int, fill=0) -> torch.Tensor:
    """x[:, t + i] at t (positions past the end: ``fill``)."""
    out = torch.full_like(x, fill)
    out[:, : x.shape[1] - i] = x[:, i:]
    return out


@register_objective
class MSD3Objective(Objective):
    """EAGLE-3's training-time test over the head's unrolled steps (``MSD3DraftModel.unroll``):
    soft cross-entropy over the draft vocabulary at each of ``ttt_steps`` steps, weighted
    ``ttt_decay**i``, at loss positions whose target argmax is in the draft vocabulary."""

    architecture = "msd3"

    def _targets(self, target, features):
        """Target probabilities over the draft vocabulary at each draft position (B, T, N)
        and whether the target's argmax lies in the draft vocabulary (B, T). Only the draft
        vocabulary's rows of the lm_head are applied; the full argmax runs in chunks, unless
        a feature store holds it (``Features.target_top``)."""
        head = self.head
        with torch.no_grad():
            hidden = features.hidden_states[:, 1:]
            lm_head = target.lm_head
            rows = lm_head.weight[head.draft_ids]
            bias = None if getattr(lm_head, "bias", None) is None else lm_head.bias[head.draft_ids]
            probs = torch.nn.functional.linear(hidden.to(rows.dtype), rows, bias).float().softmax(-1)
            if features.target_top is not None:  # a feature store's: -1 only where no loss reads it
                top = features.target_top[:, 1:]
                in_vocab = head.t2d[top.clamp(min=0)] & (top >= 0)
            else:
                in_vocab = head.t2d[lm_head_argmax(lm_head, hidden)]
        return probs, in_vocab

    def _ttt(self, target, features, mask, noise=None, forward=None):
        """Per-step (weighted loss sum, hit count, valid count) of the unrolled head; valid:
        the loss positions whose target token is in the draft vocabulary."""
        head = self.head
        inputs, plan = head.read_pass(features, target, noise=noise)
        probs, in_vocab = self._targets(target, features)
        outs = head.unroll(inputs, head.config.ttt_steps, forward)
        outs = outs if plan is None else [plan.expand(s) for s in outs]
        loss, hits, valid = [], [], []
        for i, states in enumerate(outs):
            logp = torch.log_softmax(head.draft_logits(states).float(), -1)
            ok = _shift(mask.bool() & in_vocab, i, False)
            p = _shift(probs, i)
            loss.append(-(p * logp).sum(-1)[ok].sum() * head.config.ttt_decay ** i)
            hits.append(((logp.argmax(-1) == p.argmax(-1)) & ok).sum())
            valid.append(ok.sum())
        return loss, hits, valid

    def training_loss(self, target, features, index, n_tokens: float, train, noise=None, forward=None):
        B, T = features.hidden_states.shape[0], features.hidden_states.shape[1] - 1
        mask = torch.zeros(B * T, dtype=torch.bool, device=features.hidden_states.device)
        mask[index] = True
        loss, hits, valid = self._ttt(target, features, mask.view(B, T), noise, forward)
        total = torch.stack(loss).sum()
        sums = {"loss_sum": total.detach(), "n": torch.full((), index.numel(), device=total.device)}
        for i, (h, v) in enumerate(zip(hits, valid)):
            sums[f"hit_{i}"], sums[f"valid_{i}"] = h, v
            sums[f"positions_{i}"] = _shift(mask.view(B, T), i, False).sum()  # every loss position step i reads
        return total / max(n_tokens, 1.0), sums

    def training_metrics(self, sums: dict[str, float], train) -> dict[str, float]:
        """``acc_i``: step i's top-1 agreement over the positions whose target token is in the
        draft vocabulary (the positions its loss reads); ``acc_all_i``: over every loss
        position, a target token outside the draft vocabulary counted as a miss (EAGLE-3's
        logged acc; the draft can never propose such a token)."""
        out = {"loss": sums["loss_sum"] / max(sums["n"], 1.0)}
        for i in range(self.head.config.ttt_steps):
            out[f"acc_{i}"] = sums[f"hit_{i}"] / max(sums[f"valid_{i}"], 1.0)
            if f"positions_{i}" in sums:
                out[f"acc_all_{i}"] = sums[f"hit_{i}"] / max(sums[f"positions_{i}"], 1.0)
        out["top1"] = out["acc_0"]
        return out

    def eval_loss(self, target, features, mask: torch.Tensor) -> torch.Tensor:
        loss, _, _ = self._ttt(target, features, mask)
        return torch.stack(loss).sum()

    def rollout_hits(self, target, features, k: int) -> list[torch.Tensor]:
        """The unrolled steps are the chains: step j at anchor a predicts token a+2+j."""
        head = self.head
        inputs, plan = head.read_pass(features, target)
        outs = head.unroll(inputs, k)
        outs = outs if plan is None else [plan.expand(s) for s in outs]
        target_top = lm_head_argmax(target.lm_head, features.hidden_states[:, 1:])
        # the argmax of ``logits``: the draft-vocabulary argmax, mapped to its target id
        return [head.draft_ids[head.draft_logits(s).argmax(-1)] == _shift(target_top, j, -1)
                for j, s in enumerate(outs)]
