"""Serving exported heads in vLLM: the plugin (``vllm_plugin``, imported by vLLM through its
``vllm.general_plugins`` entry point), the target folder vLLM reads (``target``) and the
serving check (``check``, run by scripts/serve_check.py). Nothing else in msd_train imports
this package, and only ``vllm_plugin`` and ``check`` import vLLM (lazily)."""
