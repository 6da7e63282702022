import os
import sys
from pathlib import Path

import pytest

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
