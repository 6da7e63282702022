"""The lab: what builds, checks and measures the product, never part of it.

``msd_train`` is the product (what a user's command or import runs); this package holds the
builders of the embedded tiny target (``tiny``) and of random and derived targets
(``targets``), the decoder's instruments (``transfers``: device-to-host reads; ``capture``: a
CPU stand-in for CUDA graph capture) and, under ``scripts/``, the bench and experiment
programs. Tests, scripts and benchmarks import it; nothing in ``msd_train`` does
(``tests/contracts/test_layering.py``).
"""
