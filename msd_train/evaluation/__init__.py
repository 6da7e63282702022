"""Benchmark runner, metrics, reports and plots for the speculative decoder.

Needs only torch and transformers (plus tqdm; matplotlib for the plot, skipped when
missing; ``datasets`` only for ``bench=hf``). ``eval.py`` is the Hydra front end.
"""

from msd_train.evaluation.bench import BenchItem, load_bench, load_conversations, load_hf, load_jsonl
from msd_train.evaluation.metrics import DEFINITIONS, summarize, summarize_by_category
from msd_train.evaluation.report import write_report
from msd_train.evaluation.run import decode_config, run_eval
from msd_train.evaluation.runner import answer_turns, evaluate

__all__ = [
    "BenchItem", "DEFINITIONS", "answer_turns", "decode_config", "evaluate", "load_bench", "load_conversations",
    "load_hf", "load_jsonl", "run_eval", "summarize", "summarize_by_category", "write_report",
]
