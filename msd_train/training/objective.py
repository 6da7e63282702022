"""The training objective of each head architecture, apart from the head (the model).

A head (``msd_train.draft.DraftHead``) says how it reads a target pass and drafts; its
``Objective`` says how it is trained and measured:

    objective = objective_for(head)
    objective.training_loss(target, features, index, n_tokens, train, noise_seed)   (loss, named sums)
    objective.training_metrics(sums, train)                             the logged metrics
    objective.eval_loss(target, features, mask)                         held-out loss sum
    objective.rollout_hits(target, features, k)                         k-step chain hits

The recipe (``recipe.py``) and validation (``validation.py``) call only these. One class
per head architecture and kind of training (``train.objective``), registered under the
head's ``architecture`` name and its ``kind``: ``supervised`` (the head reads the target's
features at every position) or ``on_policy`` (the head is trained at the positions its own
chains reach, reading its own predicted features: ``OnPolicy``).

Feature noise (``train.noise``, ``train.noise_scale``: EAGLE's regulariser on the target
features a head reads in training) is the objective's: ``feature_noise`` draws it from the
seed the recipe gives each micro-batch, and each objective adds it where its head reads
the features (msd: the head's input features; msd3: the k layers' features, before ``fc``).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from msd_train.draft.head import pair, shift
from msd_train.draft.loss import lm_head_argmax, loss_index, msd_loss
from msd_train.draft.vocabulary import VocabSubset
from msd_train.targets.protocol import TargetProtocol

#: (head architecture (``DraftHead.architecture``), kind (``train.objective``)) -> its objective class
OBJECTIVES: dict[tuple[str, str], type[Objective]] = {}
#: the kinds of training ``train.objective`` names
KINDS = ("supervised", "on_policy")


def register_objective(cls):
    """Class decorator: the ``cls.kind`` objective of heads whose architecture is ``cls.architecture``."""
    OBJECTIVES[cls.architecture, cls.kind] = cls
    return cls


def objective_for(head, kind: str = "supervised") -> Objective:
    """The ``kind`` training objective (``train.objective``) of ``head``'s architecture."""
    if (head.architecture, kind) not in OBJECTIVES:
        known = sorted(f"{a}/{k}" for a, k in OBJECTIVES)
        raise ValueError(f"no {kind} training objective for {head.architecture} heads; known: {known}")
    return OBJECTIVES[head.architecture, kind](head)


def feature_noise(features: torch.Tensor, train, seed: int | None) -> torch.Tensor:
    """``features`` plus ``train.noise`` (uniform: amplitude ``noise_scale * 512 / L`` over
    L = ``features.shape[1]`` positions, as EAGLE/MSD; gaussian: std ``noise_scale``; none),
    drawn on the features' device from a generator seeded with ``seed`` (None: no noise)."""
    if seed is None or train.noise == "none" or train.noise_scale == 0:
        return features
    # Drawn on the device (no host-made tensor to copy per micro-batch); on CPU the same
    # stream whatever the device count, on CUDA a different but equally reproducible one.
    g = torch.Generator(device=features.device).manual_seed(seed)
    if train.noise == "uniform":
        amp = train.noise_scale * 512 / features.shape[1]
        n = (torch.rand(features.shape, generator=g, device=features.device) - 0.5) * amp
    elif train.noise == "gaussian":
        n = torch.randn(features.shape, generator=g, device=features.device) * train.noise_scale
    else:
        raise ValueError(f"train.noise={train.noise}: use uniform, gaussian or none")
    return features + n.to(features.device, features.dtype)


class Objective(ABC):
    """How one head is trained and measured (see the module docstring)."""

    architecture: str = ""
    kind: str = "supervised"
    #: ``set_train_vocabulary(target, ids)``: the token term over a subset of the target's
    #: vocabulary (``draft.train_vocab``)
    supports_train_vocabulary: ClassVar[bool] = False

    def __init__(self, head):
        self.head = head

    def set_train_vocabulary(self, target: TargetProtocol, ids: torch.Tensor | None) -> None:
        """Train the token term over target ids ``ids`` (objectives with ``supports_train_vocabulary``)."""
        raise NotImplementedError(f"the {self.architecture} objective trains over no subset of the vocabulary")

    @abstractmethod
    def training_loss(self, target: TargetProtocol, features, index, n_tokens: float, train,
                      noise_seed: int | None = None, forward=None):
        """(loss, sums): the batch's loss, already divided by ``n_tokens`` (the global
        count of loss positions), and detached named sums (with "n") to log.
        ``index``: flat loss positions (``training.loss.loss_index``); ``noise_seed``: the
        seed of this micro-batch's feature noise (``feature_noise``; None: none);
        ``forward``: the callable that runs the head (the DeepSpeed engine in training)."""

    @abstractmethod
    def training_metrics(self, sums: dict[str, float], train) -> dict[str, float]:
        """The logged metrics of one step from its summed ``training_loss`` sums."""

    @abstractmethod
    def eval_loss(self, target: TargetProtocol, features, mask: torch.Tensor) -> torch.Tensor:
        """The held-out loss summed over ``mask`` (B, L-1) positions."""

    @abstractmethod
    def rollout_hits(self, target: TargetProtocol, features, k: int) -> list[torch.Tensor]:
        """For each step j < k of the chain anchored at draft position a: (B, L-1) bool,
        True where the head's top-1 token equals the target's (token a+2+j), by anchor."""


