"""The embedded default target: a tiny, *trained* LLaVA, and the small datasets it was
trained on (``data/tiny-llava/``, ``data/tiny/``; built by ``lab/targets/make_tiny_target.py``).

Everything is made on a CPU from material present on any machine, deterministically:

* ``data``: the data recipe, in one place (sizes, splits, categories, files written);
* ``text``: conversations about Python's standard library (its own docstrings and
  signatures), ShareGPT format;
* ``images``: coloured shapes on a 3x3 grid and scikit-learn's handwritten digits rendered
  as 48 px PNGs, and the questions about them, LLaVA-Instruct format;
* ``tokenizer``: a byte-level BPE tokenizer trained on the training text, the processor,
  and conversations formatted as the rest of the project formats them;
* ``model``: the ``LlavaForConditionalGeneration`` (CLIP vision tower, 2-layer GELU
  projector, Llama language model) and its training on assistant tokens only;
* ``quality``: the bar ``tests/lab_tools/test_tiny_target.py`` checks (held-out cross-entropy, and
  how often swapping the image changes the answer).

Heavy dependencies (scikit-learn, tokenizers, transformers) are imported where used.
"""
