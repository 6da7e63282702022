"""``scripts/regenerate_data.py engine=vllm``: the target served by vLLM answers the
conversations a batch at a time (``msd_train.data.engines`` has the interface and the
transformers engine). vLLM is imported when an engine is made, not with this module.
"""

from __future__ import annotations

import importlib.metadata
import os

import torch

from msd_train.data.engines import Answer, EngineError, Request, Sampling

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
        window = getattr(target.text_config, "max_position_embeddings", None)
        if window and int(max_model_len) > int(window):
            raise EngineError(f"engine=vllm: max_prompt_tokens + max_new_tokens = {max_model_len} is longer than the "
                              f"target's context window ({window} tokens); lower max_prompt_tokens or max_new_tokens")
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
