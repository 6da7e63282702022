"""Paths that stay inside their roots, a cache that notices content, records
of what happened, one clear message in place of a traceback, the promised locks.

Library-level checks run in-process; an entry point is run as a user runs it (a subprocess)
only where the message is what is promised.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from builders import random_image

from msd_train.data.formats import read_conversations

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
       "HF_HUB_OFFLINE": "1"}
ENV.pop("MSD_DEBUG", None)


def llava_file(path: Path, images: list[str]) -> Path:
    recs = [{"id": f"s{i}", "image": im,
             "conversations": [{"from": "human", "value": "<image>\nwhat is it?"}, {"from": "gpt", "value": "a cat"}]}
            for i, im in enumerate(images)]
    path.write_text(json.dumps(recs))
    return path


# ----------------------------------------------------------------------------- image paths inside image_root


def test_image_paths_outside_image_root_are_bad_samples_named(tmp_path):
    root = tmp_path / "images"
    root.mkdir()
    secret = tmp_path / "secret.png"
    random_image(0, 8).save(secret)
    random_image(1, 8).save(root / "ok.png")
    data = llava_file(tmp_path / "d.json", ["ok.png", str(secret), "../secret.png", "sub/../../secret.png",
                                           "sub/../ok.png", str(root / "ok.png"), str(root / ".." / "secret.png")])
    out = list(read_conversations(data, "auto", root))
    good = [r for r in out if isinstance(r, dict)]
    bad = [r for r in out if not isinstance(r, dict)]
    assert [r["id"] for r in good] == ["s0", "s4", "s5"]  # an absolute path under image_root is inside it
    assert [b.id for b in bad] == ["s1", "s2", "s3", "s6"]
    for b in bad:
        assert "outside image_root" in b.message() and str(root) in b.message()
    assert all(str(secret) not in r["images"][0] for r in good)


def test_regenerated_multimodal_data_trains_inside_its_image_root(tmp_path):
    """The merged file of scripts/regenerate_data.py is a data file like any other: its image
    paths are relative to the image_root its manifest names, so the readers take them."""
    from msd_train.data.regenerate import MERGED, regenerate
    from msd_train.targets import load_target

    root = tmp_path / "images"
    (root / "sub").mkdir(parents=True)
    random_image(0, 16).save(root / "sub" / "a.png")
    data = llava_file(tmp_path / "d.json", ["sub/a.png"])
    target = load_target(str(ROOT / "data" / "tiny-llava"), "float32", "cpu")
    out = tmp_path / "out"
    manifest = regenerate(target, {
        "out": str(out), "inputs": [{"path": str(data), "format": "auto", "image_root": str(root)}], "limit": None,
        "max_new_tokens": 2, "max_turns": 1, "max_prompt_tokens": 512, "temperature": 0.0, "top_p": 1.0,
        "top_k": 0, "seed": 0, "progress": False})
    read = list(read_conversations(out / MERGED, "auto", manifest["image_root"]))
    assert [r["images"] for r in read] == [[str(root / "sub" / "a.png")]]


# ----------------------------------------------------------------------------- the cache notices content


def train_cfg(tmp_path, *overrides):
    from hydra import compose, initialize_config_dir

    from msd_train.config import CONF_DIR

    with initialize_config_dir(str(CONF_DIR), version_base=None):
        return compose("config", overrides=[f"run_dir={tmp_path / 'run'}", "logging.wandb.mode=disabled",
                                            "logging.progress=false", *overrides])


def sharegpt_file(path: Path, answers: list[str]) -> Path:
    path.write_text(json.dumps([{"id": f"t{i}", "conversations": [{"from": "human", "value": "hello there"},
                                                                 {"from": "gpt", "value": a}]}
                                for i, a in enumerate(answers)]))
    return path


def edit_keeping_size_and_mtime(path: Path, old: bytes, new: bytes) -> None:
    """What ``cp -p``, ``rsync -t`` or ``tar`` leave: other content, the same size and mtime."""
    st = path.stat()
    data = path.read_bytes()
    assert len(old) == len(new) and old in data
    path.write_bytes(data.replace(old, new))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_a_same_size_edit_with_its_mtime_restored_is_tokenised_again(tmp_path, llava_target):
    from msd_train.data.dataset import MANIFEST, build_split, file_digest

    data = sharegpt_file(tmp_path / "t.json", ["a cat sat", "a dog ran"])
    src, cache = [{"path": str(data)}], tmp_path / "cache"
    first = build_split(src, llava_target, 64, "skip", str(cache))
    ids = [list(r) for r in first.dataset["input_ids"]]
    again = build_split(src, llava_target, 64, "skip", str(cache))  # a warm launch: the same folder
    assert [list(r) for r in again.dataset["input_ids"]] == ids
    edit_keeping_size_and_mtime(data, b"a dog ran", b"a fox hid")
    fresh = build_split(src, llava_target, 64, "skip", str(cache))
    assert [list(r) for r in fresh.dataset["input_ids"]][1] != ids[1]
    assert [list(r) for r in fresh.dataset["input_ids"]][0] == ids[0]
    # the content digest is recorded beside the cache
    manifests = [json.loads(p.read_text()) for p in cache.glob(f"split-*/{MANIFEST}")]
    assert {m["files"][0]["sha1"] for m in manifests} >= {file_digest(data)}


def test_a_resume_refuses_a_same_size_edit_with_its_mtime_restored(tmp_path):
    from msd_train.training import resume

    data = sharegpt_file(tmp_path / "t.json", ["a cat sat"])
    cfg = lambda: train_cfg(tmp_path, f"data.text=[{{path: {data}}}]")  # noqa: E731
    stage = tmp_path / "run" / "stage1"
    ckpt = stage / "checkpoints" / "step-000004"
    resume.check_resume(cfg(), stage, None, None, write=True)
    edit_keeping_size_and_mtime(data, b"a cat sat", b"a rat hid")
    with pytest.raises(resume.ResumeRefused) as e:
        resume.check_resume(cfg(), stage, ckpt, 4, write=True)
    assert str(data) in str(e.value) and "training data changed" in str(e.value)


# ----------------------------------------------------------------------------- images damaged or changed under a run


def png_claiming(path: Path, width: int, height: int) -> Path:
    """A PNG whose header claims width x height but which holds ~100 bytes (an IEND at its end)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 30))
                     + chunk(b"IEND", b""))
    return path


