"""lab/gpu/carry.py: what a GPU session's device call carries. The session's files, derived from
its own commands, fit the 48 MiB limit with the carried wheels as the tree grows; everything its
configs name is among them; `prepare` makes a checkout sparse without losing anything and
`restore` brings the whole checkout back."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from builders.runs import compose_entry

from lab.gpu import carry

ROOT = Path(__file__).resolve().parents[2]
MIB = 2 ** 20


@pytest.fixture(scope="module")
def files():
    return carry.session_files()


def test_the_session_carries_at_most_48_mib_with_its_wheels(files):
    tree = carry.size_of(files)
    assert tree + carry.PACK_MIB * MIB <= carry.LIMIT_MIB * MIB, (
        f"a GPU session would carry {tree / MIB:.1f} MiB of files + {carry.PACK_MIB} MiB of wheels, over "
        f"{carry.LIMIT_MIB} MiB: something its commands read grew (lab/gpu/carry.py lists them: "
        f"{', '.join(carry.session_paths())})")


def test_the_list_holds_what_the_commands_run_and_not_the_evidence(files):
    for program in ("train.py", "eval.py", "lab/gpu/session.py", "lab/gpu/carry.py", "lab/bench/decoder_table.py",
                    "lab/bench/train.py", "lab/targets/make_large_target.py", "lab/__init__.py",
                    "lab/bench/__init__.py", "msd_train/config.py", "conf/config.yaml", ".gitignore",
                    "data/tiny-llava/model.safetensors"):
        assert program in files, program
    assert not [f for f in files if f.startswith(("benchmarks/", "tests/", "docs/", "data/smollm2-llava"))]


def test_the_commands_entries_are_found():
    assert carry.entry_file(["deepspeed", "train.py", "stage=1"]) == "train.py"
    assert carry.entry_file(["python", "-m", "lab.bench.train", "--seq-len", "8"]) == "lab/bench/train.py"
    assert carry.entry_file(["python", "-m", "pip", "install"]) is None
    assert carry.entry_file(["nvidia-smi"]) is None


def _repo_paths(node, out):
    """Every existing repository path among a config's values, resolved where they resolve."""
    from omegaconf import DictConfig, ListConfig

    if isinstance(node, (DictConfig, ListConfig)):
        for k in node.keys() if isinstance(node, DictConfig) else range(len(node)):
            if k == "hydra":
                continue
            try:
                value = node[k]
            except Exception:  # noqa: BLE001 - an interpolation only the running entry point resolves
                continue
            _repo_paths(value, out)
    elif isinstance(node, str) and node.startswith(str(ROOT) + os.sep) and Path(node).exists():
        out.add(str(Path(node).relative_to(ROOT)))


@pytest.mark.parametrize("entry, args", [("train.py", ["stage=1"]), ("train.py", ["stage=2"]),
                                         ("eval.py", ["draft=runs/tiny/stage2/final"])])
def test_every_repository_path_the_readme_parts_configs_name_travels(files, entry, args):
    named = set()
    _repo_paths(compose_entry(entry, args), named)
    assert named, "the embedded default names the tiny target and its data by path"
    missing = [p for p in named if not (p in files or any(f.startswith(p + "/") for f in files))]
    assert not missing, f"{entry} reads {missing}, which lab/gpu/carry.py's DATA leaves out of a GPU session"


# ----- the sparse checkout ----------------------------------------------------------------------


def _git(repo, *args):
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout


@pytest.fixture()
def repo(tmp_path):
    r = tmp_path / "repo"
    for rel, text in {"train.py": "x", ".gitignore": "runs/\n", "pkg/a.py": "a", "pkg/b.py": "b",
                      "big/heads/w.bin": "w" * 1000, "big/notes.md": "n", "data/tiny/x.json": "{}",
                      "data/tiny-llava/m.bin": "m"}.items():
        (r / rel).parent.mkdir(parents=True, exist_ok=True)
        (r / rel).write_text(text)
    _git(r, "init", "-q")
    _git(r, "add", ".")
    _git(r, "commit", "-qm", "init")
    return r


def test_prepare_leaves_the_listed_files_and_restore_brings_back_the_rest(repo, capsys):
    (repo / "big" / "notes.md").write_text("an edit not committed")
    (repo / "big" / "untracked.txt").write_text("mine")
    (repo / "runs").mkdir()
    (repo / "runs" / "log").write_text("ignored")
    assert carry.prepare(repo, ["pkg/a.py", "data/tiny"]) == 0
    present = sorted(str(p.relative_to(repo)) for p in repo.rglob("*") if p.is_file() and ".git" not in p.parts)
    assert present == [".gitignore", "big/notes.md", "big/untracked.txt", "data/tiny/x.json", "pkg/a.py",
                       "runs/log", "train.py"]  # the edit and the untracked file are kept, nothing lost
    assert (repo / "big" / "notes.md").read_text() == "an edit not committed"
    assert carry.prepare(repo, ["pkg/a.py", "pkg/b.py"]) == 0  # again: the session's own sparse checkout
    assert (repo / "pkg" / "b.py").is_file() and not (repo / "data" / "tiny" / "x.json").exists()
    assert carry.restore(repo) == 0
    assert (repo / "big" / "heads" / "w.bin").read_text() == "w" * 1000 and (repo / "data/tiny-llava/m.bin").is_file()
    assert (repo / "big" / "notes.md").read_text() == "an edit not committed"
    assert not carry.sparse_on(repo)
    assert carry.restore(repo) == 0 and "nothing to restore" in capsys.readouterr().out


def test_a_sparse_checkout_the_session_did_not_set_is_left_alone(repo, capsys):
    _git(repo, "sparse-checkout", "set", "--no-cone", "/*", "!/*/", "/pkg/")
    assert carry.prepare(repo, ["big"]) == 1
    assert "already a sparse checkout" in capsys.readouterr().out
    assert (repo / "pkg" / "a.py").is_file() and not (repo / "big").exists()
    assert carry.restore(repo) == 0 and not (repo / "big").exists()  # not ours to undo


@pytest.mark.slow
def test_the_listed_files_alone_import_every_program_the_session_runs(tmp_path, files):
    """A copy of just the listed files imports each program its commands run (nothing missing)."""
    for f in files:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_bytes((ROOT / f).read_bytes())
    code = ("import runpy, sys\n"
            "import lab.gpu.session, lab.bench.decoder_table, lab.bench.train, lab.targets.make_large_target\n"
            "for script in ('train.py', 'eval.py'):\n"
            "    runpy.run_path(script, run_name='not_main')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
