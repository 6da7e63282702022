"""Ensemble drafting with one MSD head over several input variants of the prompt.

The variants of one prompt are drafted as one batch of rows through the same head:

    M   the prompt as the head was trained on it (the visual block included)
    T   the visual block left out of the head's prefix (its prefill skips image positions)
    P   each image's visual block average-pooled 2x2 over the patch grid (a quarter of the
        positions), embeddings and target features alike

Every row keeps the target's position ids of the tokens it keeps (a pooled token takes
the position of its window's top-left patch), so after the prompt all rows share the
same positions; rows are left-padded to a common length and masked per row.

At each draft step the rows' next-token probabilities are mixed, ``q = sum_r w_r p_r``,
and every row continues from the same token: the argmax of q (greedy) or a draw from q
(sampling, where q is also what the acceptance test divides by, so decoding stays
lossless). ``ibed`` uses equal weights; ``tabed`` picks, before each draft block, the
weights on the 0.1-step simplex that make q's argmax agree with the target's argmax at
the most recently verified positions, ties broken by the smallest KL(target || q).

Only chain drafting is implemented (``decoding.method=chain``). A caption variant (C)
is not: it needs target features for caption tokens the target never read.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from msd_train.decoding.sampling import SamplingParams, logits_to_probs, sample
from msd_train.decoding.tree import Tree, chain
from msd_train.draft import crop_cache

VARIANTS = ("M", "T", "P")
ENSEMBLES = ("ibed", "tabed")


@dataclass
class EnsembleState:
    """The ensemble's part of a ``DecodeState`` (the batched head cache is ``state.draft_cache``)."""

    variants: tuple[str, ...]
    mode: str  # ibed | tabed
    window: int  # tabed: verified positions the weight search looks back over
    valid: torch.Tensor  # (B, draft_len) bool: False at each row's left padding
    weights: torch.Tensor  # (B,) the mixture weights of the current draft block
    #: tabed history, oldest first: per verified position the rows' (B, V) and the
    #: target's (V,) unwarped next-token probabilities
    history_rows: list[torch.Tensor] = field(default_factory=list)
    history_target: list[torch.Tensor] = field(default_factory=list)
    block_rows: torch.Tensor | None = None  # (k, B, V) the last draft block's row probabilities
    padded: bool | None = None  # whether any row has left padding (None: not known yet)

    def clone(self) -> EnsembleState:
        return EnsembleState(self.variants, self.mode, self.window, self.valid.clone(), self.weights.clone(),
                             list(self.history_rows), list(self.history_target), self.block_rows, self.padded)


# ----- input variants -------------------------------------------------------------------


def _pool_blocks(target, embeds, hidden, pos, visual):
    """Average-pool every image's visual block 2x2 over the patch grid (batch 1).

    Returns the shortened (embeds, hidden, pos, visual). Blocks are the runs of image
    tokens, cut into images of ``gh * gw`` tokens each.
    """
    idx = visual[0].nonzero().flatten().tolist()
    if not idx:
        return embeds, hidden, pos, visual
    grid = getattr(target, "patch_grid", None)
    if grid is None:
        raise ValueError(f"decoding.variants: P needs a target with a fixed patch grid; {target.family} has none")
    gh, gw = grid
    per_image = gh * gw
    if len(idx) % per_image:
        raise ValueError(f"decoding.variants: P pools a {gh}x{gw} patch grid but the prompt has {len(idx)} "
                         f"image tokens (not a multiple of {per_image}; e.g. a kept CLS token)")
    keep_e, keep_h, keep_p, keep_v = [], [], [], []
    start = 0
    for b in range(0, len(idx), per_image):
        block = idx[b : b + per_image]
        if block != list(range(block[0], block[0] + per_image)):
            raise ValueError("decoding.variants: P expects each image's tokens to be contiguous")
        text = slice(start, block[0])
        keep_e.append(embeds[:, text]); keep_h.append(hidden[:, text])
        keep_p.append(pos[..., text]); keep_v.append(visual[:, text])
        pool = lambda x: torch.nn.functional.avg_pool2d(  # noqa: E731  (1, n, H) -> (1, n/4, H)
            x[0, block[0] : block[0] + per_image].T.reshape(1, -1, gh, gw).float(), 2, ceil_mode=True
        ).flatten(2)[0].T[None].to(x.dtype)
        keep_e.append(pool(embeds)); keep_h.append(pool(hidden))
        corner = torch.arange(per_image, device=pos.device).view(gh, gw)[::2, ::2].flatten() + block[0]
        keep_p.append(pos[..., corner])
        keep_v.append(torch.ones(1, corner.numel(), dtype=torch.bool, device=visual.device))
        start = block[0] + per_image
    tail = slice(start, embeds.shape[1])
    keep_e.append(embeds[:, tail]); keep_h.append(hidden[:, tail])
    keep_p.append(pos[..., tail]); keep_v.append(visual[:, tail])
    return torch.cat(keep_e, 1), torch.cat(keep_h, 1), torch.cat(keep_p, -1), torch.cat(keep_v, 1)


