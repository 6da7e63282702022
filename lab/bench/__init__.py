"""Bench programs: each times one part of the product and writes a table under ``benchmarks/``
(the results README there names the program and its command). Run from the repository root,
``python -m lab.bench.<name> --help``."""
