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
from msd_train.formatting import with_article
from msd_train.targets.protocol import TargetProtocol

#: (head architecture (``DraftHead.architecture``), kind (``train.objective``)) -> its objective class
OBJECTIVES: dict[tuple[str, str], type[Objective]] = {}
#: the kinds of training ``train.objective`` names
KINDS = ("supervised", "on_policy")


def register_objective(cls):
    """Class decorator: the ``cls.kind`` objective of heads whose architecture is ``cls.architecture``."""
    OBJECTIVES[cls.architecture, cls.kind] = cls
    return cls


def objective_refusal(architecture: str, kind: str) -> str | None:
    """Why ``train.objective=kind`` cannot train an ``architecture`` head (None: it can), with the fix."""
    if (architecture, kind) in OBJECTIVES:
        return None
    own = sorted(k for a, k in OBJECTIVES if a == architecture)
    if not own:
        heads = sorted({a for a, _ in OBJECTIVES})
        return f"draft.architecture={architecture} is no head architecture; use head={' or head='.join(heads)}"
    others = sorted(a for a, k in OBJECTIVES if k == kind)
    fix = f"use train.objective={own[0]}"
    if kind == "on_policy":
        fix += " (a stage-3 launch: train stages 1 and 2 only)"
    if others:
        fix += f", or a head with one: head={' or head='.join(others)}"
    return f"train.objective={kind}: {architecture} heads have no {kind} objective (theirs: {', '.join(own)}); {fix}"


def train_vocab_refusal(architecture: str, kind: str, train_vocab) -> str | None:
    """Why ``draft.train_vocab`` cannot restrict the token loss of an ``architecture`` head's ``kind``
    objective (None: it can, or it is unset), with the fix."""
    objective = OBJECTIVES.get((architecture, kind))
    if train_vocab is None or objective is None or objective.supports_train_vocabulary:
        return None
    return (f"draft.train_vocab={train_vocab}: {with_article(architecture)} head trains over its own draft "
            "vocabulary (draft.draft_vocab_size); drop draft.train_vocab (draft.train_vocab=null where an "
            "experiment sets it)")


def objective_for(head, kind: str = "supervised") -> Objective:
    """The ``kind`` training objective (``train.objective``) of ``head``'s architecture."""
    why = objective_refusal(head.architecture, kind)
    if why:
        raise ValueError(why)
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

    def rollout_hits_in(self, target: TargetProtocol, features, k: int, mask: torch.Tensor) -> list[torch.Tensor]:
        """``rollout_hits`` where only the chains anchored in ``mask`` (B, L-1) count: a head
        whose chains cost by anchor may leave the others False. By default, every anchor's."""
        return self.rollout_hits(target, features, k)


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


