"""The real-LM study (``benchmarks/real_lm/README.md``): heads trained and decoded on the
SmolLM2-LLaVA target on a CPU. Python programs run as ``python -m lab.studies.real_lm.<name>``, the
shell driver (scale_collect.sh) as ``lab/studies/real_lm/<name>.sh``, both from the repository root;
the runs themselves are the product's commands (docs/recipes.md, ``experiment=smollm2_llava``)."""
