"""Builders of targets for tests and benchmarks: random models of every family (``random``),
the tiny Qwen2-VL made from the embedded LLaVA (``tiny_qwen``), a LLaVA made from a text-only
LM (``from_lm``); and the programs that write target folders: ``make_tiny_target`` (the
committed ``data/tiny-llava``), ``make_large_target`` (7B/13B-shaped random folders for the GPU
session), ``make_smollm2_llava`` (the real-LM target, ``data/smollm2-llava``)."""
