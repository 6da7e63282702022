"""Nothing lost, ever: each case of the hostile-user pass, as a user sees it.

Library-level checks run in-process in well under a second each; launches go through the
real entry point (`python train.py`, and `deepspeed` / `torchrun` for the signal cases,
marked slow) with tiny step counts.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from builders.runs import (
    ENV,
    FAST,
    assert_stopped_with_checkpoint,
    base_train_cfg,
    fake_checkpoint,
    kill_session,
    steps,
    trainer_processes,
    wait_for_steps,
)

from msd_train.training import checkpoint as ckpt
from msd_train.training import rundir
from msd_train.validate import ConfigError, check_eval, check_head, check_out_dir, check_train

ROOT = Path(__file__).resolve().parents[2]
ENV.pop("MSD_DEBUG", None)


def train(args, launcher=(sys.executable,), env=None, **kw):
    cmd = [*launcher, str(ROOT / "train.py"), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env or ENV, capture_output=True, text=True, timeout=900, **kw)


def ok(out):
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out.stdout + out.stderr


def refused(out, *phrases):
    text = out.stdout + out.stderr
    assert out.returncode != 0, text[-3000:]
    assert "Traceback" not in text, text[-5000:]
    for p in phrases:
        assert p in text, text[-3000:]
    return text


# ----------------------------------------------------------------------------- 6: checkpoint fallback


def test_damaged_checkpoints_are_skipped_with_the_reason(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    good = fake_checkpoint(root, 2)
    cut = fake_checkpoint(root, 4)
    f = cut / "engine" / "mp_rank_00_model_states.pt"
    f.write_bytes(f.read_bytes()[:200])
    (fake_checkpoint(root, 6) / ckpt.STATE_FILE).write_text('{"step": 6, "curr')
    for p in (fake_checkpoint(root, 8) / "engine").iterdir():
        p.unlink()
    (root / "step-backup").mkdir()  # a user's copy: not a checkpoint
    (root / "step-backup" / ckpt.STATE_FILE).write_text("{}")
    assert [p.name for p in ckpt.complete_checkpoints(root)] == [f"step-00000{i}" for i in (2, 4, 6, 8)]
    with caplog.at_level("WARNING"):
        assert ckpt.loadable_checkpoints(root) == [good]
    text = caplog.text
    assert "step-000008: no DeepSpeed engine files" in text
    assert "step-000006: recipe_state.json is unreadable" in text
    assert "step-000004: mp_rank_00_model_states.pt is damaged" in text
    ckpt.rotate(root, keep=1)
    assert (root / "step-backup").is_dir(), "rotation must never remove a folder that is not a checkpoint"


# ----------------------------------------------------------------------------- 12: disk full


def test_disk_full_while_checkpointing_says_so_and_what_was_kept(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    fake_checkpoint(root, 100)
    tmp = root / ".tmp-step-000200"
    with pytest.raises(ckpt.CheckpointWriteError) as e:
        with ckpt.writing(root, tmp, "checkpoint step 200"):
            tmp.mkdir()
            raise OSError(errno.ENOSPC, "No space left on device")
    msg = str(e.value)
    assert "the disk is full" in msg and str(root) in msg and "kept: step-000100" in msg
    assert not tmp.exists(), "the partial write must be removed"
    # torch.save only says "basic_ios::clear: iostream error": recognised when the disk has no room
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: type("U", (), {"free": 1024})())
    with pytest.raises(ckpt.CheckpointWriteError, match="the disk is full"):
        with ckpt.writing(root, tmp, "checkpoint step 200"):
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos; basic_ios::clear: "
                               "iostream error")
    monkeypatch.undo()  # room on the disk again
    with pytest.raises(RuntimeError, match="something else"):  # other failures pass through unchanged
        with ckpt.writing(root, tmp, "checkpoint step 200"):
            raise RuntimeError("something else")


# ----------------------------------------------------------------------------- 15: export modes


def test_exports_are_readable_like_config_json(tmp_path):
    from transformers import AutoConfig

    from msd_train.draft import MSDDraftConfig, MSDDraftModel
    from msd_train.runtime import atomic_dir

    old = os.umask(0o022)
    try:
        cfg = MSDDraftConfig.from_target_config(AutoConfig.from_pretrained(ROOT / "data" / "tiny-llava"), "tiny")
        head = MSDDraftModel(cfg)
        ckpt.export_atomic(head, tmp_path / "final", {"training.json": "{}"})
        atomic_dir(tmp_path / "exported", head.save_pretrained)  # how hub exports write (reference.py)
    finally:
        os.umask(old)
    for folder in ("final", "exported"):
        modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / folder).iterdir()}
        assert modes["model.safetensors"] == modes["config.json"] == "0o644", modes


# ----------------------------------------------------------------------------- 3: run_dir ownership


def test_run_dir_lock_names_the_owner_and_clears_stale_locks(tmp_path):
    with rundir.RunDirLock(tmp_path):
        with pytest.raises(rundir.RunDirBusy, match=f"pid {os.getpid()} on"):
            rundir.RunDirLock(tmp_path).acquire()
    assert not (tmp_path / rundir.LOCK_FILE).exists()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / rundir.LOCK_FILE).write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename,
                                                          "start_time": 1.0}))
    lock = rundir.RunDirLock(tmp_path)
    lock.acquire()  # the owner is gone: taken over
    assert json.loads((tmp_path / rundir.LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    (tmp_path / rundir.LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "x"}))
    with pytest.raises(rundir.RunDirBusy, match="pid 1 on elsewhere"):
        rundir.RunDirLock(tmp_path).acquire()  # another host: cannot tell, so refuse and say how to clear


# ----------------------------------------------------------------------------- 10, 5, 11: resume rules


def test_metrics_truncation_keeps_only_the_continuing_run(tmp_path):
    m = tmp_path / "metrics.jsonl"
    m.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (0, 1, 2, 3)) + '{"step": 4, "lo')
    rundir.truncate_metrics(m, 2)
    assert [json.loads(x)["step"] for x in m.read_text().splitlines()] == [0, 1, 2]
    rundir.truncate_metrics(m, 0)  # no checkpoint: the log restarts
    assert m.read_text() == ""


def test_target_identity_and_world_size_differences_are_named(llava_target):
    from builders import tiny_llava_target

    from msd_train.features.generate import target_identity

    a = target_identity(llava_target)
    diffs = rundir.identity_differences(a, target_identity(tiny_llava_target(seed=5)))
    assert len(diffs) == 1 and diffs[0].startswith("weights: the embedding table and lm_head")
    b = {**a, "name": "other/target", "chat_template_sha1": "0" * 40}
    diffs = rundir.identity_differences(a, b)
    assert any(d.startswith("name:") and "other/target" in d for d in diffs)
    assert any(d.startswith("chat_template_sha1") for d in diffs)
    assert rundir.identity_differences(a, dict(a)) == []


def test_another_world_size_continues_where_it_can_and_names_what_cannot_carry_over(tmp_path):
    """A checkpoint of 2 processes continues on 1 or 4 with its global batch; what
    cannot carry over (no portable state, ZeRO-3, a global batch that does not split) is named."""
    ck = fake_checkpoint(tmp_path, 2)
    state = {"world_size": 2, "global_batch": 8}
    msg = rundir.world_size_refusal(ck, state, 1, 2, 2)
    assert "written by 2 process(es) and this launch has 1" in msg and "--nproc_per_node 2" in msg
    assert ckpt.PORTABLE_FILE in msg and "resume=false" in msg
    assert rundir.world_size_refusal(ck, {"world_size": 1}, 1, 2, 2) is None
    (ck / ckpt.PORTABLE_FILE).write_bytes(b"")
    for world, accum in ((1, 4), (2, 2), (4, 1)):
        assert rundir.world_size_refusal(ck, state, world, 2, 2) is None
        assert rundir.resumed_grad_accum(state, world, 2) == accum
    assert "deepspeed=zero3" in rundir.world_size_refusal(ck, state, 1, 2, 3)
    msg = rundir.world_size_refusal(ck, state, 3, 2, 1)
    assert "global batch of 8" in msg and "3 process(es) x train.micro_batch_size=2 = 6" in msg
    assert "a number of processes in [1, 2, 4]" in msg and "resume=false" in msg
    # another ZeRO stage at the same number of processes: the portable state too; not into ZeRO-3
    state = {"world_size": 2, "zero_stage": 2, "global_batch": 8}
    assert not rundir.needs_portable(state, 2, 2) and rundir.needs_portable(state, 2, 1)
    assert rundir.world_size_refusal(ck, state, 2, 2, 1) is None
    assert "deepspeed=zero3" in rundir.world_size_refusal(ck, state, 2, 2, 3)
    (ck / ckpt.PORTABLE_FILE).unlink()
    msg = rundir.world_size_refusal(ck, state, 2, 2, 1)
    assert "ZeRO stage 2 and this launch has 2 with stage 1" in msg and "deepspeed=zero2" in msg


def test_an_engine_after_the_group_was_left_trains_in_the_same_process(in_process):
    """Leaving the process group (a run's cleanup, generate_features' end) also forgets the clone of
    it DeepSpeed keeps: the next engine in the process would broadcast over that dead clone."""
    import deepspeed

    from msd_train import runtime

    for _ in range(2):
        group = runtime.setup_group(torch.device("cpu"), deepspeed=True, timeout_minutes=1)
        try:
            m = torch.nn.Linear(3, 2)
            deepspeed.initialize(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), config={
                "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9})
        finally:
            group.destroy()


@pytest.mark.parametrize("stage,bf16", [(0, False), (1, False), (2, False), (0, True), (2, True)])
def test_portable_state_continues_the_optimizer_exactly(in_process, tmp_path, stage, bf16):
    """portable.pt into a fresh engine (how another world size resumes), without ZeRO and with
    ZeRO-1/2: the next step equals the step the original engine takes (moments, Adam's step count,
    the schedule's position, frozen weights and buffers all carried over)."""
    import deepspeed

    from msd_train import runtime
    from msd_train.training.recipe import lr_lambda

    group = runtime.setup_group(torch.device("cpu"), deepspeed=True, timeout_minutes=1)

    def engine():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
        m.register_buffer("scale", torch.ones(3))
        m[1].bias.requires_grad_(False)
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, betas=(0.9, 0.95))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(2, 10, 0.1))
        return deepspeed.initialize(model=m, optimizer=opt, lr_scheduler=sched, config={
            "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16},
            "steps_per_print": 10**9})[0]

    def step(e, i):
        x = torch.randn(1, 5, generator=torch.Generator().manual_seed(i)).to(next(e.module.parameters()).dtype)
        e.backward(e(x).pow(2).sum() * e.module.scale.sum())
        e.step()

    try:
        a = engine()
        for i in range(3):
            step(a, i)
        with torch.no_grad():
            a.module[1].bias.add_(1.0)  # a frozen weight and a buffer unlike a fresh head's
            a.module.scale.mul_(2.0)
        ckpt.save_portable(ckpt.portable_state(a), tmp_path)
        b = engine()
        ckpt.load_portable(b, tmp_path)
        assert b.global_steps == a.global_steps == 3 and b.get_lr() == a.get_lr()
        step(a, 3)
        step(b, 3)
        for (n, pa), pb in zip(a.module.named_parameters(), b.module.parameters()):
            torch.testing.assert_close(pb, pa, rtol=0, atol=0, msg=n)
        assert b.get_lr() == a.get_lr()
    finally:
        group.destroy()  # and DeepSpeed's clone of the world group


