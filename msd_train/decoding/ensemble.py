"""Ensemble drafting with one MSD head over several input variants of the prompt.

The variants of one prompt are drafted as one batch of rows through the same head:

    M   the prompt as the head was trained on it (the visual block included)
    T   the visual block left out of the head's prefix (its prefill skips image positions)
    P   each image's visual block average-pooled 2x2 over its patch grid (a quarter of
        the positions), embeddings and target features alike; the grid comes from the
        target (LLaVA: the vision tower's patch grid; Qwen2-VL: ``image_grid_thw``)
    C   each image's tokens replaced by a caption supplied with the prompt. The head needs
        target features for the caption tokens, which the target never read with the
        image: one extra, text-only target forward over the captioned prompt gives them
        (at prefill, counted in its time).

Every row keeps the target's position ids of the tokens it keeps (a pooled token takes the
position of its window's top-left patch; the captioned prompt's positions are shifted so
it ends where the target's prompt ends: RoPE only sees distances, so the row's own
attention is unchanged), so after the prompt all rows share the same positions. Rows are
left-padded to a common length; the padding is masked by an additive per-row key bias.

``EnsembleDrafter`` is a ``drafter.Drafter`` that wraps a ``HeadDrafter`` whose cache rows
are the variants: the decoder sees the same interface (prefill, draft a block), and the head
is read only through its own (``target_inputs``, ``forward``, ``step``, ``logits``). What
the target said about the last block comes with the pending features (``Pending.verified``).

Host reads: ``ibed`` adds none per cycle to the decoder's one (the active rows are read
once); ``tabed`` adds three (the active rows of each block's new weights, and two
data-sized selections of the verified nodes whose children were drafted, in
``record_verified``), measured with ``lab.transfers.HostReads``.

At each draft step (chain or tree, see ``drafter.draft_chain`` / ``draft_tree``) the
rows' next-token probabilities are mixed, ``q = sum_r w_r p_r``, and every row continues
from the same tokens: the argmax of q or a draw from it (chain), or q's top-k (tree).
Under sampling q is also what the acceptance test divides by, so decoding stays lossless.
``ibed`` uses equal weights; ``tabed`` picks, before each draft block, the weights on the
0.1-step simplex that make q's argmax agree with the target's argmax at the most recently
verified positions (``tabed_window``: a count, or ``all``, the whole answer so far), ties
broken by the smallest KL(target || q), computed on q clamped at 1e-30 so that a grid
point giving a target token zero mass scores a large finite KL (TABED's own code takes
log 0 there and its comparison sees NaN/inf). Each verified position's
score for every grid point is computed once, when it is verified, and the window's
scores are summed per block (the search costs a sum, not a pass over the window).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools

import torch

from msd_train.checks import VARIANTS  # the settings' choices live with their checks (checks.check_decoding)
from msd_train.decoding.drafter import Drafter, HeadDrafter, Pending, PromptPass, propose
from msd_train.decoding.sampling import SamplingParams, logits_to_probs
from msd_train.decoding.tree import Tree
from msd_train.draft import attention_bias, draft_position_ids, draft_rope_deltas
from msd_train.targets import Features, TargetProtocol


class EnsembleDrafter(Drafter):
    """One head over several input variants of the prompt, one batch row each. It wraps a
    ``HeadDrafter`` (``single``), whose cache holds the R rows and whose step runs them;
    the ensemble adds the rows' prompts (``prefill``), their padding (``head``), their
    mixture (``distribution``) and, for TABED, the weights learnt from verification."""

    def __init__(self, draft, variants, mode: str, window: int | str, captions: list[str] | None = None):
        if getattr(draft, "feature_layers", None) is not None:
            raise ValueError(
                f"ensemble drafting ({mode}) builds its input variants from the target's last layer, and this "
                f"{draft.architecture} head reads the inputs of target layers {draft.feature_layers}; decode it "
                f"with decoding.method=tree or chain and no ensemble")
        # the variants are built from the whole prompt
        if getattr(getattr(draft, "config", None), "visual_compression", "none") != "none":
            raise ValueError(
                f"ensemble drafting ({mode}) builds its input variants from the uncompressed prompt, and this head "
                f"compresses images (visual_compression={draft.config.visual_compression}); decode it with "
                f"decoding.method=tree or chain and no ensemble")
        self.single = HeadDrafter(draft)
        self.draft = draft
        self.variants = tuple(variants)
        self.mode = mode  # ibed | tabed
        #: tabed: verified positions the weight search looks back over; None ("all"): the
        #: whole answer so far, as TABED's own code searches
        self.window = None if window == "all" else int(window)
        self.captions = captions  # variant C: one per image of the prompt
        self.weights: torch.Tensor | None = None  # (R,) the mixture weights of the current draft block
        #: (R, capacity) additive key bias: dtype-min at each row's left padding, 0 elsewhere
        self.pad_bias: torch.Tensor | None = None
        self.grid: torch.Tensor | None = None  # tabed: (G, R) the candidate weights
        #: tabed history, oldest first, one row per verified position: whether each grid
        #: point's mixture argmax matched the target's (N, G), and KL(target || mixture) (N, G)
        self.history_match: torch.Tensor | None = None
        self.history_kl: torch.Tensor | None = None
        #: the rows with a non-zero weight this block: only their logits enter the mixture
        self.active: torch.Tensor | None = None
        #: tabed, the current block: the rows' head outputs of every mixing call, in call order
        #: ((R, T, H) each; their distributions are computed only for the verified nodes), and
        #: for each tree node the index of its children's distribution in their concatenation
        #: along T (-1: the node was not expanded)
        self.block_out: list[torch.Tensor] = []
        self.block_index: torch.Tensor | None = None

    # the head's cache and positions are the single head drafter's (rows are never compressed)
    cache = property(lambda self: self.single.cache)
    rope_deltas = property(lambda self: self.single.rope_deltas)
    merged = property(lambda self: self.single.merged)

    @property
    def rows(self) -> int:
        return len(self.variants)

    def clone(self, workspace) -> EnsembleDrafter:
        out = copy.copy(self)
        out.single = self.single.clone(workspace)
        out.weights, out.block_out = self.weights.clone(), list(self.block_out)
        return out

    def prefill(self, target: TargetProtocol, prompt: PromptPass, workspace, capacity: int) -> None:
        _prefill_rows(self, target, prompt, workspace, capacity)

    def draft_block(self, target: TargetProtocol, pending: Pending, config,
                    generator: torch.Generator | None = None) -> Tree:
        """What the target said about the last block (TABED's history: ``record_verified``),
        the weights for this block (``begin_block``), then the block drafted over every row;
        the tree's ``children_from`` says which mixing call each node's children came from."""
        if pending.verified is not None:
            path, logits = pending.verified
            self.record_verified(path, logits, functools.partial(self.draft.logits, target=target))
        self.begin_block()
        tree = propose(self, target, pending, config, generator)
        self.block_index = tree.children_from
        return tree

    def head(self, embeds: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, queries: torch.Tensor
             ) -> torch.Tensor:
        """``embeds`` (1, T, H) and ``pos`` (batch 1) are shared by the rows, ``hidden`` is
        each row's (R, T, H) or shared (1, T, H); the rows' left padding is masked."""
        rows = self.rows
        if rows > 1:
            embeds, hidden = embeds.expand(rows, -1, -1), hidden.expand(rows, -1, -1)
            pos = pos.expand(*pos.shape[:-2], rows, pos.shape[-1])
        mask = self.single.mask(queries)
        if self.pad_bias is not None:
            mask = mask + self.key_bias()[..., : mask.shape[-1]]
        return self.single.run(embeds, hidden, pos, queries, mask)

    def key_bias(self) -> torch.Tensor:
        """(R, 1, 1, capacity): ``pad_bias`` over the cache's capacity (it may have grown)."""
        if self.pad_bias.shape[1] < self.cache.capacity:
            grown = self.pad_bias.new_zeros(self.rows, self.cache.capacity)
            grown[:, : self.pad_bias.shape[1]] = self.pad_bias
            self.pad_bias = grown
        return self.pad_bias[:, None, None, :]

    # ----- mixing -----------------------------------------------------------------------

    def distribution(self, target: TargetProtocol, out: torch.Tensor, sampling: SamplingParams,
                     log: bool = False) -> torch.Tensor:
        """The rows' mixture (T, V), or its log (what a tree ranks by: the mixture of the
        rows' raw distributions when ``sampling.rank_by`` is raw)."""
        q = self.mix(out.to(target.dtype), functools.partial(self.draft.logits, target=target), sampling, raw=log and sampling.rank_by == "raw")
        return q.log() if log else q

    def mix(self, out: torch.Tensor, lm_head, sampling: SamplingParams, raw: bool = False) -> torch.Tensor:
        """The rows' mixture q (T, V) after their head outputs ``out`` (R, T, H): warped
        probabilities when sampling, plain softmax when greedy or ``raw`` (the argmax and
        top-k of a mixture need the rows' full distributions, not their one-hot argmaxes).
        Rows whose weight is zero (TABED often picks a vertex of the simplex) cost no lm_head."""
        if self.mode == "tabed":
            self.block_out.append(out)
        if self.active is None:  # a host read (nonzero), once per change of weights: TABED's blocks
            self.active = self.weights.nonzero().flatten()
        active = None if self.active.numel() == self.rows else self.active
        logits = lm_head(out if active is None else out[active]).float()
        rows = logits.softmax(-1) if sampling.greedy or raw else logits_to_probs(logits, sampling)
        return torch.einsum("r,rtv->tv", self.weights if active is None else self.weights[active], rows)

    def begin_block(self) -> None:
        """TABED: the weights for the next draft block, from the verified history."""
        self.block_out, self.block_index = [], None
        if self.mode == "tabed" and self.history_match is not None:
            self.weights = choose_weights(self.grid, self.history_match, self.history_kl)
            self.active = None

    def record_verified(self, path: list[int], logits: torch.Tensor, lm_head) -> None:
        """TABED history: the path's nodes whose children the head proposed (their prefix
        was verified: the accepted nodes and the one whose child was rejected), each with
        the target's distribution there. ``logits`` (N, V) are the verification's; the
        block's head outputs are already in the target's dtype (``mix`` got them so)."""
        if self.mode != "tabed" or not self.block_out or self.block_index is None:
            return
        index = self.block_index[path]
        nodes = torch.as_tensor(path, device=index.device)[index >= 0]
        if nodes.numel() == 0:
            return
        out = torch.cat(self.block_out, dim=1)[:, index[index >= 0]]  # (R, n, H)
        rows = lm_head(out).float().softmax(-1).transpose(0, 1)  # (n, R, V), unwarped
        self.remember(*position_scores(rows, logits[nodes].float().softmax(-1), self.grid))
        self.block_out = []

    def remember(self, match: torch.Tensor, kl: torch.Tensor) -> None:
        """Append newly verified positions' scores (n, G) to the history, keeping the window."""
        if self.history_match is not None:
            match, kl = torch.cat([self.history_match, match]), torch.cat([self.history_kl, kl])
        if self.window is not None:
            match, kl = match[-self.window :], kl[-self.window :]
        self.history_match, self.history_kl = match, kl


# ----- input variants -------------------------------------------------------------------


def image_blocks(target: TargetProtocol, prompt: PromptPass) -> list[tuple[int, int, int]]:
    """(start, grid height, grid width) of every image's token block, in order."""
    idx = prompt.visual[0].nonzero().flatten().tolist()
    if not idx:
        return []
    grids = target.image_grids(prompt.pixel)
    if sum(h * w for h, w in grids) != len(idx):
        raise ValueError(f"the prompt has {len(idx)} image tokens but the images' patch grids {grids} give "
                         f"{sum(h * w for h, w in grids)} (e.g. a kept CLS token: P and C need one token per patch)")
    blocks, i = [], 0
    for gh, gw in grids:
        start = idx[i]
        if idx[i + gh * gw - 1] != start + gh * gw - 1:
            raise ValueError("ensemble variants P and C expect each image's tokens to be contiguous")
        blocks.append((start, gh, gw))
        i += gh * gw
    return blocks


def _pool_block(x: torch.Tensor, first: int, gh: int, gw: int) -> torch.Tensor:
    """(1, L, H), a gh x gw block at ``first`` -> (1, ceil(gh/2) * ceil(gw/2), H), 2x2 means."""
    grid = x[0, first : first + gh * gw].T.reshape(1, -1, gh, gw).float()
    return torch.nn.functional.avg_pool2d(grid, 2, ceil_mode=True).flatten(2)[0].T[None].to(x.dtype)


def _pooled(target: TargetProtocol, p: PromptPass):
    """Variant P: each image's block average-pooled 2x2 over its grid (ceil at odd edges)."""
    blocks = image_blocks(target, p)
    embeds, hidden, pos, visual = p.embeds, p.hidden, p.pos, p.visual
    parts: list[tuple] = []
    start = 0
    for first, gh, gw in blocks:
        n = gh * gw
        text = slice(start, first)
        parts.append((embeds[:, text], hidden[:, text], pos[..., text], visual[:, text]))

        corner = torch.arange(n, device=pos.device).view(gh, gw)[::2, ::2].flatten() + first
        parts.append((_pool_block(embeds, first, gh, gw), _pool_block(hidden, first, gh, gw), pos[..., corner],
                      torch.ones(1, corner.numel(), dtype=torch.bool, device=visual.device)))
        start = first + n
    tail = slice(start, embeds.shape[1])
    parts.append((embeds[:, tail], hidden[:, tail], pos[..., tail], visual[:, tail]))
    e, h, ps, v = zip(*parts)
    return torch.cat(e, 1), torch.cat(h, 1), torch.cat(ps, -1), torch.cat(v, 1)


@torch.inference_mode()
def _captioned(target: TargetProtocol, p: PromptPass, captions: list[str] | None):
    """Variant C: the prompt with each image's tokens replaced by its caption's, read by
    the target (text only) for its features; positions shifted to end where ``p`` ends."""
    blocks = image_blocks(target, p)
    if not blocks:
        return p.embeds, p.hidden, p.pos, p.visual
    if not captions or len(captions) != len(blocks) or not all(isinstance(c, str) and c for c in captions):
        raise ValueError(f"decoding.variants has C (caption) but the prompt's {len(blocks)} image(s) came with "
                         f"{len(captions or [])} caption(s); give every image a caption (bench `captions` file or "
                         "a `caption` field per sample) or drop C from decoding.variants")
    ids = p.ids[0].tolist()
    out, start = [], 0
    for (first, gh, gw), caption in zip(blocks, captions):
        out += ids[start:first] + target.tokenizer(caption, add_special_tokens=False)["input_ids"]
        start = first + gh * gw
    ids_c = torch.tensor([out + ids[start:]], device=p.ids.device)
    embeds = target.embed(ids_c)
    pos, _ = target.position_ids(ids_c, None, {})
    hidden, _ = target.run_language_model(embeds, pos)
    pos = pos + (p.pos[..., -1:] - pos[..., -1:])  # end where the target's prompt ends
    return embeds, hidden, pos, torch.zeros_like(ids_c, dtype=torch.bool)


def variant_inputs(target: TargetProtocol, draft, variant: str, prompt: PromptPass, captions: list[str] | None = None
                   ) -> dict[str, torch.Tensor | None]:
    """The head's prefill inputs for one variant of a prompt (``draft.target_inputs``'
    keyword inputs), each over the variant's draft positions.

    The variants edit the prompt's positions (T drops the image's, P keeps each window's
    first, C ends where the prompt ends), so they start from the head's positions of the
    whole prompt (``draft_position_ids``), which ``target_inputs`` is given as they are
    rather than deriving them from each variant alone."""
    prompt = dataclasses.replace(prompt, pos=draft_position_ids(draft.config, prompt.pos))
    if variant == "M":
        embeds, hidden, pos, visual = prompt.embeds, prompt.hidden, prompt.pos, prompt.visual
    elif variant == "T":
        keep = ~prompt.visual[0]
        embeds, hidden, pos, visual = prompt.embeds[:, keep], prompt.hidden[:, keep], prompt.pos[..., keep], \
            prompt.visual[:, keep]
    elif variant == "P":
        embeds, hidden, pos, visual = _pooled(target, prompt)
    elif variant == "C":
        embeds, hidden, pos, visual = _captioned(target, prompt, captions)
    else:
        raise ValueError(f"decoding.variants: unknown variant {variant!r}; choose from {VARIANTS}")
    return draft.target_inputs(Features(embeds, hidden, visual, None), target, position_ids=pos)


# ----- the rows' prefill ----------------------------------------------------------------


def _left_pad(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    if n == 0:
        return x
    shape = list(x.shape)
    shape[dim] = n
    return torch.cat([torch.zeros(shape, dtype=x.dtype, device=x.device), x], dim)


@torch.inference_mode()
def _prefill_rows(self: EnsembleDrafter, target: TargetProtocol, p: PromptPass, workspace, capacity: int) -> None:
    """The head's prefix built once per variant, as one left-padded batch of rows."""
    from transformers import DynamicCache

    device, draft, variants = target.device, self.draft, self.variants
    self.single.rope_deltas = draft_rope_deltas(draft.config, p.rope_deltas)
    if bool(p.ids[0, -1] == target.image_token_id):
        raise ValueError("ensemble drafting needs a prompt that ends in text, not in image tokens")
    rows = [variant_inputs(target, draft, v, p, self.captions) for v in variants]
    lengths = [r["input_embeds"].shape[1] for r in rows]
    n = max(lengths)
    valid = torch.zeros(len(variants), n, dtype=torch.bool, device=device)
    for i, length in enumerate(lengths):
        valid[i, n - length:] = True
    self.weights = torch.full((len(variants),), 1.0 / len(variants), device=device)
    if self.mode == "tabed":
        self.grid = simplex_grid(len(variants), device=device)
    capacity = max(capacity, n + 64)
    if not bool(valid.all()):
        self.pad_bias = torch.zeros(len(variants), capacity, dtype=draft.dtype, device=device)
        self.pad_bias[:, :n].masked_fill_(~valid, torch.finfo(draft.dtype).min)
    cache = DynamicCache()
    if n > 0:
        # the rows left-padded into one batch: positions along their last dimension, batch the one before
        inputs = {key: torch.cat([_left_pad(r[key], n - length, -1 if key == "position_ids" else 1)
                                  for r, length in zip(rows, lengths)], dim=-2 if key == "position_ids" else 0)
                  for key in rows[0] if rows[0][key] is not None}
        # causal and no padded keys, as the head builds it from a padding mask (padded
        # positions are never read: they stay masked as keys by ``pad_bias`` later)
        mask = attention_bias(valid, len(variants), n, 0, draft.dtype, device) if self.pad_bias is not None else None
        draft(**inputs, attention_mask=mask, past_key_values=cache, use_cache=True)
    self.single.attach(workspace, workspace.load("head", cache, capacity))
    self.single.cache.length = n


# ----- mixture weights ------------------------------------------------------------------


def simplex_grid(n: int, step: float = 0.1, device=None) -> torch.Tensor:
    """All weight vectors of length n with entries multiple of ``step`` summing to 1 (G, n)."""
    units = round(1 / step)
    points = [c for c in itertools.product(range(units + 1), repeat=n) if sum(c) == units]
    return torch.tensor(points, dtype=torch.float32, device=device) / units


def position_scores(rows: torch.Tensor, target: torch.Tensor, grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For N verified positions and every grid point g: whether argmax(sum_r g_r rows_r)
    equals the target's argmax, and KL(target || that mixture). ``rows`` (N, R, V),
    ``target`` (N, V), ``grid`` (G, R); returns (N, G) bool and (N, G) float64."""
    rows, target = rows.float(), target.float()
    want = target.argmax(-1)[:, None]  # (N, 1)
    plogp = torch.xlogy(target, target).sum(-1, dtype=torch.float64)[:, None]
    match, cross = [], []
    for part in grid.split(16):  # bounds memory at 16 * N * V
        mix = torch.einsum("gr,nrv->ngv", part, rows)
        match.append(mix.argmax(-1) == want)
        cross.append(torch.einsum("nv,ngv->ng", target, mix.clamp_min(1e-30).log()).double())
    return torch.cat(match, 1), plogp - torch.cat(cross, 1)


def choose_weights(grid: torch.Tensor, match: torch.Tensor, kl: torch.Tensor) -> torch.Tensor:
    """TABED's rule over a history's per-position scores (N, G): the most argmax matches,
    then the smallest summed KL; remaining ties go to the earlier grid point."""
    count = match.sum(0)
    total = kl.sum(0).masked_fill(count != count.max(), float("inf"))
    return grid[total.argmin()]  # argmin returns the first of equal minima; a device index, no host read


def tabed_weights(rows: torch.Tensor, target: torch.Tensor, step: float = 0.1) -> torch.Tensor:
    """TABED's weight choice from a verified history: ``rows`` (N, R, V) each variant's
    next-token probabilities at N verified positions, ``target`` (N, V) the target's.
    Uniform weights when the history is empty."""
    n, r, _ = rows.shape
    if n == 0:
        return torch.full((r,), 1.0 / r, device=rows.device)
    grid = simplex_grid(r, step, rows.device)
    return choose_weights(grid, *position_scores(rows, target, grid))
