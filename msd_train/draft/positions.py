"""Position ids the draft head reads, derived from the target's (``config.draft_positions``).

The head pairs draft position t with the target's token t (see ``align_inputs``), so its
position ids follow the target's tokens:

    "mrope"  the target's own ids: for Qwen2-VL / Qwen2.5-VL an image block lies on a
             2-D (height, width) grid and the text after it continues from the grid's
             largest index, so a text token's id is its index plus the prompt's rope delta.
    "1d"     the token index ``arange(L)``, the same in all three M-RoPE rows (with equal
             rows M-RoPE is plain RoPE). Draft tokens past the prompt continue the index,
             tree nodes at the root's index plus their depth. The released Qwen2-VL heads
             were trained and are run this way.

Both functions are pure and cheap (no host sync); every caller that feeds the head
(training, validation, feature storage, decoding) goes through them, so one config field
decides the convention everywhere.
"""

from __future__ import annotations

import torch

from msd_train.draft.config import MSDDraftConfig


def draft_position_ids(config: MSDDraftConfig, target_position_ids: torch.Tensor) -> torch.Tensor:
    """The head's position ids for whole sequences whose target ids are given.

    Args:
        config: the head's config (reads ``draft_positions``).
        target_position_ids: the target's ids over sequences that start at their first
            token, as ``Target.position_ids`` returns them: ``(B, L)`` for 1-D RoPE,
            ``(3, B, L)`` for M-RoPE. Right padding is fine (padded slots are never
            attended to by real tokens); slice ``[..., :-1]`` afterwards as the head's
            inputs are aligned.
    Returns:
        Ids of the same shape: the target's under "mrope" and for 1-D RoPE targets (whose
        ids already are token indices), else ``arange(L)`` in every row.
    """
    if config.draft_positions == "mrope" or target_position_ids.ndim == 2:
        return target_position_ids
    if target_position_ids.ndim != 3 or target_position_ids.shape[0] != 3:
        raise ValueError(
            f"target position ids must be (B, L) or M-RoPE (3, B, L), got {list(target_position_ids.shape)}")
    index = torch.arange(target_position_ids.shape[-1], dtype=target_position_ids.dtype,
                         device=target_position_ids.device)
    return index.expand_as(target_position_ids).contiguous()


def draft_rope_deltas(config: MSDDraftConfig, target_rope_deltas: torch.Tensor | None) -> torch.Tensor | None:
    """What ``Target.continue_positions`` must add to token indices for the head's ids
    after the prompt: the target's rope deltas under "mrope", zeros under "1d".

    ``target.continue_positions(start, n, draft_rope_deltas(config, deltas))`` gives the
    head's ids of the ``n`` tokens after the first ``start``, equal to what
    ``draft_position_ids`` gives for them over the whole sequence; adding a tree node's
    depth puts it at the root's id plus depth.
    """
    if target_rope_deltas is None or config.draft_positions == "mrope":
        return target_rope_deltas
    return torch.zeros_like(target_rope_deltas)
