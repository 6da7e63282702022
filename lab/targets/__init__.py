"""Builders of targets for tests and benchmarks: random models of every family (``random``),
the tiny Qwen2-VL made from the embedded LLaVA (``tiny_qwen``), a LLaVA made from a text-only
LM (``from_lm``, behind ``lab/targets/make_smollm2_llava.py``)."""