# ----------------------------------------------------------------------------- 9, 13: config checks


@pytest.mark.parametrize("key,value,phrase", [
    ("train.lr", "abc", "train.lr='abc' is not a number"),
    ("train.max_steps", "abc", "train.max_steps='abc' is not an integer"),
    ("eval.every", 0, "eval.every=0 must be at least 1"),
    ("checkpoint.every", 0, "checkpoint.every=0 must be at least 1"),
    ("train.micro_batch_size", 0, "train.micro_batch_size=0 must be at least 1"),
    ("stage.curriculum.end", 1.5, "stage.curriculum.end=1.5 must be at most 1"),
    ("stage.curriculum.start", -0.1, "stage.curriculum.start=-0.1 must be at least 0"),
    ("data.on_bad_sample", "skipp", "data.on_bad_sample='skipp' is not one of skip, error"),
    ("data.text", "DIR", "is a folder; give the JSON / JSONL file"),
    ("data.text", "MISSING", "no such file"),
    ("logging.wandb.mode", "online", "no wandb API key"),
])
def test_train_config_mistakes_are_named(tmp_path, monkeypatch, key, value, phrase):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    cfg = base_train_cfg(tmp_path)
    if value == "DIR":
        value = [{"path": str(tmp_path)}]
    elif value == "MISSING":
        value = [{"path": str(tmp_path / "nope.json")}]
    *parents, last = key.split(".")
    node = cfg
    for p in parents:
        node = node[p]
    node[last] = value
    with pytest.raises(ConfigError, match=phrase.replace("(", r"\(").replace(")", r"\)")):
        check_train(cfg)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's 107-byte socket paths")
