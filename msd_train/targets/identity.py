"""Who a loaded target is, for the records that must name it.

- :func:`target_identity`: what a head's training depends on (the architecture facts, the
  chat template, the LoRA adapter, a digest of the embedding table and lm_head). A feature
  store's manifest and every training checkpoint record it; a store or checkpoint made from
  another target is refused, naming the difference.
- :func:`tokenizer_identity`: what a tokenised conversation depends on (the tokenizer's
  vocabulary and rules, the chat template, the image processor's settings): the data cache
  is keyed on it.
"""

from __future__ import annotations

import hashlib
import json

import torch

from msd_train.targets.base import Target
from msd_train.targets.lora import adapter_identity
from msd_train.targets.protocol import TargetProtocol


def target_identity(target: TargetProtocol, adapter: str | None = None, weights: bool = True) -> dict:
    """The architecture facts, the template, the adapter and a digest of the embedding table
    and lm_head (what offline training reads from the configured target). Weights are hashed
    in bf16, so fp32 and bf16 loads agree; ``weights=False`` (or a model on the meta device)
    leaves the digest out."""
    digest = None
    if weights and target.embed_tokens.weight.device.type != "meta":
        h = hashlib.sha256()
        for w in (target.embed_tokens.weight, target.lm_head.weight):
            h.update(w.detach().to("cpu", torch.bfloat16).contiguous().view(torch.uint8).numpy())
        digest = h.hexdigest()
    return {
        "name": target.name, "family": target.family, "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size, "tokenizer_size": len(target.tokenizer),
        "image_token_id": target.image_token_id, "adapter": adapter_identity(adapter),
        "chat_template_sha1": hashlib.sha1(target.chat_template.encode()).hexdigest(),
        "weights_sha256": digest,
    }


def tokenizer_identity(target: Target) -> dict:
    """The tokenizer's vocabulary and rules, the chat template and the image processor's
    settings (which decide each image's visual-token count), as a tokenised row depends on
    them (the adapter's processor: an adapter fact, outside ``TargetProtocol``)."""
    tok = target.tokenizer
    backend = getattr(tok, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(sorted(tok.get_vocab().items()))
    ip = getattr(target.processor, "image_processor", None)
    images = ip.to_json_string() if hasattr(ip, "to_json_string") else repr(ip)
    return {"target": target.name, "family": target.family, "template": target.chat_template,
            "tokenizer": hashlib.sha1(vocab.encode()).hexdigest(), "vocab": len(tok),
            "special": target.template_vars(), "image_processor": hashlib.sha1(images.encode()).hexdigest(),
            "image_token_id": target.image_token_id}