def cut_png(path: Path, seed: int = 0) -> Path:
    """A real 64x64 PNG cut inside its pixel data, its IEND chunk put back at the end: the
    header and the end marker look whole, the pixels do not decode."""
    import io

    buf = io.BytesIO()
    random_image(seed, 64).save(buf, format="PNG")
    data = buf.getvalue()
    path.write_bytes(data[:len(data) // 2] + data[-12:])
    return path


def llava_rows(tmp_path, target, image_root, names, on_bad_sample="skip"):
    from msd_train.data.dataset import build_split

    data = tmp_path / "mm.json"
    if not data.exists():
        llava_file(data, names)
    return build_split([{"path": str(data), "image_root": str(image_root)}], target, 256, on_bad_sample,
                       str(tmp_path / "cache"))


def test_a_png_whose_header_claims_more_pixels_than_it_holds_is_a_skipped_sample(tmp_path, llava_target):
    from msd_train.data.dataset import DamagedImage, image_size

    root = tmp_path / "images"
    root.mkdir()
    png_claiming(root / "big.png", 4000, 3000)
    random_image(0, 16).save(root / "ok.png")
    with pytest.raises(DamagedImage, match="4000x3000"):
        image_size(str(root / "big.png"))
    split = llava_rows(tmp_path, llava_target, root, ["ok.png", "big.png"])
    assert list(split.dataset["id"]) == ["s0"]
    assert [b.id for b in split.skipped] == ["s1"] and "big.png" in split.skipped[0].message()


def test_an_image_that_does_not_decode_is_named_and_the_relaunch_skips_it(tmp_path, llava_target):
    from msd_train.data.collate import collate
    from msd_train.data.dataset import UnusableImage, record_unusable
    from msd_train.data.formats import BadSampleError

    root = tmp_path / "images"
    root.mkdir()
    random_image(0, 16).save(root / "ok.png")
    cut_png(root / "cut.png")
    split = llava_rows(tmp_path, llava_target, root, ["ok.png", "cut.png"])
    assert list(split.dataset["id"]) == ["s0", "s1"]  # its header and end marker passed the check
    with pytest.raises(UnusableImage) as e:
        collate([split.dataset[0], split.dataset[1]], llava_target)
    assert "sample s1" in str(e.value) and str(root / "cut.png") in str(e.value) and "replace it" in str(e.value)
    # a loader worker hands it to the trainer whole (an exception would reach it as text)
    from msd_train.data.collate import StepBatches

    item = StepBatches(split.dataset, split.dataset, llava_target, 2, 1, 0, 1)[(0, [("mm", 0), ("mm", 1)], {})]
    assert item["unusable"] == (str(e.value), e.value.record)
    assert record_unusable(tmp_path / "cache", e.value.record) is not None
    again = llava_rows(tmp_path, llava_target, root, [])
    assert list(again.dataset["id"]) == ["s0"]
    assert [b.id for b in again.skipped] == ["s1"] and "cut.png" in again.skipped[0].message()
    with pytest.raises(BadSampleError, match="sample s1: image .*cut.png"):
        llava_rows(tmp_path, llava_target, root, [], on_bad_sample="error")
    random_image(1, 16).save(root / "cut.png")  # replaced by a whole image: trained on again
    assert list(llava_rows(tmp_path, llava_target, root, []).dataset["id"]) == ["s0", "s1"]


def test_an_image_changed_under_a_run_is_named_with_advice_that_works(tmp_path, qwen_target):
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from msd_train.data.collate import collate
    from msd_train.data.dataset import UnusableImage
    from msd_train.training.recipe import TrainRecipe

    root = tmp_path / "images"
    root.mkdir()
    random_image(0, 16).save(root / "a.png")
    split = llava_rows(tmp_path, qwen_target, root, ["a.png"])
    random_image(0, 56).save(root / "a.png")  # another size: another number of visual tokens (4, now 16)
    with pytest.raises(UnusableImage) as e:
        collate([split.dataset[0]], qwen_target)
    assert "sample s0" in str(e.value) and "a.png changed since the data was tokenised" in str(e.value)
    fake = SimpleNamespace(main=True, step=6, cfg=OmegaConf.create(
        {"data": {"cache_dir": str(tmp_path / "cache"), "on_bad_sample": "skip"}}))
    message = str(TrainRecipe._unusable(fake, e.value))
    assert "step 7" in message and "skips that sample" in message and "touch" not in message
    again = llava_rows(tmp_path, qwen_target, root, [])  # what the relaunch reads: the sample left out
    assert len(again.dataset) == 0 and [b.id for b in again.skipped] == ["s0"]


# ----------------------------------------------------------------------------- records are what happened


def a_stage_with_a_checkpoint(tmp_path, state: dict, *overrides):
    """A stage whose settings were recorded at its start and which holds one checkpoint (step 4)."""
    from builders.runs import fake_checkpoint

    from msd_train.training import checkpoint as ckpt
    from msd_train.training import resume

    stage = tmp_path / "run" / "stage1"
    resume.check_resume(train_cfg(tmp_path, *overrides), stage, None, None, write=True)
    cand = fake_checkpoint(stage / "checkpoints", 4, {"step": 4, "curriculum": {}, "bad_total": 0, "best_tau": -1.0,
                                                      **state})
    (cand / ckpt.PORTABLE_FILE).write_bytes(b"")
    return stage


def history(stage: Path) -> list:
    return json.loads((stage / "settings.json").read_text())["history"]


def test_a_resume_at_another_world_size_records_the_values_before_and_after(tmp_path):
    from msd_train.training import resume

    # written by 2 processes x micro-batch 4 x grad_accum 2 = 16; resumed by 4 x 2 x 2
    stage = a_stage_with_a_checkpoint(tmp_path, {"global_batch": 16, "world_size": 2, "zero_stage": 2,
                                                 "micro_batch_size": 4, "grad_accum": 2}, "train.micro_batch_size=4")
    point = resume.resume_point(train_cfg(tmp_path, "train.micro_batch_size=2"), 0, 4)
    assert point.grad_accum == 2 and history(stage) == []  # nothing applied yet: nothing recorded
    resume.record_applied(point, 4, main=True)
    assert [h["changed"] for h in history(stage)] == [{"world_size": {"checkpoint": 2, "now": 4},
                                                       "train.micro_batch_size": {"checkpoint": 4, "now": 2}}]


def test_a_launch_refused_because_no_checkpoint_loads_records_nothing_applied(tmp_path):
    from types import SimpleNamespace

    from msd_train.training import resume

    stage = a_stage_with_a_checkpoint(tmp_path, {"global_batch": 4, "world_size": 1, "zero_stage": 2})
    before = (stage / "settings.json").read_text()
    point = resume.resume_point(train_cfg(tmp_path, "train.max_steps=400", "train.grad_clip=0.25"), 0, 1)

    class Engine:
        def load_checkpoint(self, *a, **k):
            raise RuntimeError("PytorchStreamReader failed reading zip archive")

    group = SimpleNamespace(rank=0, main=True, any=lambda flag: flag)
    with pytest.raises(resume.ResumeRefused, match="no checkpoint .* loads"):
        resume.load(point, Engine(), group, {})
    assert (stage / "settings.json").read_text() == before
    resume.record_applied(point, 4, main=True)  # once one loads, each change is recorded with both values
    assert history(stage)[-1]["changed"] == {"train.grad_clip": {"checkpoint": 0.5, "now": 0.25},
                                             "train.max_steps": {"checkpoint": 300, "now": 400}}


# ----------------------------------------------------------------------------- one message, not a traceback


def test_cpu_linear_and_onednn_max_cpu_isa_are_checked_up_front(monkeypatch):
    from msd_train.validate import ConfigError, check_eval

    cfg = {"target": {"name_or_path": str(ROOT / "data" / "tiny-llava"), "cpu_linear": "bogus"}}
    with pytest.raises(ConfigError, match="target.cpu_linear=bogus: use auto .*onednn or aten"):
        check_eval(cfg, "ar")
    cfg["target"]["cpu_linear"] = "aten"
    check_eval(cfg, "ar")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "garbage")  # oneDNN would run without a limit
    with pytest.raises(ConfigError, match="ONEDNN_MAX_CPU_ISA=garbage: .*AVX2, .*AVX512_CORE_BF16, .*or unset it"):
        check_eval(cfg, "ar")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")
    check_eval(cfg, "ar")


@pytest.mark.parametrize("damage", ["cut", "garbage"])
def test_a_damaged_arrow_file_in_the_cache_is_tokenised_again(tmp_path, llava_target, damage, caplog):
    from msd_train.data.dataset import build_split

    data = sharegpt_file(tmp_path / "t.json", ["a cat sat", "a dog ran"])
    src, cache = [{"path": str(data)}], tmp_path / "cache"
    ids = [list(r) for r in build_split(src, llava_target, 64, "skip", str(cache)).dataset["input_ids"]]
    (arrow,) = [p for p in cache.glob("split-*/*.arrow")]
    arrow.write_bytes(arrow.read_bytes()[:len(arrow.read_bytes()) // 2] if damage == "cut" else b"\0junk" * 50)
    with caplog.at_level("WARNING"):
        again = build_split(src, llava_target, 64, "skip", str(cache))
    assert [list(r) for r in again.dataset["input_ids"]] == ids
    assert "is damaged" in caplog.text and "tokenising again" in caplog.text


def test_a_cache_dir_that_cannot_be_written_is_one_message_naming_the_setting(tmp_path, llava_target, monkeypatch):
    import errno
    import tempfile

    from msd_train.data.dataset import build_split
    from msd_train.errors import ConfigError

    data = sharegpt_file(tmp_path / "t.json", ["a cat sat"])
    cache = tmp_path / "cache"
    cache.mkdir()

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system", str(cache / ".building-x"))

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    with pytest.raises(ConfigError, match=r"data.cache_dir=.*cache: cannot write the tokenised cache there .*"
                                          r"Read-only file system.*data.cache_dir=DIR"):
        build_split([{"path": str(data)}], llava_target, 64, "skip", str(cache))
    monkeypatch.undo()
    build_split([{"path": str(data)}], llava_target, 64, "skip", str(cache))
    monkeypatch.setattr(tempfile, "mkdtemp", read_only)  # a finished cache is read without writing
    assert len(build_split([{"path": str(data)}], llava_target, 64, "skip", str(cache))) == 1


def test_an_out_folder_written_with_dotdot_is_the_folder_it_names(tmp_path):
    from msd_train.outputs import output_dir
    from msd_train.validate import check_out_dir

    out = tmp_path / "new" / "sub" / ".."  # neither exists yet
    check_out_dir(out)
    with output_dir(out, "scripts/export.py") as tmp:
        (tmp / "config.json").write_text("{}")
    assert (tmp_path / "new" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".new.msd-output", "new"]


def test_a_chat_template_the_sandbox_refuses_is_one_message_naming_the_setting():
    from msd_train.errors import ConfigError
    from msd_train.targets.chat import render_prompt

    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ConfigError, match=r"target.chat_template.*SecurityError.*sandbox.*built-in one"):
        render_prompt(msgs, "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ConfigError, match=r"target.chat_template.*compiled \(line 1\): TemplateSyntaxError"):
        render_prompt(msgs, "{% for m in messages %}")


def test_a_target_whose_weights_file_is_a_pickle_is_refused_in_one_message(tmp_path):
    import shutil

    import torch

    from msd_train.errors import ConfigError
    from msd_train.targets import load_target

    class Planted:
        def __reduce__(self):
            return (print, ("planted code ran",))

    folder = tmp_path / "target"
    shutil.copytree(ROOT / "data" / "tiny-llava", folder)
    (folder / "model.safetensors").unlink()
    torch.save({"w": Planted()}, folder / "pytorch_model.bin")
    with pytest.raises(ConfigError) as e:
        load_target(str(folder), "float32", "cpu")
    msg = str(e.value)
    assert f"target.name_or_path={folder}" in msg and "Unsupported global" in msg and "safetensors" in msg
    assert "weights_only=False" not in msg  # torch's advice to load it unsafely is not passed on


@pytest.mark.parametrize("program", ["lab.studies.sampling_rank", "lab.studies.real_lm.scale_data",
                                     "lab.bench.train_summary"])
def test_lab_programs_given_no_arguments_print_their_usage(program):
    out = subprocess.run([sys.executable, "-m", program], cwd=ROOT, env=ENV, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "usage:" in out.stderr and "the following arguments are required" in out.stderr


# ----------------------------------------------------------------------------- promises kept


def hold_lock_as_another_live_process(lock_file: Path):
    """A live process (this test's parent shell) named as the owner of ``lock_file``."""
    import socket

    from msd_train.outputs import process_start

    owner = os.getppid()
    lock_file.write_text(json.dumps({"pid": owner, "host": socket.gethostname(), "start_time": process_start(owner),
                                     "started": "now", "command": "scripts/generate_features.py features.path=..."}))


def test_the_second_writer_of_a_feature_store_or_a_regeneration_folder_is_refused(tmp_path):
    from msd_train.outputs import FolderLock, OutputBusy, lock_path

    for folder, setting in ((tmp_path / "store", "features.path"), (tmp_path / "regen", "out")):
        with FolderLock(folder, setting):
            with pytest.raises(OutputBusy, match=f"{setting}=.*is being written by another command.*resumes"):
                FolderLock(folder, setting).acquire()
        FolderLock(folder, setting).acquire()  # released: the next one takes it
    # the scripts take it: a second generate_features.py is refused before any work, in one message
    store = tmp_path / "store2"
    hold_lock_as_another_live_process(lock_path(store))
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate_features.py"), f"features.path={store}",
                          f"target.name_or_path={ROOT / 'data' / 'tiny-llava'}"],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "is being written by another command" in out.stderr and "features.path=" in out.stderr
    assert not store.exists()


def test_refusals_of_commands_without_overwrite_offer_none(tmp_path):
    from msd_train.outputs import OutputError, check_output

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(OutputError) as e:
        check_output(mine, "scripts/generate_features.py", None, setting="features.path")
    assert "overwrite" not in str(e.value) and "features.path=" in str(e.value)
    with pytest.raises(OutputError) as e:
        check_output(mine, "scripts/export.py", False)
    assert "overwrite=true" in str(e.value)  # where it exists, it is offered


def test_a_refused_training_launch_leaves_nothing_in_the_folder_it_refused(tmp_path):
    regen = tmp_path / "regen"
    regen.mkdir()
    (regen / "settings.json").write_text(json.dumps({"max_new_tokens": 8}))
    (regen / "rank-0.jsonl").write_text("")
    before = sorted(p.name for p in regen.iterdir())
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), f"run_dir={regen}"], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "a regeneration folder" in out.stderr, out.stderr[-3000:]
    assert sorted(p.name for p in regen.iterdir()) == before
    new = tmp_path / "new" / "run"  # a run_dir this launch made for nothing is gone too
    out = subprocess.run([sys.executable, str(ROOT / "train.py"), f"run_dir={new}", "train.lr=-1"], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "train.lr" in out.stderr, out.stderr[-3000:]
    assert not (tmp_path / "new").exists()