def test_a_temporary_folder_too_long_for_the_loader_workers_sockets_is_named_before_training(tmp_path, monkeypatch):
    """Past 75 bytes, TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX is longer than Linux lets a socket be
    named: the loader workers would fail to hand over their batches and the launch hang."""
    cfg = base_train_cfg(tmp_path)
    cfg["train"]["loader_workers"] = 2
    monkeypatch.setattr(tempfile, "tempdir", "/" + "t" * 75)  # 76 bytes
    with pytest.raises(ConfigError, match=r"is 76 bytes long: train.loader_workers=2 .* at most 75 bytes .*"
                                          r"or set train.loader_workers=0"):
        check_train(cfg)
    monkeypatch.setattr(tempfile, "tempdir", "/" + "t" * 74)  # 75 bytes: the longest that works
    check_train(cfg)
    monkeypatch.setattr(tempfile, "tempdir", "/" + "t" * 75)
    cfg["train"]["loader_workers"] = 0  # batches collated in the trainer: no sockets
    check_train(cfg)


def test_train_py_prints_one_paragraph_without_traceback(tmp_path):
    out = train([f"run_dir={tmp_path}", "train.lr=abc", "logging.wandb.mode=disabled"])
    text = refused(out, "error: train.lr='abc' is not a number", "MSD_DEBUG=1")
    assert len([x for x in text.splitlines() if x.strip()]) <= 3
    out = train([f"run_dir={tmp_path}", "eval.every=0"], env={**ENV, "MSD_DEBUG": "1"})
    assert out.returncode != 0 and "Traceback" in out.stderr and "ConfigError" in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("script,args,phrase", [
    ("eval.py", ["decoding.max_new_tokens=0"], "decoding.max_new_tokens=0 must be at least 1"),
    ("eval.py", ["draft=data/tiny"], "draft=data/tiny is not a draft head"),
    # refused before the target loads (this one does not exist)
    ("eval.py", ["target.attn_implementation=flash_attention_2", "target.name_or_path=/no/such/target"],
     "target.attn_implementation=flash_attention_2 ignores the tree attention mask"),
    ("scripts/generate_features.py", ["features.path=X", "batch_size=0"], "batch_size=0 must be at least 1"),
    ("scripts/push_to_hub.py", ["checkpoint=data/tiny-llava", "repo_id=me/bad name", "dry_run=true"],
     "is not a Hub repository id"),
])
def test_other_entry_points_refuse_mistakes_without_traceback(tmp_path, script, args, phrase):
    out = subprocess.run([sys.executable, str(ROOT / script), *args], cwd=ROOT, env=ENV, capture_output=True,
                         text=True, timeout=300)
    assert refused(out, phrase) and out.returncode == 1


