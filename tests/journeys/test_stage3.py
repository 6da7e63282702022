"""Stage 3 (conf/stage/3.yaml): a trained head refined on its own drafts, in process on the
embedded tiny target; its refusals; its resume; from a feature store over a train vocabulary."""

from __future__ import annotations

import json

import pytest
import torch
from builders.runs import compose, gen_cfg, recipe
from safetensors.torch import load_file

from msd_train.data.collate import collate
from msd_train.draft.loss import draft_loss_mask, loss_index

pytestmark = pytest.mark.usefixtures("in_process")


def rollout_loss(r, batch) -> float:
    """The stage's own (on-policy) loss of the head on one fixed training batch, no noise."""
    module = r.engine.module
    module.eval()
    try:
        with torch.no_grad():
            feats = r.features(batch)
            index = loss_index(draft_loss_mask(batch["loss_mask"]))
            loss, _ = r.objective.training_loss(r.target, feats, index, float(index.numel()), r.cfg.train)
    finally:
        module.train()
    return float(loss)


@pytest.fixture(scope="module")
def stage2_run(tmp_path_factory):
    """A short stage 1 + stage 2 on the embedded default: a head worth refining."""
    run = tmp_path_factory.mktemp("run")
    common = [f"run_dir={run}", f"data.cache_dir={run / 'cache'}", "checkpoint.every=1000", "eval.every=1000"]
    for stage, steps in (("1", 80), ("2", 40)):
        r = recipe([f"stage='{stage}'", f"train.max_steps={steps}", "stage.curriculum.ramp_steps=20", *common])
        r.train()
    return run, common


@pytest.mark.slow
def test_stage3_refines_the_stage2_head_on_its_own_drafts(stage2_run):
    run, common = stage2_run
    r = recipe(["stage='3'", "train.max_steps=24", *common])
    assert r.objective.kind == "on_policy" and r.cfg.train.rollout_steps == 5
    batch = collate([r.text[i] for i in range(8)], r.target, pixels=True)
    before, tau_before = rollout_loss(r, batch), r.validate()["sim_tau"]
    r.train()
    after, tau_after = rollout_loss(r, batch), r.validate()["sim_tau"]
    print(f"stage 3, 24 steps: rollout loss on a training batch {before:.4f} -> {after:.4f}; "
          f"held-out simulated tau {tau_before:.3f} -> {tau_after:.3f}")
    assert after < 0.99 * before  # measured: 1.267 -> 1.238, held-out simulated tau 1.466 -> 1.508
    final = run / "stage3" / "final"
    weights = load_file(final / "model.safetensors")
    start = load_file(run / "stage2" / "final" / "model.safetensors")
    assert weights.keys() == start.keys() and any(not torch.equal(weights[k], start[k]) for k in weights)
    meta = json.loads((final / "training.json").read_text())
    assert meta["stage"] == 3 and meta["config"]["train"]["objective"] == "on_policy"
    steps = [json.loads(x) for x in (run / "stage3" / "metrics.jsonl").read_text().splitlines() if '"acc_4"' in x]
    assert len(steps) == 24 and all(0 < s["reach_4"] < s["reach_1"] < 1 for s in steps)


