"""The Hydra config tree as users meet it: every documented command composes, the embedded
default points at files that exist, mistakes are errors that name the key, launcher
arguments are made Hydra-safe."""

import re
import shlex
from pathlib import Path

import pytest
from builders.runs import ENTRY_POINTS, compose_entry
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigAttributeError

from msd_train.config import CONF_DIR, REPO_ROOT, strip_launcher_args
from msd_train.hub.cli import resolve_target


def documented_commands():
    """(file, entry point, arguments) of every command of ours in a bash block of the docs,
    `...` (elided arguments) dropped."""
    found = []
    for doc in [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]:
        for lang, block in re.findall(r"```(\w*)\n(.*?)```", doc.read_text(), re.S):
            if lang not in ("bash", "sh"):
                continue
            for line in block.replace("\\\n", " ").splitlines():
                for command in line.split("&&"):
                    words = shlex.split(command, comments=True)
                    for i, word in enumerate(words):
                        if word in ENTRY_POINTS:
                            found.append((doc.name, word, [w for w in words[i + 1:] if w != "..."]))
    return found


DOCUMENTED = documented_commands()


def test_the_docs_show_every_entry_point():
    assert {entry for _, entry, _ in DOCUMENTED} == set(ENTRY_POINTS)


@pytest.mark.parametrize("doc,entry,args", DOCUMENTED, ids=[f"{d}:{e}:{' '.join(a)}" for d, e, a in DOCUMENTED])
def test_documented_command_composes(doc, entry, args):
    cfg = compose_entry(entry, args)
    given = dict(a.split("=", 1) for a in args)
    if entry == "eval.py" and "draft" in given:
        assert cfg.draft == given["draft"]  # the head to evaluate, a plain key
    if "target" in given and ENTRY_POINTS[entry][0] == CONF_DIR / "hub":  # a plain key there
        assert resolve_target(cfg.target)[0] == compose_entry("train.py", [f"target={given['target']}"]).target.name_or_path


def test_every_option_of_every_group_composes():
    """A user can select each file of conf/<group>/: the training groups in train.py,
    the evaluation ones in eval.py."""
    for group in sorted(p for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hub"):
        entry = "eval.py" if group.name in ("bench", "decoding") else "train.py"
        for option in sorted(group.glob("*.yaml")):
            compose_entry(entry, [f"{group.name}={option.stem}"])


def test_embedded_default_needs_no_overrides():
    """`deepspeed train.py stage=1` with nothing else: the target and every data file exist
    in the checkout, from any working directory."""
    cfg = compose_entry("train.py", ["stage=1"])
    assert (Path(cfg.target.name_or_path) / "config.json").is_file()
    files = [Path(s.path) for split in ("text", "multimodal", "heldout_text", "heldout_multimodal")
             for s in cfg.data[split]]
    assert files and all(f.is_file() for f in files), files
    assert all(Path(s.image_root).is_dir() for s in cfg.data.multimodal)


def test_head_options_keep_their_draft_spelling():
    """The training head's group is head/ (draft= is eval.py's head to evaluate), but its
    options are set as draft.* as before, and eval.py's draft= is not a group choice."""
    assert compose_entry("train.py", ["draft.decouple_visual=false"]).draft.decouple_visual is False
    assert compose_entry("eval.py", ["draft=lucylyn/MSD-LLaVA1.5-7B"]).draft == "lucylyn/MSD-LLaVA1.5-7B"


def test_hub_target_is_a_name_a_path_or_a_hub_id(tmp_path):
    tiny = compose_entry("train.py").target.name_or_path
    for given, expected in [("tiny", tiny), (str(tmp_path), str(tmp_path)),
                            ("llava-hf/llava-1.5-7b-hf", "llava-hf/llava-1.5-7b-hf")]:
        cfg = compose_entry("scripts/export.py", ["checkpoint=a", "out=b", f"target={given}"])
        assert resolve_target(cfg.target)[0] == expected


def test_misspelt_key_is_an_error_naming_it():
    with pytest.raises(ConfigCompositionException, match="train.max_stpes"):
        compose_entry("train.py", ["train.max_stpes=3"])
    with pytest.raises(ConfigCompositionException, match="repo_idd"):
        compose_entry("scripts/push_to_hub.py", ["checkpoint=a", "repo_idd=me/x"])
    cfg = compose_entry("train.py")
    with pytest.raises(ConfigAttributeError, match="learning_rate"):
        _ = cfg.train.learning_rate


def test_launcher_arguments_are_made_hydra_safe(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    argv = ["train.py", "--local_rank=1", "stage=1", "--local-rank", "1", "run_dir=x"]
    strip_launcher_args(argv)
    assert argv == ["train.py", "stage='1'", "run_dir=x"]
    import os

    assert os.environ["LOCAL_RANK"] == "1"