def test_eval_config_mistakes_fail_before_anything_loads(tmp_path):
    cfg = {"decoding": {"method": "tree", "max_new_tokens": 0}, "bench": {}, "draft": str(tmp_path)}
    with pytest.raises(ConfigError, match="decoding.max_new_tokens=0 must be at least 1"):
        check_eval(cfg, "tree")
    cfg = {"decoding": {"method": "tree"}, "bench": {"max_samples": 0}, "draft": str(tmp_path)}
    with pytest.raises(ConfigError, match=r"bench.max_samples=0 must be at least 1 \(leave it null for all\)"):
        check_eval(cfg, "tree")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match="is not a draft head: .*no config.json"):
        check_head(str(tmp_path))
    with pytest.raises(ConfigError, match="is a file; give a folder"):
        check_out_dir(tmp_path / "notes.txt")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if not os.access(ro, os.W_OK):  # root can write anywhere; the check is then moot
            with pytest.raises(ConfigError, match="cannot be written"):
                check_out_dir(ro / "eval")
    finally:
        ro.chmod(0o700)


def test_push_refuses_bad_repo_id_in_dry_runs_and_says_when_there_is_no_token(monkeypatch, tmp_path):
    from msd_train.hub.push import check_push

    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)  # no HF_TOKEN, no `huggingface-cli login`
    for bad in ("noslash", "me/bad name", "me/../x", "a/b/c"):
        with pytest.raises(ValueError, match="is not a Hub repository id"):
            check_push(bad, dry_run=True)
    check_push("me/msd-llava15-7b", dry_run=True)
    with pytest.raises(ValueError, match="no Hugging Face token"):
        check_push("me/msd-llava15-7b", dry_run=False)