@register_objective
class MSDObjective(Objective):
    """Feature regression plus the token term (``draft.loss.msd_loss``), over a train
    vocabulary when one is set (``set_train_vocabulary``)."""

    architecture = "msd"
    supports_train_vocabulary = True

    def __init__(self, head):
        super().__init__(head)
        self.train_vocab: VocabSubset | None = None

    def set_train_vocabulary(self, target: TargetProtocol, ids: torch.Tensor | None) -> None:
        """Train the token term over target ids ``ids`` (``draft.train_vocab``; None: the whole
        vocabulary), sorted: a ``VocabSubset`` of the target's lm_head; the head's saved config
        records the size."""
        self.train_vocab = None if ids is None else VocabSubset(target.lm_head, ids.sort().values)
        self.head.config.train_vocab = None if ids is None else len(ids)

    def training_loss(self, target: TargetProtocol, features, index, n_tokens: float, train,
                      noise_seed: int | None = None, forward=None):
        head = self.head
        inputs, plan = head.read_pass(features, target)
        inputs["hidden_states"] = feature_noise(inputs["hidden_states"], train, noise_seed)
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

    def eval_loss(self, target: TargetProtocol, features, mask: torch.Tensor) -> torch.Tensor:
        head = self.head
        inputs, plan = head.read_pass(features, target)
        out = head(**inputs).last_hidden_state
        out = out if plan is None else plan.expand(out)
        loss, _ = msd_loss(out, features.hidden_states[:, 1:], target.lm_head, mask, n_tokens=1.0)
        return loss

    def rollout_hits(self, target: TargetProtocol, features, k: int) -> list[torch.Tensor]:
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


