"""What the project trusts: no file it reads runs code, whoever wrote it.

Each test plants a pickle that would create a marker folder if unpickled into a file a
command reads (a resume, an import, an eval, a feature store) and checks that the command
refuses the file by name and that the marker was never made.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from builders.heads import released_head
from builders.runs import gen_cfg, recipe
from builders.scripts import refused_in_process, restore_root_logging, script_main  # noqa: F401 (an autouse fixture)

ROOT = Path(__file__).resolve().parents[2]


class Planted:
    """Unpickling this creates the folder ``marker``: proof that a load ran code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def plant(path: Path, marker: Path) -> None:
    """Add a :class:`Planted` to the dict a torch file holds (the test's own file: loaded as it is)."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    state["planted"] = Planted(marker)
    torch.save(state, path)




# ----------------------------------------------------------------------------- resume


@pytest.fixture(scope="module")
def checkpointed(mini_run, in_process, tmp_path_factory):
    """A stage-1 run with one checkpoint (ZeRO-2, one process), and its overrides."""
    run = tmp_path_factory.mktemp("trust") / "run"
    common = ["stage='1'", *mini_run, "train.max_steps=4", "checkpoint.every=100", "eval.every=100",
              "data.max_heldout=2"]
    r = recipe([*common, f"run_dir={run}"])
    r.train_step()
    r.step += 1
    r.save_checkpoint()
    return run, common


@pytest.mark.parametrize("name, launch", [
    ("engine/mp_rank_00_model_states.pt", []),  # DeepSpeed's own files: the same layout of processes
    ("engine/zero_pp_rank_0_mp_rank_00_optim_states.pt", []),
    ("portable.pt", ["deepspeed=zero1"]),  # another ZeRO stage resumes from the portable state
    ("token_counts.safetensors", []),  # a pickle where safetensors are read
])
def test_a_resume_runs_no_pickle_planted_in_a_checkpoint(checkpointed, in_process, tmp_path, name, launch):
    import pickle

    from msd_train.errors import ConfigError
    from msd_train.training.resume import ResumeRefused

    run, common = checkpointed
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    ckpt = copy / "stage1" / "checkpoints" / "step-000001"
    marker = tmp_path / "ran"
    if name.endswith(".pt"):
        plant(ckpt / name, marker)
    else:
        (ckpt / name).write_bytes(pickle.dumps({"counts": Planted(marker)}))
    with pytest.raises((ResumeRefused, ConfigError)) as e:
        recipe([*common, f"run_dir={copy}", *launch])
    assert not marker.exists(), "resuming ran the pickle"
    text = str(e.value)
    assert str(ckpt / name) in text, text
    if name.endswith(".pt"):
        assert "posix.mkdir" in text and "resume=false" in text, text


def test_the_checkpoints_the_project_writes_resume(checkpointed, in_process, tmp_path):
    """The allowed types are enough for what DeepSpeed writes: the same files resume."""
    run, common = checkpointed
    r = recipe([*common, f"run_dir={run}"])
    assert r.step == 1


# ----------------------------------------------------------------------------- import, eval, features


def test_import_runs_no_pickle_planted_in_a_released_head(tmp_path, monkeypatch, capsys):
    released_head(tmp_path / "released", "llava", "bin")
    weights = tmp_path / "released" / "pytorch_model.bin"
    plant(weights, tmp_path / "ran")
    refused_in_process(capsys, lambda: script_main("scripts/import_reference.py", [
        f"src={tmp_path / 'released'}", f"out={tmp_path / 'ours'}"], monkeypatch), str(weights), "posix.mkdir")
    assert not (tmp_path / "ran").exists() and not (tmp_path / "ours").exists()


def test_eval_runs_no_pickle_planted_in_the_head_or_the_target(target_dir, head_dir, tmp_path, monkeypatch, capsys):
    from safetensors.torch import load_file

    released_head(tmp_path / "released", "llava", "bin")
    plant(tmp_path / "released" / "pytorch_model.bin", tmp_path / "ran")
    refused_in_process(capsys, lambda: script_main("eval.py", [
        f"target.name_or_path={target_dir}", f"draft={tmp_path / 'released'}", f"out={tmp_path / 'out'}"],
        monkeypatch), str(tmp_path / "released" / "pytorch_model.bin"), "posix.mkdir")
    assert not (tmp_path / "ran").exists()

    target = tmp_path / "target"  # a target whose weights are a torch pickle, not safetensors
    shutil.copytree(target_dir, target)
    state = load_file(target / "model.safetensors")
    (target / "model.safetensors").unlink()
    torch.save({**state, "planted": Planted(tmp_path / "ran")}, target / "pytorch_model.bin")
    refused_in_process(capsys, lambda: script_main("eval.py", [
        f"target.name_or_path={target}", f"draft={head_dir}", f"out={tmp_path / 'out'}"], monkeypatch),
        str(target), "pytorch_model", "posix.mkdir")
    assert not (tmp_path / "ran").exists()


def test_a_feature_store_runs_no_pickle_planted_in_a_shard(mini_run, tmp_path):
    import pickle

    from msd_train.features.generate import generate
    from msd_train.features.store import FeatureStore, FeatureStoreError

    store = tmp_path / "store"
    generate(gen_cfg(mini_run, store, "splits=[heldout_text]"))
    shard = sorted(store.glob("*.safetensors"))[0]
    size = shard.stat().st_size
    data = pickle.dumps({"x": Planted(tmp_path / "ran")})
    shard.write_bytes(data + b" " * (size - len(data)))  # the size the manifest records
    with pytest.raises(FeatureStoreError) as e:
        FeatureStore(store)
    assert not (tmp_path / "ran").exists()
    assert str(shard) in str(e.value) and "generate_features" in str(e.value)


def test_files_are_unpickled_in_one_place_only():
    """torch.load, pickle and np.load(allow_pickle=True) are called only in msd_train/trust.py, so
    no read of a file bypasses weights_only=True (DeepSpeed's own loads are replaced on the engine)."""
    import ast

    def unsafe(call: ast.Call) -> bool:
        f = call.func
        name = f"{f.value.id}.{f.attr}" if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
        if name in ("torch.load", "pickle.load", "pickle.loads", "dill.load", "dill.loads", "joblib.load"):
            return True
        return any(k.arg in ("allow_pickle", "weights_only") and not (isinstance(k.value, ast.Constant) and
                   k.value.value is (k.arg == "weights_only")) for k in call.keywords)

    files = [ROOT / "eval.py", ROOT / "train.py", *(ROOT / "msd_train").rglob("*.py"),
             *(ROOT / "scripts").rglob("*.py"), *(ROOT / "lab").rglob("*.py")]
    found = [f"{f.relative_to(ROOT)}:{node.lineno}" for f in files if f != ROOT / "msd_train" / "trust.py"
             for node in ast.walk(ast.parse(f.read_text())) if isinstance(node, ast.Call) and unsafe(node)]
    assert not found, found
