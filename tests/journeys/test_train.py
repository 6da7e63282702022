"""Training runs through the real entry point and launchers (CPU, gloo)."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from builders.runs import gen_cfg, recipe
from safetensors.torch import load_file

from msd_train.runtime import free_port

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def train(args, launcher=(sys.executable,), check=True, **kw):
    cmd = [*launcher, str(ROOT / "train.py"), *args]
    out = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900, **kw)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}")
    return out


def weights(run_dir, stage=1, name="final"):
    return load_file(Path(run_dir) / f"stage{stage}" / name / "model.safetensors")


def losses(run_dir, stage=1):
    lines = (Path(run_dir) / f"stage{stage}" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["loss"] for x in lines if '"loss"' in x and "val/" not in x]


# ----------------------------------------------------------------------------- in one process


def run_steps(r):
    out = []
    while r.step < r.cfg.train.max_steps:
        m = r.train_step()
        r.step += 1
        out.append([m["loss"], m["feat_loss"], m["tok_loss"], m["top1"], m["tokens"], m["mm_share"]])
    return out


# Losses of the embedded default (micro-batch 2, grad_accum 2, one thread), recorded from main
# before collation moved into a DataLoader (commit e076b59): [loss, feat, tok, top1, tokens, mm_share].
# Recorded under transformers 5.23; newer kernels move the losses in the 8th digit, so the
# recording is compared to 1e-6 (same batches, same tokens), and the two collation paths of
# this run to each other bit for bit.
BEFORE_STAGE1 = [
    [1.3633502795778472, 0.6049348732520794, 7.584154063257678, 0.008620689655172414, 222.0, 0.0],
    [1.357468205620261, 0.6038107815910788, 7.53657424029182, 0.023529411764705882, 171.0, 0.0],
    [1.3685952345530192, 0.6067909929487441, 7.618042416042751, 0.0, 147.0, 0.0]]
BEFORE_STAGE2 = [  # 4 steps from that stage-1 head, multimodal share 0.5
    [1.3655710055504315, 0.6102024360939309, 7.553685694565008, 0.0, 238.0, 0.5],
    [1.3564982227443423, 0.6008699948025733, 7.556282279417687, 0.0, 294.0, 0.5],
    [1.3448454973174304, 0.5991795702678401, 7.456659270495903, 0.012195121951219513, 249.0, 0.5],
    [1.3648373699188234, 0.607368803024292, 7.574685668945312, 0.0, 263.0, 0.5]]


@pytest.mark.slow
def test_dataloader_losses_are_bit_identical_to_the_step_collation_of_before(in_process, tmp_path):
    common = [f"data.cache_dir={tmp_path / 'cache'}", "train.micro_batch_size=2", "train.grad_accum=2",
              f"run_dir={tmp_path}"]
    r = recipe(["stage='1'", "train.max_steps=3", "train.loader_workers=2", *common])
    assert_same_steps(run_steps(r), BEFORE_STAGE1)
    r.export("final")
    half = ["stage.curriculum.start=0.5", "stage.curriculum.end=0.5", "train.max_steps=4"]
    runs = []
    for workers in (0, 2):  # collated in the step's process, or ahead in worker processes
        r = recipe(["stage='2'", *half, f"train.loader_workers={workers}", *common])
        runs.append(run_steps(r))
        assert_same_steps(runs[-1], BEFORE_STAGE2)
    assert runs[0] == runs[1]


def assert_same_steps(got, recorded):
    for g, want in zip(got, recorded, strict=True):
        assert g[3:] == want[3:]  # top-1, tokens and multimodal share: exactly
        assert g[:3] == pytest.approx(want[:3], rel=1e-6, abs=0)


@pytest.mark.slow
def test_stages_differ_only_by_their_yaml(in_process, mini_run, tmp_path):
    """Stage 1 given stage 2's splits, start and curriculum trains exactly as stage 2: the code
    never branches on the stage."""
    r = recipe(["stage='1'", *mini_run, "train.max_steps=1", "train.micro_batch_size=2", f"run_dir={tmp_path}"])
    run_steps(r)
    r.export("final")
    s2 = ["train.max_steps=3", "stage.curriculum.start=0.5", "stage.curriculum.end=0.5", "stage.curriculum.ramp_steps=0",
          f"stage.init_from={tmp_path / 'stage1' / 'final'}", "train.micro_batch_size=2"]
    two = recipe(["stage='2'", *mini_run, *s2, f"run_dir={tmp_path / 'two'}"])
    as_one = recipe(["stage='1'", *mini_run, *s2, f"run_dir={tmp_path / 'one'}",
                     "stage.splits=[text,multimodal,heldout_text,heldout_multimodal]"])
    assert (len(as_one.mm), sorted(as_one.heldout)) == (len(two.mm), sorted(two.heldout)) == (32, ["mm", "text"])
    a, b = run_steps(two), run_steps(as_one)
    assert a == b and any(row[5] > 0 for row in a)
    # stage 2 without multimodal data in its splits says so
    with pytest.raises(Exception, match="stage.splits lacks multimodal"):
        recipe(["stage='2'", *mini_run, *s2, "stage.splits=[text]", f"run_dir={tmp_path / 'three'}"])


@pytest.mark.slow
def test_exports_carry_their_training_token_counts_and_count_tokens_writes_the_same(in_process, mini_run, tmp_path):
    """Every export holds token_counts.safetensors (the stage's assistant tokens, what
    decoding.draft_vocab ranks by); scripts/count_tokens.py writes the same file for a head
    that lacks it, from the same data."""
    from msd_train.draft.vocabulary import COUNTS_FILE, load_counts, token_counts

    r = recipe(["stage='1'", *mini_run, "train.max_steps=1", "train.micro_batch_size=2", f"run_dir={tmp_path}"])
    run_steps(r)
    r.export("final")
    final = tmp_path / "stage1" / "final"
    saved = load_counts(final)
    assert torch.equal(saved, token_counts([r.text], r.target.vocab_size)) and saved.sum() > 100
    (final / COUNTS_FILE).unlink()
    data = [o for o in mini_run if not o.startswith("logging.")]
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "count_tokens.py"), f"draft={final}", *data,
                          f"data.cache_dir={tmp_path / 'cache'}", "splits=[text]"],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert torch.equal(load_counts(final), saved)
    missing = subprocess.run([sys.executable, str(ROOT / "scripts" / "count_tokens.py"), f"draft={tmp_path / 'none'}",
                              *data], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert missing.returncode == 1 and "none" in missing.stderr and "Traceback" not in missing.stderr


def test_a_skipped_non_finite_micro_batch_keeps_deepspeed_on_the_recipes_step(in_process, mini_run, tmp_path):
    r = recipe(["stage='1'", *mini_run, "train.max_steps=4", "train.micro_batch_size=2", "train.grad_accum=2",
                f"run_dir={tmp_path}"])
    online, calls = r.features, []

    def corrupt(batch):  # the target returns NaN features for the first micro-batch of step 1
        f = online(batch)
        calls.append(r.step)
        if r.step == 1 and calls.count(1) == 1:
            f.hidden_states[0, 3] = float("nan")
        return f

    r.features = corrupt
    rows = []
    for _ in range(4):
        rows.append(r.train_step())
        r.step += 1
    assert [m["bad_steps"] for m in rows] == [0, 1, 1, 1]
    assert all(math.isfinite(m["loss"]) for m in rows)
    assert r.engine.global_steps == r.step == 4  # one optimizer step per recipe step, skipped micro-batch or not
    assert all(torch.isfinite(p).all() for p in r.engine.module.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("head", ["msd", "msd3", "msd-offline-pruned"])
def test_resume_after_kill_is_exact(mini_run, tmp_path, head):
    extra = [f"head={head}"]
    if head == "msd-offline-pruned":  # training from a feature store, over a draft vocabulary, length-bucketed

        from msd_train.features.generate import generate

        generate(gen_cfg(mini_run, tmp_path / "store", "splits=[text,heldout_text]"))
        extra = ["head=msd", "features=offline", f"features.path={tmp_path / 'store'}", "draft.train_vocab=32",
                 "train.bucket_window=8"]
    common = [*mini_run, "train.max_steps=8", "checkpoint.every=2", "eval.every=100",
              "train.micro_batch_size=2", "train.grad_accum=2", *extra]
    train(["stage=1", *common, f"run_dir={tmp_path / 'straight'}"])
    run = tmp_path / "resumed"
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), "stage=1", *common, f"run_dir={run}"],
                            cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = run / "stage1" / "checkpoints" / "step-000002" / "recipe_state.json"
    deadline = time.time() + 300
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run / "stage1" / "final").exists(), "the run finished before it could be interrupted"
    out = train(["stage=1", *common, f"run_dir={run}"])
    assert "resuming from" in out.stderr + out.stdout
    a, b = weights(tmp_path / "straight"), weights(run)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    assert losses(tmp_path / "straight") == losses(run)
    # a finished stage is not retrained by the same command
    again = train(["stage=1", *common, f"run_dir={run}"])
    assert "already finished" in again.stderr + again.stdout


def _kill_at_first_checkpoint(args, stage_dir):
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = stage_dir / "checkpoints" / "step-000002" / "recipe_state.json"
    deadline = time.time() + 300
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (stage_dir / "final").exists(), "the run finished before it could be interrupted"


@pytest.mark.slow
def test_a_resumed_stage_keeps_the_vocabulary_of_the_head_it_started_from(mini_run, tmp_path):
    """Stage 2 from a stage-1 head over draft.train_vocab: the token counts (the train vocabulary,
    and the export's token_counts.safetensors) are the stage's data plus the head's it started from.
    A resume reads stage.init_from no more (it may have changed, as when the head is replaced
    by one of this very run's exports), so the checkpoint keeps the counts: the resumed stage
    trains over the same vocabulary and ends where the uninterrupted one does."""
    from msd_train.draft.vocabulary import load_counts

    common = [*mini_run, "train.max_steps=2", "eval.every=100", "checkpoint.every=100", "train.micro_batch_size=2",
              "draft.train_vocab=24"]
    train(["stage=1", *common, f"run_dir={tmp_path / 's1'}"])
    head = tmp_path / "s1" / "stage1" / "final"
    stage1_counts = load_counts(head)
    stage2 = ["stage=2", *common, "train.max_steps=6", "checkpoint.every=2", f"stage.init_from={head}"]
    train([*stage2, f"run_dir={tmp_path / 'straight'}"])
    run = tmp_path / "resumed"
    _kill_at_first_checkpoint([*stage2, f"run_dir={run}"], run / "stage2")
    (head / "token_counts.safetensors").unlink()  # the head it started from changed since
    out = train([*stage2, f"run_dir={run}"])
    assert "resuming from" in out.stderr + out.stdout
    straight = load_counts(tmp_path / "straight" / "stage2" / "final")
    assert torch.equal(load_counts(run / "stage2" / "final"), straight)
    assert (straight >= stage1_counts).all() and straight.sum() > stage1_counts.sum()  # its data's added
    a, b = weights(tmp_path / "straight", stage=2), weights(run, stage=2)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    assert losses(tmp_path / "straight", stage=2) == losses(run, stage=2)


@pytest.mark.slow
def test_two_ranks_equal_one_rank_with_double_accumulation(mini_run, tmp_path):
    common = [*mini_run, "train.max_steps=3", "eval.every=100", "checkpoint.every=100",
              "train.micro_batch_size=2", "train.noise=none"]
    train(["stage=1", *common, "train.grad_accum=2", f"run_dir={tmp_path / 'one'}"])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    train(["stage=1", *common, "train.grad_accum=1", f"run_dir={tmp_path / 'two'}"], launcher=torchrun)
    a, b = weights(tmp_path / "one"), weights(tmp_path / "two")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    assert losses(tmp_path / "one") == pytest.approx(losses(tmp_path / "two"), rel=1e-5)


@pytest.mark.slow
def test_resume_on_another_number_of_processes_continues_the_run(mini_run, tmp_path):
    """A run checkpointed by 2 processes continues on 1 (and ZeRO-1 instead of 2), then on
    4, with its global batch of 4 (grad_accum 2 -> 4 -> 1): the same steps, learning rates and samples as a run that was never
    interrupted, and the same losses and head up to float-summation order (measured: losses equal to
    the last digit, head within 4e-9)."""
    import shutil

    from msd_train.data.curriculum import Curriculum

    def torchrun(n):
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n),
                "--master_port", str(free_port())]

    def preempted_after(run, step):  # what a job killed after checkpoint `step` leaves
        for p in (run / "stage1" / "checkpoints").glob("step-*"):
            if int(p.name[5:]) > step:
                shutil.rmtree(p)
        for name in ("final", "best"):
            shutil.rmtree(run / "stage1" / name, ignore_errors=True)

    def rows(run):
        lines = (run / "stage1" / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x) for x in lines if '"loss"' in x and "val/" not in x]

    common = [*mini_run, "stage=1", "train.max_steps=6", "train.warmup_steps=2", "checkpoint.every=2",
              "checkpoint.keep=3", "eval.every=100", "train.micro_batch_size=1", "train.grad_accum=2"]
    straight, run = tmp_path / "straight", tmp_path / "moved"
    train([*common, f"run_dir={straight}"], launcher=torchrun(2))
    shutil.copytree(straight, run)
    preempted_after(run, 2)
    out = train([*common, f"run_dir={run}", "deepspeed=zero1"])  # one process, another ZeRO stage
    text = out.stdout + out.stderr
    assert "step-000002 (written by 2 process(es), ZeRO stage 2)" in text and "train.grad_accum=4 (was 2)" in text
    preempted_after(run, 4)
    out = train([*common, f"run_dir={run}"], launcher=torchrun(4))
    text = out.stdout + out.stderr
    assert "step-000004 (written by 1 process(es), ZeRO stage 1)" in text and "train.grad_accum=1 (was 2)" in text

    a, b = rows(straight), rows(run)
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert [r["lr"] for r in b] == pytest.approx([r["lr"] for r in a], rel=1e-12)  # the schedule continues
    assert [r["tokens"] for r in b] == [r["tokens"] for r in a]  # the same samples at every step
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a], rel=1e-6)
    wa, wb = weights(straight), weights(run)
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=1e-6)
    # the data order: 6 steps x 4 samples of one epoch of 32, each once
    state = json.loads((run / "stage1" / "checkpoints" / "step-000006" / "recipe_state.json").read_text())
    assert state["curriculum"] == {"text": 24, "mm": 0} and state["world_size"] == 4 and state["global_batch"] == 4
    plan = Curriculum(32, 32, 4, 0)
    seen = [i for step in range(6) for _, i in plan.plan(step)]
    assert len(seen) == len(set(seen)) == 24
    history = json.loads((run / "stage1" / "settings.json").read_text())["history"]
    assert [(h["step"], h["changed"]["world_size"]) for h in history] == [
        (2, {"checkpoint": 2, "now": 1}), (4, {"checkpoint": 1, "now": 4})]


@pytest.mark.slow
def test_stage2_refuses_without_stage1(mini_run, tmp_path):
    out = train(["stage=2", *mini_run, f"run_dir={tmp_path}"], check=False)
    assert out.returncode != 0
    assert "holds no exported head; run stage=1 with the same run_dir first" in out.stderr + out.stdout


def test_dist_timeout_minutes_reaches_deepspeeds_process_group(in_process, mini_run, tmp_path, monkeypatch):
    import datetime

    import deepspeed

    seen, init = [], deepspeed.init_distributed
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kw: (seen.append(kw["timeout"]), init(**kw))[1])
    recipe(["stage='1'", *mini_run, "dist.timeout_minutes=45", "data.max_heldout=2", f"run_dir={tmp_path}"])
    assert seen == [datetime.timedelta(minutes=45)]


def test_gradient_checkpointing_trains_the_same_steps_and_recomputes_the_layers(in_process, mini_run, tmp_path):
    """train.gradient_checkpointing=true on every declared transformers (CI runs this on the floor too):
    the same losses as without it, and each layer's forward runs again in the backward pass."""
    rows, calls = {}, {}
    for on in (False, True):
        r = recipe(["stage='1'", *mini_run, "train.max_steps=3", "train.micro_batch_size=2", "data.max_heldout=2",
                    f"train.gradient_checkpointing={str(on).lower()}", f"run_dir={tmp_path / str(on)}"])
        layers = r.engine.module.layers
        calls[on] = [0] * len(layers)
        for i, layer in enumerate(layers):
            # The MLP's own forward, counted: module hooks are not run again when a checkpoint recomputes.
            def counted(*args, _forward=layer.mlp.forward, _count=calls[on], _i=i):
                _count[_i] += 1
                return _forward(*args)
            layer.mlp.forward = counted
        rows[on] = run_steps(r)
    assert rows[True] == rows[False]
    assert calls[True] == [2 * n for n in calls[False]] and min(calls[False]) == 3  # one micro-batch per step


@pytest.mark.slow
def test_deepspeed_launcher_two_stages_on_the_embedded_default(tmp_path):
    """The README journey, shortened: `deepspeed train.py stage=1`, then `stage=2`."""
    from msd_train.data.curriculum import mm_share
    from msd_train.draft import MSDDraftModel

    ds = ["deepspeed", "--num_gpus", "1", "--master_port", str(free_port())]
    common = [f"run_dir={tmp_path}", "logging.wandb.mode=disabled", "logging.progress=false",
              f"data.cache_dir={tmp_path / 'cache'}", "data.max_heldout=16", "eval.every=1000"]
    train(["stage=1", *common, "train.max_steps=30"], launcher=ds)
    ramp = ["stage.curriculum.start=0.25", "stage.curriculum.end=0.75", "stage.curriculum.ramp_steps=10"]
    train(["stage=2", *common, "train.max_steps=12", *ramp], launcher=ds)
    for stage in (1, 2):
        head = MSDDraftModel.from_pretrained(tmp_path / f"stage{stage}" / "final")
        assert head.config.decouple_visual
    rows = [json.loads(x) for x in (tmp_path / "stage2" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "mm_share" in r]
    assert len(steps) == 12
    global_batch = 4
    for r in steps:
        sched = mm_share(r["step"] - 1, 0.25, 0.75, 10)
        assert r["mm_share_scheduled"] == pytest.approx(sched)
        assert abs(r["mm_share"] - sched) <= 1 / global_batch + 1e-9
    # held-out agreement rises over stage 1 (validation runs at step 0 and at the end)
    val1 = [json.loads(x) for x in (tmp_path / "stage1" / "metrics.jsonl").read_text().splitlines()
            if "val/text/top1" in x]
    assert val1[-1]["val/text/top1"] > val1[0]["val/text/top1"] + 0.05
    # stage 2 validates on both held-out sets
    val2 = [json.loads(x) for x in (tmp_path / "stage2" / "metrics.jsonl").read_text().splitlines() if "val/" in x]
    assert "val/mm/sim_tau" in val2[-1] and "val/text/sim_tau" in val2[-1]


@pytest.mark.slow
def test_a_large_shaped_target_folder_trains_with_the_unchanged_entry_point(in_process, tmp_path):
    """lab/targets/make_large_target.py at CPU size: a normal model folder for target.name_or_path."""
    from lab.targets import make_large_target as mod

    out = mod.main([str(tmp_path / "target"), "--layers", "1", "--scale", "small"])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["text_config"]["vocab_size"] == 32064 and cfg["image_seq_length"] == 576
    assert cfg["vision_config"]["image_size"] == 336 and cfg["dtype"] == "bfloat16"
    r = recipe(["stage='1'", f"target.name_or_path={out}", "train.max_steps=2", "train.micro_batch_size=2",
                "data.max_heldout=2", "eval.every=100", f"data.cache_dir={tmp_path / 'cache'}",
                f"run_dir={tmp_path / 'run'}"])
    assert r.target.vocab_size == len(r.target.tokenizer) == 32064  # every id the target can emit decodes
    rows = run_steps(r)
    assert len(rows) == 2 and all(math.isfinite(x[0]) for x in rows)


@pytest.mark.slow
def test_a_bf16_run_exports_its_float32_master_weights_and_stage2_starts_from_them(in_process, mini_run, tmp_path):
    """bf16 training keeps fp32 master weights in the optimizer and bf16 copies in the module: the
    export stores the masters (labelled float32, as stored), so stage 2 starts from the trained values."""
    from deepspeed.utils import safe_get_full_fp32_param

    from msd_train.draft import MSDDraftModel

    r = recipe(["stage='1'", *mini_run, "train.max_steps=2", "train.micro_batch_size=2", "train.precision=bf16",
                "data.max_heldout=2", f"run_dir={tmp_path}"])
    run_steps(r)
    r.export("final")
    masters = {n: safe_get_full_fp32_param(p).float() for n, p in r.engine.module.named_parameters()}
    assert next(r.engine.module.parameters()).dtype == torch.bfloat16
    stored = weights(tmp_path)
    config = json.loads((tmp_path / "stage1" / "final" / "config.json").read_text())
    assert {t.dtype for t in stored.values()} == {torch.float32} and config["dtype"] == "float32"
    for n, w in stored.items():
        assert torch.equal(w, masters[n]), n
    assert any((w != w.bfloat16().float()).any() for w in stored.values())  # not the bf16 rounding
    head = MSDDraftModel.from_pretrained(tmp_path / "stage1" / "final")
    assert all(torch.equal(p, masters[n]) for n, p in head.named_parameters())


def test_a_head_trained_over_a_draft_vocabulary_decodes_exactly_over_it(in_process, mini_run, tmp_path):
    """draft.train_vocab=N: the token term over the stage's N most frequent tokens; the
    export records N, decoding drafts over those N by default, and outputs equal plain
    decoding. N out of range is refused before training starts."""
    from msd_train.decoding import DecodeConfig
    from msd_train.decoding.speculative import generate
    from msd_train.draft.vocabulary import most_frequent
    from msd_train.hub.load import load_head
    from msd_train.training.recipe import TrainingError

    common = ["stage='1'", *mini_run, "train.micro_batch_size=2", f"run_dir={tmp_path}"]
    r = recipe([*common, "train.max_steps=2", "draft.train_vocab=24"])
    assert r.objective.train_vocab.size == 24
    assert torch.equal(r.objective.train_vocab.ids.cpu(), most_frequent(r.token_counts, 24))
    run_steps(r)
    r.export("final")
    head = load_head(str(tmp_path / "stage1" / "final"), r.target)
    assert head.config.train_vocab == 24
    prompt = r.target.encode_prompt([{"role": "user", "content": "hello there"}], [])
    plain = generate(r.target, None, prompt, DecodeConfig(method="ar", max_new_tokens=12, eos_token_ids=()))
    chain = generate(r.target, head, prompt, DecodeConfig(method="chain", k=3, max_new_tokens=12, eos_token_ids=()))
    assert chain.tokens == plain.tokens
    states = torch.randn(3, head.config.hidden_size)
    assert int(torch.isfinite(head.logits(states, r.target)).sum(-1)[0]) == 24  # its vocabulary by default
    for bad in ("0", str(r.target.vocab_size + 1)):
        with pytest.raises(TrainingError, match="draft.train_vocab"):
            recipe([*common, "train.max_steps=1", f"draft.train_vocab={bad}", f"run_dir={tmp_path / bad}"])