@pytest.mark.slow
def test_a_relaunched_stage3_resumes_where_it_stopped(stage2_run, tmp_path):
    run, common = stage2_run
    init = f"stage.init_from={run / 'stage2' / 'final'}"
    args = ["stage='3'", "train.max_steps=4", "train.rollout_steps=3", init, *common[1:]]
    straight = recipe([*args, f"run_dir={tmp_path / 'straight'}"])
    straight.train()
    cut = recipe([*args, f"run_dir={tmp_path / 'cut'}"])
    for _ in range(2):
        cut.train_step()
        cut.step += 1
    cut.save_checkpoint()
    resumed = recipe([*args, f"run_dir={tmp_path / 'cut'}"])
    assert resumed.step == 2
    resumed.train()
    a = load_file(tmp_path / "straight" / "stage3" / "final" / "model.safetensors")
    b = load_file(tmp_path / "cut" / "stage3" / "final" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


def test_stage3_from_a_feature_store_over_a_train_vocabulary(mini_run, tmp_path):
    from msd_train.features.generate import generate

    generate(gen_cfg(mini_run, tmp_path / "store"))
    common = [*mini_run, "train.micro_batch_size=2", "eval.every=1000", "checkpoint.every=1000",
              f"run_dir={tmp_path}"]
    recipe(["stage='1'", "train.max_steps=2", *common]).train()
    offline = ["features=offline", f"features.path={tmp_path / 'store'}", "draft.train_vocab=32",
               f"stage.init_from={tmp_path / 'stage1' / 'final'}"]
    r = recipe(["stage='3'", "train.max_steps=3", "train.rollout_steps=3", *offline, *common])
    assert r.objective.train_vocab.size == 32
    r.train()
    assert json.loads((tmp_path / "stage3" / "final" / "config.json").read_text())["train_vocab"] == 32
    # a store made for stage 1 (text only) lacks stage 3's multimodal conversations: named, with the fix
    generate(gen_cfg(mini_run, tmp_path / "text-store", "splits=[text,heldout_text]"))
    # (a run_dir of its own: in this one, stage 3's finished checkpoints with other settings are refused first)
    fresh = [*common[:-1], f"run_dir={tmp_path / 'fresh'}"]
    with pytest.raises(Exception, match=r"data.multimodal: not in the store[\s\S]*regenerate it"):
        recipe(["stage='3'", *offline[:1], f"features.path={tmp_path / 'text-store'}", *offline[2:], *fresh])


def launch(overrides, capsys):
    """``train.py``'s run with these overrides in process: its exit code and what it printed."""
    from msd_train.training import run

    cfg = compose("config", ["logging.wandb.mode=disabled", "logging.progress=false", *overrides])
    with pytest.raises(SystemExit) as exit_:
        run(cfg)
    out = capsys.readouterr()
    return exit_.value.code, out.out + out.err


def test_stage3_refusals_name_the_fix(tmp_path, capsys, monkeypatch):
    import msd_train.training.recipe as training_recipe  # imported before the patch, restored after it

    def no_load(*a, **k):
        raise AssertionError("the target was loaded before the refusal")

    monkeypatch.setattr(training_recipe, "load_target", no_load)
    from transformers import AutoConfig

    from msd_train.config import CONF_DIR
    from msd_train.draft import MSDDraftConfig, MSDDraftModel

    tiny = str(CONF_DIR.parent / "data" / "tiny-llava")
    head = tmp_path / "head"
    MSDDraftModel(MSDDraftConfig.from_target_config(AutoConfig.from_pretrained(tiny), tiny)).save_pretrained(head)
    # no trained head where stage 3 starts
    code, out = launch(["stage='3'", f"run_dir={tmp_path / 'fresh'}"], capsys)
    assert code == 1 and "stage2/final (stage.init_from), which holds no exported head; run stage=2 with the " \
                          "same run_dir first" in out and "Traceback" not in out
    # on-policy training of a fresh head
    code, out = launch(["stage='3'", "stage.init_from=null", f"run_dir={tmp_path / 'null'}"], capsys)
    assert code == 1 and "refines a trained head" in out and "set stage.init_from=DIR" in out
    # a head of another target (its vocabulary, its hidden size)
    for key, value, what in (("target_vocab_size", 999, "vocabulary size 999"),
                             ("target_hidden_size", 8, "hidden size 8")):
        other = tmp_path / key
        other.mkdir()
        for f in head.iterdir():
            (other / f.name).write_bytes(f.read_bytes())
        config = json.loads((other / "config.json").read_text())
        (other / "config.json").write_text(json.dumps({**config, key: value}))
        code, out = launch(["stage='3'", f"stage.init_from={other}", f"run_dir={tmp_path / ('o' + key)}"], capsys)
        assert code == 1 and f"was trained for a target with {what}" in out and "head of another target" in out


@pytest.mark.parametrize("key,value,phrase", [
    ("train.objective", "onpolicy", "is not one of supervised, on_policy"),
    ("train.rollout_steps", 0, "must be at least 1"),
    ("train.rollout_weight", "chain", "is not one of reach, uniform"),
])
def test_on_policy_settings_are_checked_before_loading(key, value, phrase):
    from msd_train.validate import ConfigError, check_train

    *parents, last = key.split(".")
    with pytest.raises(ConfigError, match=rf"^{key}=\S+ {phrase}"):
        check_train({parents[0]: {last: value}})


def test_an_msd_rollout_with_gradient_checkpointing_is_refused(mini_run, head_dir, tmp_path):
    """Checkpointed decoder layers drop the cache the later rollout steps read (transformers
    turns it off), which would fail mid-step; refused at setup with the fix."""
    with pytest.raises(Exception, match="set train.gradient_checkpointing=false"):
        recipe(["stage='3'", *mini_run, f"stage.init_from={head_dir}", "train.gradient_checkpointing=true",
                f"run_dir={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}"])