def variant_inputs(target, draft, variant: str, embeds, hidden, pos, visual):
    """The head's prefill inputs for one variant of a prompt: (embeds, hidden,
    replace_mask, raw, position_ids), each over the variant's draft positions.

    ``embeds``/``hidden`` (1, L, H), ``pos`` (1, L) or (3, 1, L), ``visual`` (1, L) bool:
    one target pass over the prompt, as ``prefill`` makes it.
    """
    if variant == "T":
        keep = ~visual[0]
        embeds, hidden, pos, visual = embeds[:, keep], hidden[:, keep], pos[..., keep], visual[:, keep]
    elif variant == "P":
        embeds, hidden, pos, visual = _pool_blocks(target, embeds, hidden, pos, visual)
    elif variant != "M":
        raise ValueError(f"decoding.variants: unknown variant {variant!r}; choose from {VARIANTS}")
    e, h, replace, raw = draft.align_inputs(embeds, hidden, visual)
    return e, h, replace, raw, pos[..., :-1]


# ----- the batched head -----------------------------------------------------------------


def _bias(valid: torch.Tensor, query: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask (B, 1, query, keys): causal, no padded keys; a padded query sees
    itself (so no softmax row is empty)."""
    b, keys = valid.shape
    if query == 1:  # one new (valid) position per row: only the padding is masked
        bias = torch.zeros(b, 1, 1, keys, dtype=dtype, device=valid.device)
        return bias.masked_fill(~valid[:, None, None, :], torch.finfo(dtype).min)
    past = keys - query
    k = torch.arange(keys, device=valid.device)
    q = past + torch.arange(query, device=valid.device)
    causal = k[None, :] <= q[:, None]
    allowed = causal[None] & (valid[:, None, :] | (k[None, :] == q[:, None])[None])
    bias = torch.zeros(b, 1, query, keys, dtype=dtype, device=valid.device)
    return bias.masked_fill(~allowed[:, None], torch.finfo(dtype).min)


def _rows_forward(draft, state, e, h, pos, replace=None, raw=None) -> torch.Tensor:
    """Run the head over T new positions of every row; returns (B, T, H)."""
    ens = state.ensemble
    ens.valid = torch.cat([ens.valid, torch.ones(e.shape[0], e.shape[1], dtype=torch.bool, device=e.device)], 1)
    # no padding and one query: the head's own (unmasked) fast path is exact
    mask = None if e.shape[1] == 1 and ens.padded is False else _bias(ens.valid, e.shape[1], draft.dtype)
    out = draft(e, h, replace, raw, position_ids=pos, attention_mask=mask,
                past_key_values=state.draft_cache, use_cache=True).last_hidden_state
    return out


def _prefill_rows(draft, state, cols, pos, valid) -> None:
    e, h, replace, raw = cols
    draft(e, h, replace, raw, position_ids=pos, attention_mask=_bias(valid, e.shape[1], draft.dtype),
          past_key_values=state.draft_cache, use_cache=True)
    state.ensemble.valid = valid
    state.ensemble.padded = not bool(valid.all())


def _left_pad(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    if n == 0:
        return x
    shape = list(x.shape)
    shape[dim] = n
    return torch.cat([torch.zeros(shape, dtype=x.dtype, device=x.device), x], dim)


@torch.inference_mode()
def prefill_ensemble(target, draft, prompt, variants, mode: str, window: int):
    """``prefill`` with the head's prefix built once per variant, as one left-padded batch."""
    from transformers import DynamicCache

    from msd_train.decoding.speculative import prefill_target

    device = target.device
    state, ids, embeds, hidden, pos = prefill_target(target, prompt)
    visual = ids == target.image_token_id
    if bool(visual[0, -1]):
        raise ValueError("ensemble drafting needs a prompt that ends in text, not in image tokens")
    b = len(variants)
    state.draft_cache = DynamicCache()
    rows = [variant_inputs(target, draft, v, embeds, hidden, pos, visual) for v in variants]
    n = max(r[0].shape[1] for r in rows)
    valid = torch.zeros(b, n, dtype=torch.bool, device=device)
    for i, r in enumerate(rows):
        valid[i, n - r[0].shape[1]:] = True
    state.ensemble = EnsembleState(tuple(variants), mode, window, valid[:, :0],
                                   torch.full((b,), 1.0 / b, device=device))
    if n > 0:
        cols = [torch.cat([_left_pad(t, n - t.shape[1], 1) for t in part]) for part in zip(*[r[:4] for r in rows])]
        pos_rows = torch.cat([_left_pad(r[4], n - r[4].shape[-1], -1) for r in rows], dim=-2)
        _prefill_rows(draft, state, cols, pos_rows, valid)
    state.draft_len = n
    return state


# ----- mixture weights ------------------------------------------------------------------


def simplex_grid(n: int, step: float = 0.1, device=None) -> torch.Tensor:
    """All weight vectors of length n with entries multiple of ``step`` summing to 1 (G, n)."""
    units = round(1 / step)
    points = [c for c in itertools.product(range(units + 1), repeat=n) if sum(c) == units]
    return torch.tensor(points, dtype=torch.float32, device=device) / units


def tabed_weights(rows: torch.Tensor, target: torch.Tensor, step: float = 0.1) -> torch.Tensor:
    """TABED's weight choice from a verified history.

    ``rows`` (N, B, V): each variant's next-token probabilities at N verified positions;
    ``target`` (N, V): the target's. Over the grid ``simplex_grid(B, step)`` maximise the
    number of positions where argmax(sum_r w_r rows_r) == argmax(target), then minimise
    sum_n KL(target_n || mixture_n); remaining ties go to the earlier grid point.
    Uniform weights when the history is empty.
    """
    n, b, _ = rows.shape
    if n == 0:
        return torch.full((b,), 1.0 / b, device=rows.device)
    grid = simplex_grid(b, step, rows.device)
    rows, target = rows.float(), target.float()
    want = target.argmax(-1)  # (N,)
    plogp = torch.xlogy(target, target).sum()
    match, kl = [], []
    for part in grid.split(16):  # bounds memory at 16 * N * V
        mix = torch.einsum("gb,nbv->gnv", part, rows)
        match.append((mix.argmax(-1) == want).sum(-1))
        kl.append(plogp - (target * mix.clamp_min(1e-30).log()).sum((-1, -2)))
    match, kl = torch.cat(match), torch.cat(kl)
    best = match == match.max()
    kl = kl.masked_fill(~best, float("inf"))
    return grid[int(kl.argmin())]  # argmin returns the first of equal minima


def record_verified(state, tree: Tree, path: list[int], logits: torch.Tensor) -> None:
    """TABED history: the draft steps whose prefix the target verified (the accepted
    path and the first rejected position), with the target's distribution there."""
    ens = state.ensemble
    if ens is None or ens.mode != "tabed" or ens.block_rows is None:
        return
    steps = min(len(path), ens.block_rows.shape[0])  # chain: node i is path[i]
    target = logits[:steps].float().softmax(-1)
    for i in range(steps):
        ens.history_rows.append(ens.block_rows[i])
        ens.history_target.append(target[i])
    del ens.history_rows[: -ens.window or None], ens.history_target[: -ens.window or None]
    ens.block_rows = None


# ----- drafting -------------------------------------------------------------------------


@torch.inference_mode()
def draft_chain_ensemble(draft, target, state, k: int, sampling: SamplingParams,
                         generator: torch.Generator | None = None) -> Tree:
    """k draft tokens from the rows' mixture q: its argmax (greedy) or a draw from it,
    kept as the draft distribution for the acceptance test."""
    ens = state.ensemble
    b = len(ens.variants)
    if ens.mode == "tabed" and ens.history_rows:
        ens.weights = tabed_weights(torch.stack(ens.history_rows), torch.stack(ens.history_target))
    w = ens.weights
    embed, lm_head = target.embed_tokens, target.lm_head  # (module look-ups cost per call)
    n = state.pending_hidden.shape[0]
    tokens_in = torch.as_tensor(state.tokens[-n:], device=target.device)
    pos = target.continue_positions(state.draft_len, n, state.rope_deltas)
    expand = lambda x: x.expand(*x.shape[:-2], b, x.shape[-1])  # noqa: E731  batch-1 positions -> B rows
    out = _rows_forward(draft, state, embed(tokens_in)[None].expand(b, -1, -1),
                        state.pending_hidden[None].expand(b, -1, -1), expand(pos))
    state.draft_len += n
    h = out[:, -1]  # (B, H)
    tokens, probs, rows = [], [], []
    for i in range(k):
        logits = lm_head(h.to(target.dtype)).float()  # (B, V)
        p_rows = logits.softmax(-1) if sampling.greedy else logits_to_probs(logits, sampling)
        q = w @ p_rows
        x = q.argmax(-1) if sampling.greedy else sample(q, generator)
        if not sampling.greedy:
            probs.append(q)
        if ens.mode == "tabed":
            rows.append(p_rows if sampling.greedy else logits.softmax(-1))
        tokens.append(x)
        if i + 1 < k:  # every row continues from the chosen token and its own feature
            step_pos = target.continue_positions(state.cache_len + i, 1, state.rope_deltas)
            h = _rows_forward(draft, state, embed(x.view(1, 1)).expand(b, -1, -1),
                              h[:, None], expand(step_pos))[:, -1]
    crop_cache(state.draft_cache, state.draft_len)
    ens.valid = ens.valid[:, : state.draft_len]
    ens.block_rows = torch.stack(rows) if rows else None
    root = torch.as_tensor([state.tokens[-1]], device=target.device)
    return chain(root, torch.stack(tokens), torch.stack(probs) if probs else None)


def check_ensemble(config) -> None:
    """Validate ``DecodeConfig``'s ensemble fields (called from its ``__post_init__``)."""
    if config.ensemble not in ENSEMBLES:
        raise ValueError(f"decoding.ensemble must be null or one of {ENSEMBLES}, got {config.ensemble!r}")
    bad = [v for v in config.variants if v not in VARIANTS]
    if bad or not config.variants or len(set(config.variants)) != len(config.variants):
        raise ValueError(f"decoding.variants must be distinct entries of {VARIANTS} "
                         f"(C, captions, is not implemented), got {list(config.variants)}")
    if config.method not in ("chain", "ar"):
        raise ValueError(f"decoding.ensemble={config.ensemble} drafts chains only: set decoding.method=chain "
                         f"(got {config.method})")
    if config.tabed_window < 1:
        raise ValueError(f"decoding.tabed_window must be >= 1, got {config.tabed_window}")
