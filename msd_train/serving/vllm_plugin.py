"""vLLM plugin: serve exported msd / msd3 heads as they were trained.

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
}


def register() -> None:
    from vllm import ModelRegistry

    for name, cls in CLASSES.items():
        ModelRegistry.register_model(name, cls)
