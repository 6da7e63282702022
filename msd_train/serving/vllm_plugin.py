"""vLLM plugin: serve exported msd, msd3 and dflash heads as they were trained.

vLLM calls ``register`` through the ``vllm.general_plugins`` entry point (pyproject.toml)
in every process it starts. It registers this project's draft classes under the names
vLLM gives a head folder exported with ``format=vllm`` (``msd_train.hub.vllm``):
``EagleLlamaForCausalLM`` (method ``eagle``, from ``architectures: ["LlamaForCausalLM"]``)
and ``Eagle3LlamaForCausalLM`` (method ``eagle3``, the speculators format). They replace
the stock classes of those names, and act as the stock ones for any folder without the
``"msd"`` block, so the same folder serves

* with stock vLLM (no plugin): "compatible" mode, the draft reads the image placeholder's
  embedding at image positions and the extras (fc bias, ...) are not loaded;
* with the plugin installed: as trained (``msd_train.serving.vllm_models``).

A dflash head's folder (method ``dflash``) names ``DFlashMSDDraftModel``, which only this
plugin registers: stock vLLM's DFlash draft has Qwen3's per-head q/k norms, which the
head's layers lack, so stock vLLM refuses the folder rather than draft otherwise.

The classes live in ``vllm_models`` and are registered by name (``module:Class``), so
loading the plugin imports no vLLM model code.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

#: vLLM draft architecture name -> this project's class
CLASSES = {
    "EagleLlamaForCausalLM": "msd_train.serving.vllm_models:MSDEagleLlamaForCausalLM",
    "Eagle3LlamaForCausalLM": "msd_train.serving.vllm_models:MSDEagle3LlamaForCausalLM",
    # a dflash export (vLLM's method dflash): a name only this plugin registers (msd_train.hub.vllm)
    "DFlashMSDDraftModel": "msd_train.serving.vllm_models:MSDDFlashForCausalLM",
}


def register() -> None:
    from vllm import ModelRegistry

    for name, cls in CLASSES.items():
        ModelRegistry.register_model(name, cls)
