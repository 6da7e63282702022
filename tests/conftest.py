import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
