"""The lab: every developer program, and what builds, checks and measures the product; never
part of it.

``msd_train`` is the product (what a user's command or import runs) and ``scripts/`` its user
commands; this package holds everything else, by purpose:

* ``tiny/``: the builder of the embedded tiny target and its data;
* ``targets/``: random targets of every family (``random``), the tiny Qwen2-VL (``tiny_qwen``), a
  LLaVA from a text-only LM (``from_lm``), and the programs that write target folders
  (``make_tiny_target``, ``make_large_target``, ``make_smollm2_llava``);
* ``data/``: programs that write data for measurements (``make_scale_data``, ``sharegpt_prefix``);
* ``bench/``: one program per measured piece of the product (decoder, training, features, ...);
* ``studies/``: experiments that train and evaluate heads (``real_lm/``: the real-LM study);
* ``gpu/``: the GPU session (``session``);
* ``cli`` (argument types), ``transfers`` (device-to-host reads), ``capture`` (a CPU stand-in
  for CUDA graph capture): the instruments the tests and programs share.

It is not installed: programs run from the repository root (``python -m lab.bench.train``), the
tests reach it through pytest's ``pythonpath``. Nothing in ``msd_train`` or ``scripts/`` imports
it (``tests/contracts/test_layering.py``, ``tests/contracts/test_one_lab.py``).
"""