# ----------------------------------------------------------------------------- 4: image-aware cache


def test_tokenisation_cache_follows_the_images(llava_target, tmp_path):
    from builders import random_image

    from msd_train.data.dataset import build_split

    (tmp_path / "img").mkdir()
    recs = []
    for i in range(3):
        random_image(i, 16).save(tmp_path / "img" / f"{i}.png")
        recs.append({"id": f"s{i}", "image": f"{i}.png", "conversations": [
            {"from": "human", "value": "<image>\nwhat is it?"}, {"from": "gpt", "value": "a red circle"}]})
    data = tmp_path / "mm.json"
    data.write_text(json.dumps(recs))
    src = [{"path": str(data), "format": "auto", "image_root": str(tmp_path / "img")}]

    def build():
        return build_split(src, llava_target, 256, "skip", str(tmp_path / "cache"))

    moved = tmp_path / "img" / "1.png.away"
    (tmp_path / "img" / "1.png").rename(moved)
    split = build()
    assert len(split) == 2 and [b.id for b in split.skipped] == ["s1"] and "not found" in split.skipped[0].reason
    moved.rename(tmp_path / "img" / "1.png")  # restored: used again, not "not found" from the cache
    split = build()
    assert len(split) == 3 and not split.skipped
    (tmp_path / "img" / "2.png").unlink()  # deleted after caching: a skipped sample, not a crash later
    split = build()
    assert sorted(split.dataset["id"]) == ["s0", "s1"] and [b.id for b in split.skipped] == ["s2"]


# ----------------------------------------------------------------------------- 12: feature store manifest


def test_cut_manifest_is_named_with_the_fix(tmp_path):
    from msd_train.features.store import MANIFEST, FeatureStore, FeatureStoreError

    (tmp_path / MANIFEST).write_text('{"format": "msd-features", "vers')
    with pytest.raises(FeatureStoreError, match=f"{tmp_path / MANIFEST} is damaged.*generate_features.py"):
        FeatureStore(tmp_path)


# ----------------------------------------------------------------------------- 7, 8: evaluation


@pytest.fixture(scope="module")
def eval_setup(mini_run, tmp_path_factory):
    from transformers import AutoConfig

    from msd_train.draft import MSDDraftConfig, MSDDraftModel

    target = next(o.split("=", 1)[1] for o in mini_run if o.startswith("target.name_or_path="))
    stage = tmp_path_factory.mktemp("run") / "stage2"
    torch.manual_seed(0)
    head = MSDDraftModel(MSDDraftConfig.from_target_config(AutoConfig.from_pretrained(target), target))
    for name in ("final", "best"):
        head.save_pretrained(stage / name)
    return target, stage


def eval_cfg(target, draft, **extra):
    bench = {"name": "tiny", "kind": "conversations", "max_per_category": 1, "max_turns": 1, "sources": [
        {"path": str(ROOT / "data/tiny/sharegpt_heldout.json")},
        {"path": str(ROOT / "data/tiny/llava_heldout.json"), "image_root": str(ROOT / "data/tiny/images")}]}
    return {"target": {"name_or_path": target, "device": "cpu"}, "draft": draft, "bench": bench,
            "decoding": {"method": "chain", "k": 2, "max_new_tokens": 4}, "warmup": 0, "progress": False, **extra}