@register_objective
class DFlashObjective(Objective):
    """DFlash's block training (``draft/dflash.py``): anchors sampled among the loss positions
    (inside the answers; up to ``draft.num_anchors`` per sequence, drawn from the micro-batch's
    seed), each anchor's block run from its root against the context before it, and block
    position i's soft cross-entropy to the target's distribution at the token it proposes
    weighted exp(-(i-1)/``draft.loss_decay_gamma``): earlier positions, which every accepted
    block needs, weigh more. Summed over the loss terms and divided by the global count of
    loss positions, as every objective here. Over a train vocabulary when one is set
    (``draft.train_vocab``, as msd). Held-out loss and rollout read every anchor."""

    architecture = "dflash"
    supports_train_vocabulary = True
    #: anchors whose blocks one held-out forward runs at once (memory: B x anchors x block x context)
    EVAL_ANCHORS = 256

    def __init__(self, head):
        super().__init__(head)
        self.train_vocab: VocabSubset | None = None

    def set_train_vocabulary(self, target: TargetProtocol, ids: torch.Tensor | None) -> None:
        """As ``MSDObjective.set_train_vocabulary``: the token loss over target ids ``ids``."""
        self.train_vocab = None if ids is None else VocabSubset(target.lm_head, ids.sort().values)
        self.head.config.train_vocab = None if ids is None else len(ids)

    def _blocks(self, inputs: dict, anchors: torch.Tensor, forward=None) -> torch.Tensor:
        """The blocks of ``anchors`` (B, N) draft positions: (B, N, S, H) states, each block
        seeing the context entries 0 .. its anchor (the context strictly before its root)."""
        H = inputs["input_embeds"].shape[-1]
        roots = inputs["input_embeds"].gather(1, anchors[..., None].expand(-1, -1, H))
        pos = inputs["position_ids"]
        pos = pos.gather(-1, anchors.expand(*pos.shape[:-2], *anchors.shape))
        T = inputs["hidden_states"].shape[1]
        seen = torch.arange(T, device=anchors.device)[None, None, :] <= anchors[..., None]
        return (forward or self.head)(input_embeds=roots, hidden_states=inputs["hidden_states"], position_ids=pos,
                                      context_position_ids=inputs["context_position_ids"],
                                      context_mask=seen).last_hidden_state

    def _terms(self, features, anchors: torch.Tensor, ok: torch.Tensor, mask: torch.Tensor):
        """Where each block's proposals are trained: (the target features of the tokens block
        position i = 1 .. S-1 proposes, (B, N, S-1, H): h_{a+i}; valid (B, N, S-1): a loss
        position (``mask``, draft position a+i-1) inside the pass; the store's target top-1 there)."""
        S, L = self.head.config.block_size, features.hidden_states.shape[1]
        at = anchors[..., None] + torch.arange(1, S, device=anchors.device)  # h_{a+i}: the token a+1+i
        inside = at <= L - 1
        at = at.clamp(max=L - 1)
        B, N = anchors.shape
        hidden = features.hidden_states.gather(1, at.reshape(B, -1, 1).expand(-1, -1, features.hidden_states.shape[-1]))
        valid = inside & ok[..., None] & mask.gather(1, (at - 1).reshape(B, -1)).view(B, N, S - 1)
        top = None
        if features.target_top is not None:
            top = features.target_top.gather(1, at.reshape(B, -1)).view(B, N, S - 1)
        return hidden.view(B, N, S - 1, -1), valid, top

    def _loss(self, target, features, inputs, anchors, ok, mask, n_tokens, forward=None):
        """(loss / n_tokens, parts of ``msd_loss``, each selected term's block position - 1)."""
        S, gamma = self.head.config.block_size, self.head.config.loss_decay_gamma
        out = self._blocks(inputs, anchors, forward)[:, :, 1:]
        hidden, valid, top = self._terms(features, anchors, ok, mask)
        index = loss_index(valid)
        offset = index % (S - 1)  # block position i - 1 of each term
        weight = torch.exp(-offset.float() / gamma)
        loss, parts = msd_loss(out.flatten(1, 2), hidden.flatten(1, 2), target.lm_head, None, n_tokens, 0.0, 1.0,
                               index=index, vocab=self.train_vocab,
                               target_top=None if top is None else top.flatten(1, 2), weight=weight)
        return loss, parts, offset

    def _anchors(self, mask: torch.Tensor, seed: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to ``num_anchors`` draft positions per row, drawn among ``mask``'s, in order: N =
        min(num_anchors, the most loss positions of a row) slots, those past a row's count marked
        not ok. The slots beyond every row's count would be drawn from padding and prompts and
        masked out: not running their blocks leaves the loss as it is (one host read a step)."""
        B, T = mask.shape
        n = max(min(self.head.config.num_anchors, int(mask.sum(1).max())), 1)
        g = None if seed is None else torch.Generator(device=mask.device).manual_seed(seed)
        score = torch.rand(B, T, generator=g, device=mask.device).masked_fill(~mask, 2.0)
        anchors = score.topk(n, dim=1, largest=False).indices.sort(dim=1).values
        return anchors, mask.gather(1, anchors)

    def training_loss(self, target: TargetProtocol, features, index, n_tokens: float, train,
                      noise_seed: int | None = None, forward=None):
        head = self.head
        if noise_seed is not None and features.layer_states is not None:
            states = features.layer_states  # the noise of the context's features (positions 0 .. L-2)
            noised = feature_noise(states[:, :-1], train, noise_seed)
            features = dataclasses.replace(features, layer_states=torch.cat([noised, states[:, -1:]], 1))
        B, T = features.hidden_states.shape[0], features.hidden_states.shape[1] - 1
        mask = _mask_of(index, B, T)
        inputs, _ = head.read_pass(features, target)
        anchors, ok = self._anchors(mask, None if noise_seed is None else noise_seed ^ 0x5EED)
        loss, parts, offset = self._loss(target, features, inputs, anchors, ok, mask, n_tokens, forward)
        S = head.config.block_size
        hits = torch.zeros(S - 1, device=loss.device).index_add_(0, offset, parts["hit"].float())
        valid = torch.bincount(offset, minlength=S - 1).float()
        sums = {"loss_sum": parts["tok_sum"], "n": torch.full((), index.numel(), device=loss.device)}
        for i in range(S - 1):
            sums[f"hit_{i}"], sums[f"valid_{i}"] = hits[i], valid[i]
        return loss, sums

    def training_metrics(self, sums: dict[str, float], train) -> dict[str, float]:
        """``loss``: the weighted terms per loss position; ``acc_i``: the top-1 agreement of
        block position i+1 (the i-th proposal) where it is trained; ``top1``: acc_0."""
        out = {"loss": sums["loss_sum"] / max(sums["n"], 1.0)}
        i = 0
        while f"hit_{i}" in sums:
            out[f"acc_{i}"] = sums[f"hit_{i}"] / max(sums[f"valid_{i}"], 1.0)
            i += 1
        out["top1"] = out["acc_0"]
        return out

    def _chunks(self, T: int, device) -> list[torch.Tensor]:
        step = self.EVAL_ANCHORS
        return [torch.arange(s, min(s + step, T), device=device) for s in range(0, T, step)]

    def eval_loss(self, target: TargetProtocol, features, mask: torch.Tensor) -> torch.Tensor:
        """The weighted terms of every anchor in ``mask`` (B, L-1), summed (blocks run only at
        the positions some row has in ``mask``: the others add nothing)."""
        inputs, _ = self.head.read_pass(features, target)
        B, T = mask.shape
        mask = mask.bool()
        columns = mask.any(0).nonzero().flatten()
        total = torch.zeros((), device=mask.device)
        for chunk in self._chunks(columns.numel(), mask.device):
            anchors = columns[chunk][None].expand(B, -1)
            loss, _, _ = self._loss(target, features, inputs, anchors, mask.gather(1, anchors), mask, 1.0)
            total = total + loss.detach()
        return total

    def rollout_hits(self, target: TargetProtocol, features, k: int) -> list[torch.Tensor]:
        """The block is the chain: step j at anchor a is block position j+1, which proposes
        token a+2+j; steps at or past the block's end never hit."""
        T = features.hidden_states.shape[1] - 1
        return self.rollout_hits_in(target, features, k, torch.ones(1, T, dtype=torch.bool))

    def rollout_hits_in(self, target: TargetProtocol, features, k: int, mask: torch.Tensor) -> list[torch.Tensor]:
        """``rollout_hits`` with blocks run only at the anchors some row has in ``mask`` (a
        block per anchor is the cost; the held-out split's prompts hold most positions)."""
        head = self.head
        inputs, _ = head.read_pass(features, target)
        top = lm_head_argmax(target.lm_head, features.hidden_states[:, 1:])  # top[:, t]: token t+2
        B, T = top.shape
        S = head.config.block_size
        hits = [torch.zeros(B, T, dtype=torch.bool, device=top.device) for _ in range(k)]
        columns = mask.to(top.device).bool().any(0).nonzero().flatten()
        for chunk in self._chunks(columns.numel(), top.device):
            part = columns[chunk]
            out = self._blocks(inputs, part[None].expand(B, -1))
            drafted = lm_head_argmax(target.lm_head, out[:, :, 1:])  # (B, n, S-1)
            for j in range(min(k, S - 1)):
                at = part + j
                inside = at < T
                hit = drafted[:, :, j] == top[:, at.clamp(max=T - 1)]
                hits[j][:, part] = hit & inside
        return hits
