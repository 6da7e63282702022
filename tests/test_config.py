"""The Hydra config tree: defaults, struct mode, launcher arguments."""

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigAttributeError

from msd_train.config import CONF_DIR, REPO_ROOT, strip_launcher_args


def _compose(overrides=()):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def test_defaults_select_the_embedded_target_and_data():
    cfg = _compose()
    assert cfg.target.name_or_path == str(REPO_ROOT / "data" / "tiny-llava")
    assert cfg.data.text[0].path == str(REPO_ROOT / "data" / "tiny" / "sharegpt_train.json")
    assert cfg.stage.id == 1 and cfg.stage.curriculum.end == 0.0


@pytest.mark.parametrize("name,hub_id", [("llava15_7b", "llava-hf/llava-1.5-7b-hf"),
                                         ("llava15_13b", "llava-hf/llava-1.5-13b-hf"),
                                         ("qwen2vl_7b", "Qwen/Qwen2-VL-7B-Instruct"),
                                         ("qwen25vl_7b", "Qwen/Qwen2.5-VL-7B-Instruct")])
def test_real_targets_point_at_hub_ids(name, hub_id):
    assert _compose([f"target={name}"]).target.name_or_path == hub_id


def test_misspelt_key_is_an_error_naming_it():
    with pytest.raises(ConfigCompositionException, match="train.max_stpes"):
        _compose(["train.max_stpes=3"])
    cfg = _compose()
    with pytest.raises(ConfigAttributeError, match="learning_rate"):
        _ = cfg.train.learning_rate


def test_stage_two_and_deepspeed_groups():
    cfg = _compose(["stage='2'", "deepspeed=zero3"])
    assert cfg.stage.id == 2 and cfg.stage.curriculum.end > 0
    assert cfg.deepspeed.zero_optimization.stage == 3


def test_launcher_arguments_are_made_hydra_safe(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    argv = ["train.py", "--local_rank=1", "stage=1", "--local-rank", "1", "run_dir=x"]
    strip_launcher_args(argv)
    assert argv == ["train.py", "stage='1'", "run_dir=x"]
    import os

    assert os.environ["LOCAL_RANK"] == "1"
