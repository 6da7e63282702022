"""The real-LM study (``benchmarks/real_lm/README.md``): heads trained and decoded on the
SmolLM2-LLaVA target on a CPU. Python programs run as ``python -m lab.studies.real_lm.<name>``, the
shell drivers as ``lab/studies/real_lm/<name>.sh``, both from the repository root."""
