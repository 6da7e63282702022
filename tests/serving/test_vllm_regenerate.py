"""Regeneration through vLLM (``scripts/regenerate_data.py engine=vllm``) on the embedded
tiny LLaVA: text and image conversations answered in one batched call each, greedy, fp32,
token for token what the project's own decoder answers.

Needs vLLM: it runs in the environment scripts/vllm_env.sh builds and skips elsewhere:

    .venv-vllm/bin/python -m pytest -q tests/serving/test_vllm_regenerate.py
"""

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; build its environment with scripts/vllm_env.sh "
                                   "and run this file with that environment's python")

from msd_train.data.engines import HFEngine, Sampling  # noqa: E402
from msd_train.data.regenerate import MERGED, regenerate  # noqa: E402
from msd_train.serving.regenerate import VLLMEngine  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "data" / "tiny-llava"
SOURCES = {"text": {"path": str(ROOT / "data/tiny/sharegpt_train.json"), "format": "auto"},
           "images": {"path": str(ROOT / "data/tiny/llava_train.json"), "format": "auto",
                      "image_root": str(ROOT / "data/tiny/images")}}


def settings(out, source, **kw):
    return {"out": str(out), "inputs": [SOURCES[source]], "limit": 6, "max_new_tokens": 16, "max_turns": 2,
            "max_prompt_tokens": 400, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0, "progress": False, **kw}


def answers(out):
    return [(r["key"], r["messages"], r["regenerated"]["new_tokens"])
            for r in map(json.loads, (Path(out) / MERGED).read_text().splitlines())]


@pytest.mark.parametrize("source", ["text", "images"])
def test_vllm_answers_equal_the_projects_decoder(source, tmp_path, vllm_engine, target):
    got = regenerate(target, settings(tmp_path / "vllm", source), engine=vllm_engine)
    want = regenerate(target, settings(tmp_path / "hf", source))
    assert got["engines"] == {vllm_engine.name: got["conversations"]} and vllm_engine.name.startswith("vllm")
    assert got["turns"] == want["turns"] and got["new_tokens"] == want["new_tokens"]
    assert got["conversations"] >= 4 and got["turns"] > got["conversations"]  # two-turn conversations, turn by turn
    assert answers(tmp_path / "vllm") == answers(tmp_path / "hf")


@pytest.fixture(scope="module")
def target():
    from msd_train.targets import load_target

    return load_target(str(TARGET), "float32", "cpu")


@pytest.fixture(scope="module")
def vllm_engine(target, tmp_path_factory):
    return VLLMEngine(target, str(TARGET), Sampling(16), max_model_len=416, batch_size=8,
                      cache=str(tmp_path_factory.mktemp("vllm-targets")))


def test_hf_engine_name_says_how_it_answered(target):
    assert HFEngine(target, Sampling(4)).name.startswith("hf decoder transformers")
