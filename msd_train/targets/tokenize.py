"""Segments -> token ids and loss mask, with image placeholders expanded in place."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from msd_train.targets.chat import Segment


def encode_segments(
    tokenizer,
    segments: Sequence[Segment],
    image_text: str,
    image_token_id: int,
    tokens_per_image: Sequence[int],
    bos: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenise each segment on its own and concatenate.

    Tokenising segment by segment keeps the loss mask exact (no token straddles a
    turn boundary). Each occurrence of ``image_text`` becomes ``tokens_per_image[i]``
    copies of ``image_token_id`` for the i-th image, the count the target's own forward
    expects. Returns ``(input_ids, loss_mask)``, both 1-D int64.
    """
    ids: list[int] = []
    mask: list[int] = []
    if bos and tokenizer.bos_token_id is not None:
        ids.append(tokenizer.bos_token_id)
        mask.append(0)
    image_index = 0
    # one tokenizer call for every text piece (a fast tokenizer encodes a batch at once)
    pieces: list[tuple[str, bool]] = []
    for seg in segments:
        for j, part in enumerate(seg.text.split(image_text)):
            if j > 0:
                pieces.append(("", False))  # an image slot
            if part:
                pieces.append((part, seg.loss))
    texts = [p for p, _ in pieces if p]
    encoded = iter(tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
    for part, loss in pieces:
        if part:
            toks = next(encoded)
            ids.extend(toks)
            mask.extend([int(loss)] * len(toks))
            continue
        if image_index >= len(tokens_per_image):
            raise ValueError(
                f"more image placeholders than images ({len(tokens_per_image)})"
            )
        n = tokens_per_image[image_index]
        image_index += 1
        ids.extend([image_token_id] * n)
        mask.extend([0] * n)
    if image_index != len(tokens_per_image):
        raise ValueError(
            f"{len(tokens_per_image)} images but {image_index} image placeholders in the text"
        )
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)
