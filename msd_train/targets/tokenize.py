"""Segments -> token ids and loss mask, with image placeholders expanded in place."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from msd_train.targets.chat import Segment


def tokenize_texts(tokenizer, texts: list[str]) -> list[list[int]]:
    """The ids of each text, no special tokens added: ``tokenizer(texts,
    add_special_tokens=False)["input_ids"]``. A fast tokenizer with no truncation or padding
    set is asked directly (the Rust tokenizer's batch call, which is what that call runs,
    without the per-text offsets, strings and Python conversion around it); the ids are
    the same (``tests/unit/test_data_scale.py`` holds every family's tokenizer to it)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if (backend is not None and hasattr(backend, "encode_batch") and backend.truncation is None
            and backend.padding is None
            and backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False))):
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def encode_segments_many(
    tokenizer,
    conversations: Sequence[Sequence[Segment]],
    image_text: str,
    image_token_id: int,
    tokens_per_image: Sequence[Sequence[int]],
    bos: bool = True,
) -> list[tuple[list[int], list[int]]]:
    """:func:`encode_segments` of many conversations with one tokenizer call, as lists."""
    bos_id = tokenizer.bos_token_id if bos else None
    pieces: list[list[tuple[str, bool]]] = []  # per conversation: (text, loss); "" is an image slot
    texts: list[str] = []
    for segments in conversations:
        mine = []
        for seg in segments:
            for j, part in enumerate(seg.text.split(image_text)):
                if j > 0:
                    mine.append(("", False))
                if part:
                    mine.append((part, seg.loss))
                    texts.append(part)
        pieces.append(mine)
    encoded = iter(tokenize_texts(tokenizer, texts) if texts else [])
    out = []
    for mine, counts in zip(pieces, tokens_per_image):
        ids: list[int] = [] if bos_id is None else [bos_id]
        mask: list[int] = [0] * len(ids)
        image_index = 0
        for part, loss in mine:
            if part:
                toks = next(encoded)
                ids.extend(toks)
                mask.extend([int(loss)] * len(toks))
                continue
            if image_index >= len(counts):
                raise ValueError(f"more image placeholders than images ({len(counts)})")
            n = counts[image_index]
            image_index += 1
            ids.extend([image_token_id] * n)
            mask.extend([0] * n)
        if image_index != len(counts):
            raise ValueError(f"{len(counts)} images but {image_index} image placeholders in the text")
        out.append((ids, mask))
    return out


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
    [(ids, mask)] = encode_segments_many(tokenizer, [segments], image_text, image_token_id, [tokens_per_image], bos)
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)