def _mask_of(index: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """The (B, T) bool mask whose flat positions are ``index``."""
    mask = torch.zeros(B * T, dtype=torch.bool, device=index.device)
    mask[index] = True
    return mask.view(B, T)


def _rollout_settings(train) -> tuple[int, bool]:
    """(steps, reach-weighted) of an on-policy objective: ``train.rollout_steps`` and
    ``train.rollout_weight`` (``reach`` | ``uniform``)."""
    weighting = getattr(train, "rollout_weight", "reach")
    if weighting not in ("reach", "uniform"):
        raise ValueError(f"train.rollout_weight={weighting!r}: use reach or uniform")
    return int(getattr(train, "rollout_steps", 1)), weighting == "reach"


@register_objective
class MSDOnPolicy(MSDObjective):
    """The head trained on its own drafts (``train.objective=on_policy``). Along the
    target's own tokens, the chain from every anchor runs ``train.rollout_steps`` steps
    (``DraftHead.unroll``: step i reads the head's own step i-1 prediction, as drafting
    does); step i at anchor t is trained toward the target at the position it drafts, t+1+i:
    its feature h_{t+1+i} and its distribution softmax(lm_head h_{t+1+i}) (forward KL; the
    soft cross-entropy differs by the target's entropy, which no weight changes). The
    target's answer is the path, so the target's score of every drafted position is the
    pass's own feature (stored or online): no extra target forward. With
    ``train.rollout_weight=reach`` step i's terms weigh the (detached) probability that the
    chain reaches it, prod_{j<i} sum_x min(p_j, q_j), which is what speculative sampling
    accepts each earlier step with; ``uniform``: 1. A chain stops where the answer does.
    One step is the supervised loss exactly (``MSDObjective``); held-out loss and rollout
    are the supervised ones, so runs compare."""

    kind = "on_policy"

    def training_loss(self, target: TargetProtocol, features, index, n_tokens: float, train,
                      noise_seed: int | None = None, forward=None):
        head = self.head
        steps, reach_weighted = _rollout_settings(train)
        inputs, plan = head.read_pass(features, target)
        inputs["hidden_states"] = feature_noise(inputs["hidden_states"], train, noise_seed)
        outs = head.unroll(inputs, steps, forward)
        truth = features.hidden_states[:, 1:]
        top = features.target_top[:, 1:] if features.target_top is not None else None
        B, T = truth.shape[:2]
        mask = _mask_of(index, B, T)
        chain, reach = mask, torch.ones(B * T, device=truth.device)
        total, sums, loss_sum = 0.0, {"n": torch.full((), index.numel(), device=truth.device)}, 0.0
        for i, out in enumerate(outs):
            out = out if plan is None else plan.expand(out)
            if i:  # anchors whose chain is still in the answer at step i
                chain = chain & shift(mask, i, False)
                idx = loss_index(chain)
            else:
                idx = index
            weight = reach.index_select(0, idx) if i and reach_weighted else None
            loss, parts = msd_loss(out, shift(truth, i), target.lm_head, None, n_tokens, train.w_feat, train.w_tok,
                                   index=idx, vocab=self.train_vocab,
                                   target_top=None if top is None else shift(top, i, -1), weight=weight)
            total = total + loss
            loss_sum = loss_sum + train.w_feat * parts["feat_sum"] + train.w_tok * parts["tok_sum"]
            sums.update({f"feat_{i}": parts["feat_sum"], f"tok_{i}": parts["tok_sum"], f"hit_{i}": parts["agree_sum"],
                         f"valid_{i}": parts["n"],
                         f"reach_{i}": parts["n"].float() if weight is None else weight.sum()})
            if reach_weighted and i + 1 < steps:
                reach = reach.index_put((idx,), reach.index_select(0, idx) * parts["overlap"])
        sums["loss_sum"] = loss_sum
        return total, sums

    def training_metrics(self, sums: dict[str, float], train) -> dict[str, float]:
        """``loss``: all steps' weighted terms per loss position; ``feat_loss``, ``tok_loss``
        and ``top1`` of step 0 (the supervised ones); per step i ``acc_i`` (top-1 agreement
        at the anchors whose chain reaches step i in the answer) and ``reach_i`` (the mean
        weight of its terms)."""
        n = max(sums["n"], 1.0)
        out = {"loss": sums["loss_sum"] / n, "feat_loss": sums["feat_0"] / n, "tok_loss": sums["tok_0"] / n,
               "top1": sums["hit_0"] / n}
        i = 0
        while f"hit_{i}" in sums:
            out[f"acc_{i}"] = sums[f"hit_{i}"] / max(sums[f"valid_{i}"], 1.0)
            out[f"reach_{i}"] = sums[f"reach_{i}"] / max(sums[f"valid_{i}"], 1.0)
            i += 1
        return out


@register_objective
class MSD3Objective(Objective):
    """EAGLE-3's training-time test over the head's unrolled steps (``MSD3DraftModel.unroll``):
    soft cross-entropy over the draft vocabulary at each of ``ttt_steps`` steps, weighted
    ``ttt_decay**i``, at loss positions whose target argmax is in the draft vocabulary."""

    architecture = "msd3"

    def _targets(self, target: TargetProtocol, features):
        """Target probabilities over the draft vocabulary at each draft position (B, T, N)
        and whether the target's argmax lies in the draft vocabulary (B, T). Only the draft
        vocabulary's rows of the lm_head are applied (a ``VocabSubset``); the full argmax
        runs in chunks, unless a feature store holds it (``Features.target_top``)."""
        head = self.head
        with torch.no_grad():
            hidden = features.hidden_states[:, 1:]
            lm_head = target.lm_head
            rows = VocabSubset(lm_head, head.draft_ids)
            probs = rows(hidden.to(rows.weight.dtype)).float().softmax(-1)
            if features.target_top is not None:  # a feature store's: -1 only where no loss reads it
                top = features.target_top[:, 1:]
                in_vocab = head.t2d[top.clamp(min=0)] & (top >= 0)
            else:
                in_vocab = head.t2d[lm_head_argmax(lm_head, hidden)]
        return probs, in_vocab

    def _ttt(self, target: TargetProtocol, features, mask, train=None, noise_seed=None, forward=None, steps=None,
             reach_weighted=False):
        """Per-step (weighted loss sum, hit count, valid count) of the unrolled head; valid:
        the loss positions whose target token is in the draft vocabulary. ``noise_seed``:
        ``train``'s feature noise on the k layers' features the head reads (before ``fc``).
        ``steps``: None, ``ttt_steps``; step i weighs ``ttt_decay**i``, or with
        ``reach_weighted`` the (detached) probability that a sampled chain reaches it
        (``MSD3OnPolicy``)."""
        head = self.head
        if noise_seed is not None and features.layer_states is not None:
            # the noise of the L-1 draft positions' features (``pair`` reads positions 0..L-2):
            # drawn over exactly those, the last position's features left as they are
            states = features.layer_states
            noised = feature_noise(states[:, :-1], train, noise_seed)
            features = dataclasses.replace(features, layer_states=torch.cat([noised, states[:, -1:]], 1))
        inputs, plan = head.read_pass(features, target)
        probs, in_vocab = self._targets(target, features)
        outs = head.unroll(inputs, head.config.ttt_steps if steps is None else steps, forward)
        outs = outs if plan is None else [plan.expand(s) for s in outs]
        loss, hits, valid = [], [], []
        reach = torch.ones(probs.shape[:2], device=probs.device)
        for i, states in enumerate(outs):
            logp = torch.log_softmax(head.draft_logits(states).float(), -1)
            ok = shift(mask.bool() & in_vocab, i, False)
            p = shift(probs, i)
            per = -(p * logp).sum(-1)
            if reach_weighted:
                loss.append((per * reach)[ok].sum())
                reach = reach * torch.minimum(p, logp.detach().exp()).sum(-1)
            else:
                loss.append(per[ok].sum() * head.config.ttt_decay ** i)
            hits.append(((logp.argmax(-1) == p.argmax(-1)) & ok).sum())
            valid.append(ok.sum())
        return loss, hits, valid

    def training_loss(self, target: TargetProtocol, features, index, n_tokens: float, train,
                      noise_seed: int | None = None, forward=None):
        B, T = features.hidden_states.shape[0], features.hidden_states.shape[1] - 1
        mask = _mask_of(index, B, T)
        loss, hits, valid = self._ttt(target, features, mask, train, noise_seed, forward, *self._steps(train))
        total = torch.stack(loss).sum()
        sums = {"loss_sum": total.detach(), "n": torch.full((), index.numel(), device=total.device)}
        for i, (h, v) in enumerate(zip(hits, valid)):
            sums[f"hit_{i}"], sums[f"valid_{i}"] = h, v
            sums[f"positions_{i}"] = shift(mask, i, False).sum()  # every loss position step i reads
        return total / max(n_tokens, 1.0), sums

    def _steps(self, train) -> tuple[int | None, bool]:
        """(steps, reach-weighted) of the training-time test: ``ttt_steps``, decayed."""
        return None, False

    def training_metrics(self, sums: dict[str, float], train) -> dict[str, float]:
        """``acc_i``: step i's top-1 agreement over the positions whose target token is in the
        draft vocabulary (the positions its loss reads); ``acc_all_i``: over every loss
        position, a target token outside the draft vocabulary counted as a miss (EAGLE-3's
        logged acc; the draft can never propose such a token)."""
        out = {"loss": sums["loss_sum"] / max(sums["n"], 1.0)}
        i = 0
        while f"hit_{i}" in sums:
            out[f"acc_{i}"] = sums[f"hit_{i}"] / max(sums[f"valid_{i}"], 1.0)
            if f"positions_{i}" in sums:
                out[f"acc_all_{i}"] = sums[f"hit_{i}"] / max(sums[f"positions_{i}"], 1.0)
            i += 1
        out["top1"] = out["acc_0"]
        return out

    def eval_loss(self, target: TargetProtocol, features, mask: torch.Tensor) -> torch.Tensor:
        loss, _, _ = self._ttt(target, features, mask)
        return torch.stack(loss).sum()

    def rollout_hits(self, target: TargetProtocol, features, k: int) -> list[torch.Tensor]:
        """The unrolled steps are the chains: step j at anchor a predicts token a+2+j."""
        head = self.head
        inputs, plan = head.read_pass(features, target)
        outs = head.unroll(inputs, k)
        outs = outs if plan is None else [plan.expand(s) for s in outs]
        target_top = lm_head_argmax(target.lm_head, features.hidden_states[:, 1:])
        # the argmax of ``logits``: the draft-vocabulary argmax, mapped to its target id
        return [head.draft_ids[head.draft_logits(s).argmax(-1)] == shift(target_top, j, -1)
                for j, s in enumerate(outs)]


@register_objective
class MSD3OnPolicy(MSD3Objective):
    """The training-time test as ``train.objective=on_policy`` runs it (``MSDOnPolicy``'s
    rule): ``train.rollout_steps`` steps, each weighted by the probability that the chain
    reaches it (``train.rollout_weight=reach``) or 1 (``uniform``) instead of ``ttt_decay**i``."""

    kind = "on_policy"

    def _steps(self, train) -> tuple[int | None, bool]:
        return _rollout_settings(train)
