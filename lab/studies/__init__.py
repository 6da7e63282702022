"""Studies: experiments that train and evaluate heads to answer one question each (ablations,
on-policy training, draft positions, the real-LM study in ``real_lm/``); results under
``benchmarks/``. Run from the repository root, ``python -m lab.studies.<name>``."""
