"""Training an msd3 head through the recipe: both stages, validation, export, resume."""

import json

import pytest
import torch
from builders.runs import recipe

from msd_train.draft import MSD3DraftModel, MSDDraftModel

pytestmark = pytest.mark.usefixtures("in_process")  # one DeepSpeed process group for the module


def run_steps(r):
    out = []
    while r.step < r.cfg.train.max_steps:
        m = r.train_step()
        r.step += 1
        out.append([m["loss"], m["acc_0"], m["acc_1"], m["top1"], m["tokens"], m["mm_share"]])
    return out


MSD3 = ["head=msd3", "draft.ttt_steps=3", "train.micro_batch_size=2", "eval.rollout=3", "eval.batch_size=4"]


@pytest.mark.slow
def test_two_stages_validation_and_export(mini_run, tmp_path):
    r = recipe(["stage='1'", *mini_run, *MSD3, "train.max_steps=2", f"run_dir={tmp_path}"])
    assert isinstance(r.engine.module, MSD3DraftModel)
    assert r.draft.feature_layers == [0, 1]  # the 2-layer target: inputs of its layers 0 and 1
    # the draft vocabulary holds the stage's assistant tokens (the mini vocabulary is smaller than 32000)
    assert r.draft.config.draft_vocab_size == r.target.vocab_size
    m = r.train_step()
    assert {"loss", "top1", "acc_0", "acc_1", "acc_2"} <= set(m) and m["loss"] > 0
    res = r.validate()
    assert 1.0 <= res["sim_tau"] <= 4.0 and len(res["text"]["agree_cond"]) == 3
    r.step = 1
    r.export("final")
    saved = json.loads((tmp_path / "stage1" / "final" / "config.json").read_text())
    assert saved["model_type"] == "msd3_draft" and saved["ttt_steps"] == 3
    head = MSDDraftModel.from_pretrained(tmp_path / "stage1" / "final")
    assert isinstance(head, MSD3DraftModel) and torch.equal(head.t2d, r.draft.t2d.cpu())

    s2 = recipe(["stage='2'", *mini_run, *MSD3, "train.max_steps=2", "stage.curriculum.start=0.5",
                 "stage.curriculum.end=0.5", f"run_dir={tmp_path}"])
    assert isinstance(s2.engine.module, MSD3DraftModel)
    for k, v in head.state_dict().items():
        assert torch.equal(s2.engine.module.state_dict()[k].cpu(), v), k
    rows = run_steps(s2)
    assert any(row[5] > 0 for row in rows) and all(row[0] > 0 for row in rows)
    res = s2.validate()  # the held-out image conversations: the unrolled steps over visual inputs
    assert 1.0 <= res["mm"]["sim_tau"] <= 4.0 and res["mm"]["loss"] > 0

    # a stage-2 launch with the other architecture names the mismatch
    with pytest.raises(Exception, match="holds an msd3 head"):
        recipe(["stage='2'", *mini_run, "train.max_steps=1", f"run_dir={tmp_path}"])


@pytest.mark.slow
def test_resume_is_exact(mini_run, tmp_path):
    common = ["stage='1'", *mini_run, *MSD3, "train.max_steps=4", "checkpoint.every=2", "eval.every=100"]
    straight = recipe([*common, f"run_dir={tmp_path / 'straight'}"])
    want = run_steps(straight)
    cut = recipe([*common, f"run_dir={tmp_path / 'cut'}"])
    got = [row for _ in range(2) for row in [cut.train_step()] if not setattr(cut, "step", cut.step + 1)]
    cut.save_checkpoint()
    resumed = recipe([*common, f"run_dir={tmp_path / 'cut'}"])
    assert resumed.step == 2
    rest = run_steps(resumed)
    assert [[g["loss"], g["top1"]] for g in got] == [[w[0], w[3]] for w in want[:2]]
    assert rest == want[2:]
    a, b = straight.engine.module.state_dict(), resumed.engine.module.state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_gradient_checkpointing_trains_the_same_steps_and_recomputes_the_layer(mini_run, tmp_path):
    """train.gradient_checkpointing=true with head=msd3: the same losses and accuracies as
    without it, and the layer runs again in the backward pass of every unrolled step."""
    rows, calls = {}, {}
    for on in (False, True):
        r = recipe(["stage='1'", *mini_run, *MSD3, "train.max_steps=2", "data.max_heldout=2",
                    f"train.gradient_checkpointing={str(on).lower()}", f"run_dir={tmp_path / str(on)}"])
        mlp = r.engine.module.midlayer.mlp
        calls[on] = [0]

        # The MLP's own forward, counted: module hooks are not run again when a checkpoint recomputes.
        def counted(*args, _forward=mlp.forward, _count=calls[on]):
            _count[0] += 1
            return _forward(*args)
        mlp.forward = counted
        rows[on] = run_steps(r)
    assert rows[True] == rows[False]
    assert calls[False] == [2 * 3] and calls[True] == [2 * 2 * 3]  # 2 steps x 3 unrolled steps (x2: recomputed)


def test_settings_an_msd3_head_cannot_take_are_named(mini_run, tmp_path):
    with pytest.raises(Exception, match="draft.architecture='msd4' is no head architecture"):
        recipe(["stage='1'", *mini_run, "draft.architecture=msd4", f"run_dir={tmp_path / 'name'}"])
