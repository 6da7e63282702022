"""End to end on a real vLLM engine: the embedded tiny LLaVA, a head fitted to it, exported
with format=vllm and served through the serving check (msd_train/serving/check.py).

Needs vLLM: it runs in the environment scripts/vllm_env.sh builds and skips elsewhere:

    bash scripts/vllm_env.sh .venv-vllm
    .venv-vllm/bin/python -m pytest -q tests/serving/test_vllm_serving.py
"""

import json

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; build its environment with scripts/vllm_env.sh "
                                   "and run this file with that environment's python")

import torch  # noqa: E402
from builders import TINY_IMAGE_BENCH as BENCH
from builders import TINY_TARGET as TARGET
from builders.heads import train_head

from msd_train.hub.vllm import export_vllm  # noqa: E402
from msd_train.serving import check  # noqa: E402
from msd_train.serving.target import vllm_target  # noqa: E402

K, NEW = 4, 24


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A head fitted to the target's answers to the benchmark's image prompts, exported,
    then the serving check's runs: vLLM plain, with the plugin, and stock."""

    from msd_train.evaluation.bench import load_bench
    from msd_train.targets import load_target

    root = tmp_path_factory.mktemp("vllm")
    target = load_target(str(TARGET), "float32", torch.device("cpu"))
    prompts = [target.encode_prompt([{"role": "user", "content": it.turns[0]}], it.load_images())
               for it in load_bench(BENCH)]
    export_vllm(train_head(target, prompts, steps=120), root / "head")
    got = check.project_prompts({"name_or_path": str(TARGET), "dtype": "float32"}, BENCH, str(root / "head"), K, NEW)
    spec = {"target": str(vllm_target(TARGET, root / "cache")), "k": K, "max_new_tokens": NEW, "dtype": "float32",
            "max_model_len": 512, "turns": got["turns"], "max_images": 1, "method": "eagle"}
    runs = {mode: check.vllm_process({**spec, "draft": None if mode == "ar" else str(root / "head")}, mode, root)
            for mode in check.MODES}
    return got, runs, check.compare(got, runs)


def test_vllm_serves_the_exported_head_losslessly_with_the_plugin_and_without(served):
    got, runs, report = served
    n = len(got["turns"])
    assert n == 3 and all(t["images"] for t in got["turns"])
    vllm = report["vllm"]
    assert vllm["ar"]["outputs_equal_project_ar"] == n  # vLLM reads the converted target as transformers does
    for mode in ("plugin", "stock"):
        assert vllm[mode]["outputs_equal_vllm_ar"] == n and vllm[mode]["outputs_equal_project_ar"] == n
        assert vllm[mode]["counters"]["num_drafts"] > 0 and vllm[mode]["counters"]["num_accepted_tokens"] > 0
    assert vllm["plugin"]["draft_class"] == "MSDEagleLlamaForCausalLM"
    assert vllm["stock"]["draft_class"] == "EagleLlamaForCausalLM"


def test_vllm_drafts_as_the_project_does_in_each_mode(served):
    """Same head, prompts and k: vLLM with the plugin accepts what the project's chain
    accepts, and stock vLLM what the project's chain accepts with the head in compatible
    mode (fp32 on both sides; benchmarks/serving/README.md states the tolerance)."""
    _, _, report = served
    vllm = report["vllm"]
    assert vllm["plugin"]["mean_acceptance_length"] == pytest.approx(report["project"]["tau"], abs=0.05)
    assert vllm["stock"]["mean_acceptance_length"] == pytest.approx(report["project_compatible"]["tau"], abs=0.05)


def test_vllm_reads_the_speculators_config_the_msd3_export_writes(tmp_path):
    """vLLM's own speculators config class turns an msd3 export into an eagle3 draft config."""
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    from msd_train.draft import MSD3DraftConfig, MSD3DraftModel

    head = MSD3DraftModel(MSD3DraftConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                          target_vocab_size=100, target_hidden_size=64, target_num_layers=6,
                                          draft_vocab_size=40, rope_theta=10000.0))
    export_vllm(head, tmp_path / "h", verifier="org/target")
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    assert SpeculatorsConfig.extract_vllm_speculative_config(config) == {"method": "eagle3",
                                                                         "num_speculative_tokens": 5}
    layer = SpeculatorsConfig.extract_transformers_pre_trained_config(config)
    assert layer["architectures"] == ["Eagle3LlamaForCausalLM"] and layer["norm_before_residual"] is False
    assert layer["eagle_aux_hidden_state_layer_ids"] == head.feature_layers and layer["draft_vocab_size"] == 40
