"""The tests, by where to look:

* ``unit/``: one piece of the library each (data, decoding, draft, hub, features, ...);
* ``contracts/``: promises across the whole product: every target family behaves alike,
  the import layering, the error messages, nothing a user made is ever lost;
* ``journeys/``: a user's command end to end on the tiny targets (train, eval, check_data);
* ``lab_tools/``: the lab's builders and bench programs (``lab/``);
* ``serving/``: vLLM, in the environment ``scripts/vllm_env.sh`` builds (they skip elsewhere).

Shared helpers live in ``builders/`` (targets, images, heads, runs, the sampling fakes) and
the shared fixtures here; no test file imports another. ``pytest -m "not slow"`` leaves out
the launcher journeys and long statistical tests.
"""

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist the workers share the cores: each takes its part (torch would take them all in each)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


@pytest.fixture(scope="session")
def llava_target():
    from builders import tiny_llava_target

    return tiny_llava_target()


@pytest.fixture(scope="session")
def qwen_target():
    from builders import tiny_qwen2vl_target

    return tiny_qwen2vl_target()


@pytest.fixture(scope="session")
def mini_run(tmp_path_factory):
    """A saved random tiny LLaVA and a few conversations of each kind: Hydra overrides."""
    from builders import random_image, tiny_llava, write_mini_data

    root = tmp_path_factory.mktemp("mini")
    model, proc = tiny_llava(seed=1)
    model.save_pretrained(root / "target")
    proc.save_pretrained(root / "target")
    data = write_mini_data(root, 40, 8, lambda i: random_image(100 + i, 16), (5, 8, 3, 6))
    return [f"target.name_or_path={root / 'target'}", *data, "logging.wandb.mode=disabled", "logging.progress=false"]


@pytest.fixture(scope="module")
def one_thread():
    """Tiny-model tests: one torch thread (thread hand-offs cost more than tiny matmuls save)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def target_dir(mini_run) -> str:
    """The mini run's target folder."""
    return next(o.split("=", 1)[1] for o in mini_run if o.startswith("target.name_or_path="))


@pytest.fixture(scope="module")
def mini_target(target_dir):
    """The mini run's target, loaded."""
    from msd_train.targets import load_target

    return load_target(target_dir)


@pytest.fixture(scope="session")
def head_dir(target_dir, tmp_path_factory) -> str:
    """A random head for the mini run's target, saved as an export folder."""
    from transformers import AutoConfig

    from msd_train.draft import MSDDraftConfig, MSDDraftModel

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("head")
    config = MSDDraftConfig.from_target_config(AutoConfig.from_pretrained(target_dir), target_dir)
    MSDDraftModel(config).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def llava_setup(llava_target):
    from builders.heads import conversations, train_head

    prompts = conversations(llava_target)
    return llava_target, train_head(llava_target, list(prompts.values())), prompts


@pytest.fixture(scope="module")
def qwen_setup(qwen_target):
    from builders.heads import conversations, train_head

    prompts = conversations(qwen_target)
    return qwen_target, train_head(qwen_target, list(prompts.values())), prompts


@pytest.fixture(params=["llava", "qwen2_vl"])
def setup(request):
    return request.getfixturevalue("llava_setup" if request.param == "llava" else "qwen_setup")


# DeepSpeed keeps its process group for the life of the process (it cannot be made twice), so
# the in-process recipes below share one and leave it for the process's end.


@pytest.fixture(scope="module")
def in_process():
    saved = dict(os.environ)
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the numbers below were recorded with one thread
    yield
    torch.set_num_threads(n)
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def base_and_adapter(tmp_path_factory):
    """A tiny LLaVA saved as a model folder, and a LoRA adapter made for it with peft."""
    from builders import tiny_llava
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("peft")
    model, processor = tiny_llava()
    model.save_pretrained(root / "base")
    processor.save_pretrained(root / "base")
    config = LoraConfig(r=4, lora_alpha=12, lora_dropout=0.0,
                        target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)")
    peft_model = get_peft_model(tiny_llava()[0], config)
    torch.manual_seed(1)
    with torch.no_grad():  # lora_B starts at zero; a trained adapter would not be
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.2)
    peft_model.save_pretrained(root / "lora")
    return root / "base", root / "lora", processor
