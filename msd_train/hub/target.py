"""The target, as far as heads care: `TargetInfo` (name, sizes, embedding table), read
from a loaded target or from its files without loading it, and `cast_head`, which puts a
head on a target's device and dtype. Every hub format's import and export takes these."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from msd_train.draft.head import DraftHead
from msd_train.targets import ADAPTERS, FAMILIES
from msd_train.targets.protocol import TargetProtocol
from msd_train.trust import torch_load

log = logging.getLogger(__name__)

#: The targets the published heads were trained for, by (model_type, hidden_size), and
#: those targets' vocabulary sizes in their transformers format. Used only to fill the
#: head's `target_*` fields when the importer is not told the target.
PUBLISHED_TARGETS = {(c.reference_model_type, hidden): target for c in ADAPTERS if c.reference_model_type
                     for hidden, target in c.published_targets.items()}


@dataclass
class TargetInfo:
    """What import/export need to know of a target: its name, sizes, embedding table.

    The hub functions take this one kind of thing; a caller builds it once, from what it
    holds: a loaded target (:meth:`of`) or a target's folder or Hub id (:meth:`from_files`,
    which never loads the model). The embedding table is read on first use only (an
    export with ``embed_from=`` never reads it).
    """

    name: str
    model_type: str | None
    vocab_size: int
    hidden_size: int
    read_embedding: Callable[[], torch.Tensor] = field(repr=False)
    original_vocab_size: int | None = None  # LLaVA: the tokenizer's base vocabulary (no appended tokens)
    adapter: str | None = None
    mrope_section: list[int] | None = None

    @cached_property
    def embedding(self) -> torch.Tensor:
        """[vocab, H], the target's input embedding table."""
        return self.read_embedding()

    def refuse_misfit(self, config, where) -> None:
        """Refuse a head (its config) that drafts for another target: its hidden size, the
        vocabulary it was trained over and its family against this target's, before anything
        is written (a folder that mixes them cannot be imported back, nor served)."""
        from msd_train.targets import head_family

        diffs = []
        if config.hidden_size != self.hidden_size:
            diffs.append(f"hidden size {config.hidden_size}, the target's {self.hidden_size}")
        if config.target_vocab_size not in (None, self.vocab_size):
            diffs.append(f"vocabulary {config.target_vocab_size}, the target's {self.vocab_size}")
        family, theirs = head_family(config), FAMILIES.get(self.model_type)
        # heads saved before they recorded their family are known by their layer family only
        recorded = config.target_model_type in FAMILIES
        if theirs is not None and (family is not theirs if recorded
                                   else family.draft_layer_family != theirs.draft_layer_family):
            diffs.append(f"family {family.display_name}, the target's {theirs.display_name}")
        if diffs:
            trained = f" ({config.target_name_or_path})" if config.target_name_or_path else ""
            raise ValueError(f"{where} drafts for another target than {self.name}: " + "; ".join(diffs)
                             + f". Give target= the target it was trained for{trained}, or export the head "
                               f"trained for {self.name}; nothing was written")

    @classmethod
    def of(cls, target: TargetProtocol) -> TargetInfo:
        """A loaded target (``TargetProtocol``: its `config` and `embed_tokens`)."""
        config = target.config
        text = config.get_text_config(decoder=True)
        return cls(
            name=str(getattr(target, "name", None) or getattr(config, "_name_or_path", "")),
            model_type=config.model_type,
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            read_embedding=lambda: target.embed_tokens.weight.detach(),
            original_vocab_size=getattr(getattr(target, "tokenizer", None), "vocab_size", None),
            adapter=getattr(target, "adapter", None),
            mrope_section=_mrope_of(text),
        )

    @classmethod
    def from_files(cls, name_or_path: str | os.PathLike) -> TargetInfo:
        """A target folder or Hub id, read from its config, tokenizer and the one weight
        shard that holds the embedding (the model is not loaded)."""
        from transformers import AutoConfig, AutoTokenizer

        name = str(name_or_path)
        config = AutoConfig.from_pretrained(name)
        text = config.get_text_config(decoder=True)
        original = None
        if getattr(FAMILIES.get(config.model_type), "vocab_appended", False):
            try:
                original = AutoTokenizer.from_pretrained(name).vocab_size
            except Exception as err:  # a target without a tokenizer still has an embedding
                log.warning("%s: could not read the tokenizer (%s); assuming no appended tokens", name, err)
        return cls(
            name=name, model_type=config.model_type, vocab_size=text.vocab_size, hidden_size=text.hidden_size,
            read_embedding=lambda: read_target_embedding(name), original_vocab_size=original,
            mrope_section=_mrope_of(text),
        )


def _mrope_of(text_config) -> list[int] | None:
    rope = getattr(text_config, "rope_parameters", None) or {}
    return list(rope["mrope_section"]) if rope.get("mrope_section") else None


def read_target_embedding(name_or_path: str, revision: str | None = None) -> torch.Tensor:
    """The target's input embedding table, read from its weight files alone (one shard,
    not the whole model): the text model's `*embed_tokens.weight`."""
    from huggingface_hub import hf_hub_download
    from safetensors import safe_open

    local = Path(name_or_path)

    def fetch(filename: str) -> Path | None:
        if local.is_dir():
            return local / filename if (local / filename).is_file() else None
        try:
            return Path(hf_hub_download(str(name_or_path), filename, revision=revision))
        except Exception:
            return None

    def pick(keys) -> str:
        found = [k for k in keys if k.endswith("embed_tokens.weight") and "vision" not in k and "visual" not in k]
        if len(found) != 1:
            raise ValueError(f"{name_or_path}: expected one text embed_tokens.weight, found {found or 'none'}")
        return found[0]

    index = fetch("model.safetensors.index.json")
    if index is not None:
        weight_map = json.loads(index.read_text())["weight_map"]
        key = pick(weight_map)
        path = fetch(weight_map[key])
    else:
        path = fetch("model.safetensors")
        if path is None:
            bin_path = fetch("pytorch_model.bin")
            if bin_path is None:
                raise FileNotFoundError(f"{name_or_path}: no model.safetensors(.index.json) or pytorch_model.bin")
            state = torch_load(bin_path, map_location="cpu", mmap=True,
                               fix="Convert the target's weights to safetensors where they were made")
            return state[pick(state)].clone()
        with safe_open(path, "pt") as f:
            key = pick(f.keys())
    with safe_open(path, "pt") as f:
        return f.get_tensor(key)


def cast_head(model: DraftHead, device=None, dtype: torch.dtype | None = None) -> DraftHead:
    """`model.to(device, dtype)` for the parameters only: buffers (the rotary `inv_freq`)
    keep their fp32 precision, as `from_pretrained(dtype=...)` leaves them. A plain
    `.to(torch.bfloat16)` would round the RoPE frequencies and shift every angle."""
    buffers = {name: buf for name, buf in model.named_buffers()}
    model.to(device=device, dtype=dtype)
    for name, buf in buffers.items():
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, buf.to(device or buf.device))
    return model