@pytest.mark.slow
def test_eval_reports_of_final_and_best_do_not_collide(eval_setup):
    from msd_train.evaluation import run_eval
    from msd_train.hub.card import find_report

    target, stage = eval_setup
    run_eval(eval_cfg(target, str(stage / "final")))
    run_eval(eval_cfg(target, str(stage / "best")))
    assert (stage / "eval-final-tiny-chain" / "report.json").is_file()
    assert (stage / "eval-best-tiny-chain" / "report.json").is_file()
    assert find_report(stage / "final") == (stage / "eval-final-tiny-chain" / "report.json").resolve()
    assert find_report(stage / "best") == (stage / "eval-best-tiny-chain" / "report.json").resolve()


@pytest.mark.slow
def test_eval_checks_images_and_out_before_loading_and_keeps_work_on_interrupt(eval_setup, tmp_path,
                                                                               monkeypatch):
    import msd_train.evaluation.run as run_mod

    target, stage = eval_setup
    loaded = []
    monkeypatch.setattr("msd_train.targets.load_target", lambda *a, **k: loaded.append(a) or 1 / 0)
    imgs = tmp_path / "img"
    imgs.mkdir()
    (imgs / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    bench = tmp_path / "b.jsonl"
    bench.write_text(json.dumps({"id": "q7", "image": "bad.png", "turns": ["what is it?"]}) + "\n")
    cfg = eval_cfg(target, str(stage / "final"), out=str(tmp_path / "out"))
    cfg["bench"] = {"name": "b", "kind": "jsonl", "path": str(bench), "image_root": str(imgs)}
    with pytest.raises(ConfigError, match="b.jsonl, sample q7: image .*bad.png cannot be decoded"):
        run_mod.run_eval(cfg)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file"):
        run_mod.run_eval(eval_cfg(target, str(stage / "final"), out=str(tmp_path / "file")))
    assert not loaded, "the target must not load before the checks pass"
    monkeypatch.undo()

    real = run_mod.evaluate

    def interrupted(*a, on_record=None, **k):  # Ctrl-C after two turns were measured
        seen = []

        def record(rec):
            on_record(rec)
            seen.append(rec)
            if len(seen) == 2:
                raise KeyboardInterrupt

        return real(*a, on_record=record, **k)

    monkeypatch.setattr(run_mod, "evaluate", interrupted)
    out = tmp_path / "kept"
    with pytest.raises(KeyboardInterrupt):
        run_mod.run_eval(eval_cfg(target, str(stage / "final"), out=str(out)))
    report = json.loads((out / "report.json").read_text())
    assert "KeyboardInterrupt after 2 turns" in report["interrupted"]
    assert report["overall"]["n_turns"] == 2
    assert len((out / "samples.jsonl").read_text().splitlines()) == 2


# ----------------------------------------------------------------------------- launches: 1, 3, 5, 10, 11


@pytest.mark.slow
def test_resume_false_sets_the_old_run_aside(mini_run, tmp_path):
    run = tmp_path / "run"
    common = [*mini_run, *FAST, f"run_dir={run}", "checkpoint.every=2", "stage=1"]
    (run / "stage1").mkdir(parents=True)  # 10: what a launch killed before its first checkpoint logged
    (run / "stage1" / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 9.0}) + "\n"
                                                          for s in (1, 2, 3)))
    ok(train([*common, "train.max_steps=4"]))
    assert steps(run) == [1, 2, 3, 4]
    assert 9.0 not in [json.loads(x).get("loss") for x in (run / "stage1" / "metrics.jsonl").read_text().splitlines()]
    text = ok(train([*common, "train.max_steps=2", "resume=false"]))
    aside = [p for p in (run / "stage1").iterdir() if p.name.startswith("replaced-")]
    assert len(aside) == 1 and str(aside[0]) in text
    assert sorted(p.name for p in (aside[0] / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    assert [p.name for p in (run / "stage1" / "checkpoints").iterdir()] == ["step-000002"]
    assert json.loads((run / "stage1" / "final" / "training.json").read_text())["step"] == 2
    assert steps(run) == [1, 2]
    again = ok(train([*common, "train.max_steps=2"]))  # the same command: the new run, finished
    assert "already finished at step 2" in again


@pytest.mark.slow
def test_resume_refuses_another_target_and_another_world_size(mini_run, tmp_path):
    from builders import tiny_llava

    from msd_train.runtime import free_port

    other = tmp_path / "other"
    model, proc = tiny_llava(seed=2)  # same shapes, other weights
    model.save_pretrained(other)
    proc.save_pretrained(other)
    run = tmp_path / "run"
    common = [*mini_run, *FAST, f"run_dir={run}", "stage=1", "checkpoint.every=2"]
    ok(train([*common, "train.max_steps=4"]))
    out = train([*common, "train.max_steps=6", f"target.name_or_path={other}"])
    refused(out, "was trained on another target than this launch's", "resume=false")
    assert not (run / "stage1" / "checkpoints" / "step-000006").exists()
    # another number of processes whose global batch cannot be kept (2 samples, 2 x 2 per accumulation
    # step): refused before anything loads (RANK/WORLD_SIZE as a launcher sets them)
    out = train([*common, "train.max_steps=6"], env={**ENV, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                                                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    refused(out, "global batch of 2 (1 process(es))", "a number of processes in [1]", "resume=false")
    # 6: a newest checkpoint that passes the cheap checks but does not load (its optimizer file is gone)
    for f in (run / "stage1" / "checkpoints" / "step-000004" / "engine").glob("*optim_states.pt"):
        f.unlink()
    text = ok(train([*common, "train.max_steps=5"]))
    assert "skipping checkpoint" in text and "step-000004" in text
    assert "resuming from " + str(run / "stage1" / "checkpoints" / "step-000002") in text
    assert steps(run) == [1, 2, 3, 4, 5]


@pytest.mark.slow
def test_second_launch_into_a_busy_run_dir_is_refused(mini_run, tmp_path):
    run = tmp_path / "run"
    args = [str(ROOT / "train.py"), *mini_run, *FAST, f"run_dir={run}", "stage=1", "train.max_steps=100000",
            "checkpoint.every=100000"]
    first = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        wait_for_steps(run, first)
        out = train(args[1:])
        refused(out, f"is in use by another launch: pid {first.pid} on")
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=300)
    assert steps(run) == list(range(1, len(steps(run)) + 1)), "the refused launch wrote into the run"


# ----------------------------------------------------------------------------- 2, 14: signals under launchers


def _launch(launcher: str, run: Path, mini_run, port: int):
    args = [*mini_run, *FAST, f"run_dir={run}", "stage=1", "train.max_steps=100000", "checkpoint.every=100000"]
    if launcher == "deepspeed":
        cmd = ["deepspeed", "--num_gpus", "1", "--master_port", str(port), str(ROOT / "train.py"), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(port),
               str(ROOT / "train.py"), *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


@pytest.mark.slow
@pytest.mark.parametrize("launcher,how", [("deepspeed", "ctrl-c"), ("torchrun", "sigterm-group"),
                                          ("deepspeed", "sigterm-launcher-only")])
def test_stop_signals_under_launchers_save_a_checkpoint(mini_run, tmp_path, launcher, how):
    import psutil

    run = tmp_path / "run"
    from msd_train.runtime import free_port

    port = free_port()  # a fixed one fails whenever another job holds it
    proc = _launch(launcher, run, mini_run, port)
    try:
        wait_for_steps(run, proc)
        trainers = trainer_processes(proc.pid)
        assert trainers, "no trainer process found under the launcher"
        if how == "ctrl-c":  # the terminal sends SIGINT to the whole foreground group
            os.killpg(proc.pid, signal.SIGINT)
        elif how == "sigterm-group":  # SLURM, `timeout`, `kill -- -PGID`
            os.killpg(proc.pid, signal.SIGTERM)
        else:  # SIGTERM to the top-level `deepspeed` alone: its trainer must not live on as an orphan
            proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=300)
        _, alive = psutil.wait_procs(trainers, timeout=120)
        assert not alive, f"trainer still running after the launcher stopped:\n{output[-3000:]}"
    finally:
        kill_session(proc)
    assert_stopped_with_checkpoint(run, output)
