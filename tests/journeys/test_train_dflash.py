"""Training a dflash head through the recipe on the embedded default: stage 1 then stage 2
from its export (the same data, curriculum, validation and export as every head), and a
feature store without the head's layers refused naming the command that writes one."""

import json

import pytest
import torch
from builders.runs import recipe

from msd_train.draft import DFlashDraftModel, MSDDraftModel
from msd_train.hub import load_head

pytestmark = pytest.mark.usefixtures("in_process")  # one DeepSpeed process group for the module

FAST = ["head=dflash", "train.micro_batch_size=2", "eval.every=1000", "eval.rollout=3", "eval.batch_size=4",
        "data.max_heldout=4"]


def run_steps(r):
    rows = []
    while r.step < r.cfg.train.max_steps:
        rows.append(r.train_step())
        r.step += 1
    return rows


def test_stage_1_then_stage_2_train_validate_and_export(tmp_path):
    r = recipe(["stage='1'", *FAST, "train.max_steps=2", f"run_dir={tmp_path}"])
    assert type(r.engine.module) is DFlashDraftModel
    assert r.draft.config.block_size == 4 and r.draft.feature_layers == [3]  # the embedded 4-layer target
    before = {k: v.clone() for k, v in r.draft.state_dict().items()}
    rows = run_steps(r)
    assert all(m["loss"] > 0 and {"acc_0", "acc_1", "acc_2", "top1"} <= set(m) for m in rows)
    assert any(not torch.equal(before[k], v) for k, v in r.draft.state_dict().items())
    res = r.validate()
    assert 1.0 <= res["sim_tau"] <= 4.0 and len(res["text"]["agree_cond"]) == 3
    r.export("final")
    saved = json.loads((tmp_path / "stage1" / "final" / "config.json").read_text())
    assert saved["model_type"] == "dflash_draft" and saved["block_size"] == 4 and saved["loss_decay_gamma"] == 2.0

    s2 = recipe(["stage='2'", *FAST, "train.max_steps=2", "stage.curriculum.start=1.0", "stage.curriculum.end=1.0",
                 "draft.decouple_visual=false", f"run_dir={tmp_path}"])
    head = MSDDraftModel.from_pretrained(tmp_path / "stage1" / "final")
    for k, v in head.state_dict().items():  # stage 2 starts from stage 1's export
        assert torch.equal(s2.engine.module.state_dict()[k].cpu(), v), k
    assert s2.draft.config.decouple_visual is False  # a key the head lets a later stage change
    rows = run_steps(s2)
    assert all(m["mm_share"] == 1.0 and m["loss"] > 0 for m in rows)  # image conversations only
    res = s2.validate()
    assert 1.0 <= res["mm"]["sim_tau"] <= 4.0 and res["mm"]["loss"] > 0
    s2.export("final")
    back = load_head(tmp_path / "stage2" / "final", s2.target)
    assert type(back) is DFlashDraftModel and back.config.decouple_visual is False

    with pytest.raises(Exception, match="holds a dflash head"):  # another head kind cannot continue it
        recipe(["stage='2'", "train.max_steps=1", f"run_dir={tmp_path}"])


def test_a_feature_store_without_the_heads_layers_is_refused(mini_run, tmp_path):
    from builders.runs import gen_cfg

    from msd_train.features.generate import generate
    from msd_train.features.store import FeatureStoreError

    generate(gen_cfg(mini_run, tmp_path / "plain", "splits=[text,heldout_text]"))
    with pytest.raises(FeatureStoreError, match=r"generate a store with features.layers=\[1\]"):
        recipe(["stage='1'", *mini_run, *FAST, "train.max_steps=1", "features=offline",
                f"features.path={tmp_path / 'plain'}", f"run_dir={tmp_path / 'run'}"])
    # draft.feature_layers=[N] reads the target's last output, what an msd store holds: it trains from it
    r = recipe(["stage='1'", *mini_run, *FAST, "train.max_steps=1", "features=offline", "draft.feature_layers=[2]",
                f"features.path={tmp_path / 'plain'}", f"run_dir={tmp_path / 'last'}"])
    assert r.draft.feature_layers is None and r.draft.reads_last_output
    assert run_steps(r)[0]["loss"] > 0
