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
from msd_train.hub_cli import resolve_target


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
    # recipe_base/: what the experiments include, never selected on its own
    for group in sorted(p for p in CONF_DIR.iterdir() if p.is_dir() and p.name not in ("hub", "recipe_base")):
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


def compose_resolved(entry, overrides):
    """The config as the command sees it, interpolations resolved (``${hydra:...}`` included)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict

    more = {"generate_features.py": "generate_features", "serve_check.py": "serve_check",
            "regenerate_data.py": "regenerate"}
    conf_dir, name = {**ENTRY_POINTS, **{k: (CONF_DIR, v) for k, v in more.items()}}[entry]
    argv = [entry, *overrides]
    strip_launcher_args(argv)
    with initialize_config_dir(config_dir=str(conf_dir), version_base=None):
        cfg = hydra_compose(config_name=name, overrides=argv[1:], return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        with open_dict(cfg):
            del cfg["hydra"]
        return OmegaConf.to_container(cfg, resolve=True)


EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


def test_there_is_an_experiment_for_every_real_target():
    real = {p.stem for p in (CONF_DIR / "target").glob("*.yaml")} - {"tiny"}
    assert real <= set(EXPERIMENTS)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_each_experiment_composes_each_stage_as_its_recipe_says(name):
    """``train.py experiment=NAME stage=N`` gets the recipe's stage N: its steps, lr, warm-up and
    curriculum, on the experiment's own target, with bf16 and a global batch that is the recipe's."""
    import yaml

    text = (CONF_DIR / "experiment" / f"{name}.yaml").read_text()
    assert "deepspeed train.py experiment=" + name in text  # the file says how to launch it
    stages = {}
    for stage in ("1", "2", "3"):
        cfg = compose_resolved("train.py", [f"experiment={name}", f"stage={stage}"])
        assert cfg["recipe"]["target"] == cfg["recipe"]["target_chosen"]
        want = cfg["recipe"]["stages"][stage]
        assert cfg["train"]["max_steps"] == want["max_steps"]
        assert cfg["train"]["lr"] == want["lr"] and cfg["train"]["warmup_steps"] == want["warmup_steps"]
        assert cfg["eval"]["every"] == cfg["checkpoint"]["every"] == want["every"]
        for k in ("start", "end", "ramp_steps"):
            assert cfg["stage"]["curriculum"][k] == want["curriculum"][k]
        assert cfg["train"]["precision"] == "bf16"
        assert cfg["run_dir"].startswith(cfg["recipe"]["work"])
        stages[stage] = cfg
    assert stages["1"]["stage"]["curriculum"]["end"] == 0  # stage 1 is text only
    assert stages["2"]["stage"]["curriculum"]["ramp_steps"] > 0  # stage 2 ramps images in
    assert stages["2"]["stage"]["init_from"].endswith("stage1/final")
    assert stages["1"]["target"]["name_or_path"] == compose_resolved(
        "train.py", [f"target={stages['1']['recipe']['target']}"])["target"]["name_or_path"]
    assert yaml.safe_load(text)  # plain YAML a reader can load


def test_a_command_line_value_wins_over_the_experiment():
    cfg = compose_resolved("train.py", ["experiment=smollm2_llava", "stage=2", "train.max_steps=7",
                                        "recipe.stages.2.lr=0.001"])
    assert cfg["train"]["max_steps"] == 7 and cfg["train"]["lr"] == 0.001


def test_the_feature_store_command_takes_the_experiment():
    cfg = compose_resolved("generate_features.py", ["experiment=smollm2_llava", "recipe.work=/w"])
    assert cfg["features"]["path"] == "/w/store"
    assert cfg["data"]["text"][0]["path"] == "/w/splits/text_train.jsonl"
    assert cfg["target"]["name_or_path"].endswith("data/smollm2-llava")


def test_head_eagle3_is_msd3_without_decoupling():
    eagle3 = compose_resolved("train.py", ["head=eagle3"])["draft"]
    msd3 = compose_resolved("train.py", ["head=msd3"])["draft"]
    assert eagle3["architecture"] == "msd3" and eagle3["decouple_visual"] is False
    assert {k: v for k, v in eagle3.items() if k != "decouple_visual"} == {
        k: v for k, v in msd3.items() if k != "decouple_visual"}


def test_an_unknown_experiment_is_refused_listing_those_that_exist():
    from msd_train.validate import ConfigError, hub_experiment

    for entry in ("train.py", "eval.py"):
        with pytest.raises(ConfigCompositionException) as err:
            compose_entry(entry, ["experiment=smolm2_llava"])
        assert "smollm2_llava" in str(err.value) and "qwen25vl_7b" in str(err.value)
        assert "recipe_base" not in str(err.value)
    with pytest.raises(ConfigError, match="experiment=smolm2_llava: no such experiment.*of .*qwen25vl_7b.*smollm2_llava"):
        hub_experiment(compose_entry("scripts/export.py", ["experiment=smolm2_llava", "format=vllm"]), "export")


def test_the_steps_after_training_take_the_experiment(tmp_path):
    """eval.py, serve_check.py and regenerate_data.py compose the experiment (its target, the head its
    recipe ends with, its prompts); export.py and push_to_hub.py fill their checkpoint= and out= from it."""
    from msd_train.validate import hub_experiment

    work = ["experiment=smollm2_llava", f"recipe.work={tmp_path}"]
    smollm2 = compose_resolved("train.py", ["target=smollm2_llava"])["target"]["name_or_path"]
    cfg = compose_resolved("eval.py", [*work, "bench=jsonl"])
    assert cfg["target"]["name_or_path"] == smollm2
    assert cfg["draft"] == f"{tmp_path}/run/stage2/final" == cfg["recipe"]["head"]
    assert cfg["bench"]["path"] == f"{tmp_path}/splits/bench_text.jsonl"
    assert compose_resolved("eval.py", [*work, "draft=other/head"])["draft"] == "other/head"
    gpu = compose_resolved("eval.py", ["experiment=llava15_7b", "bench=mmspec"])  # no data= group in eval.py
    assert gpu["draft"] == "work/llava15_7b/run/stage2/final" and gpu["bench"]["path"] == "work/llava15_7b/mmspec"
    serve = compose_resolved("serve_check.py", work)
    assert (serve["draft"], serve["original"]) == (f"{tmp_path}/export/vllm", f"{tmp_path}/run/stage2/final")
    assert compose_resolved("serve_check.py", [])["draft"] is None
    assert compose_resolved("regenerate_data.py", [*work, "out=x"])["target"]["name_or_path"] == smollm2
    (tmp_path / "run" / "stage2" / "final").mkdir(parents=True)
    (tmp_path / "run" / "stage2" / "final" / "config.json").write_text("{}")
    export = compose_entry("scripts/export.py", [*work, "format=vllm"])
    assert hub_experiment(export, "export")["target"] == "smollm2_llava"
    assert (export.checkpoint, export.out) == (f"{tmp_path}/run/stage2/final", f"{tmp_path}/export/vllm")
    push = compose_entry("scripts/push_to_hub.py", [*work, "repo_id=me/x"])
    hub_experiment(push, "push")
    assert push.checkpoint == f"{tmp_path}/run/stage2/final"


def test_a_step_after_training_before_its_head_names_the_command_that_makes_it(tmp_path):
    """Evaluating, exporting, pushing or serving an experiment's head before its training (or its
    export) wrote it, or on another target: refused before anything loads, with the command to run first."""
    from msd_train.validate import ConfigError, check_eval, check_experiment, check_serve, hub_experiment

    work = ["experiment=smollm2_llava", f"recipe.work={tmp_path}"]
    train = re.escape(f"`deepspeed train.py experiment=smollm2_llava recipe.work={tmp_path} stage=2`")
    head = re.escape(f"{tmp_path}/run/stage2/final")
    with pytest.raises(ConfigError, match=f"draft={head} is the head stage 2 .*{train}"):
        check_eval(compose_resolved("eval.py", work), "tree")
    with pytest.raises(ConfigError, match=train):
        check_serve(compose_resolved("serve_check.py", work))
    for entry, script in (("scripts/export.py", "export"), ("scripts/push_to_hub.py", "push")):
        with pytest.raises(ConfigError, match=f"checkpoint={head} .*{train}"):
            hub_experiment(compose_entry(entry, [*work, "format=vllm" if script == "export" else "repo_id=a/b"]),
                                script)
    (tmp_path / "run" / "stage2" / "final").mkdir(parents=True)
    (tmp_path / "run" / "stage2" / "final" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=re.escape(
            f"`python scripts/export.py experiment=smollm2_llava recipe.work={tmp_path} format=vllm`")):
        check_serve(compose_resolved("serve_check.py", work))
    for entry, extra in (("eval.py", []), ("regenerate_data.py", ["out=x"])):
        with pytest.raises(ConfigError, match="recipe for target=smollm2_llava, but this launch says target=tiny"):
            check_experiment(compose_resolved(entry, [*work, "target=tiny", *extra]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing written


def test_training_from_a_store_not_made_or_not_finished_names_the_command_that_makes_it(tmp_path):
    """Any launch with features=offline, not only an experiment's: refused before anything is read or
    written while features.path holds no finished store, naming the generate_features command with
    this launch's target, data and store settings."""
    from msd_train.validate import ConfigError, check_store, check_train

    store = tmp_path / "store"
    overrides = ["stage='2'", "features=offline", f"features.path={store}", "target=tiny",
                 "data.text=[{path: a.json}]", "features.layers=[1,2]", "train.max_steps=3"]
    cfg = compose_resolved("train.py", overrides)
    command = ("`python scripts/generate_features.py " + f"features.path={store} target=tiny "
               "'data.text=[{path: a.json}]' 'features.layers=[1,2]'`")  # quoted for the shell
    with pytest.raises(ConfigError, match=f"features.path={re.escape(str(store))}: no feature store there yet .*"
                                          f"{re.escape(command)}"):
        check_train(cfg, overrides)
    store.mkdir()
    (store / "manifest.json").write_text('{"complete": false, "shards": [{}, {}]}')
    with pytest.raises(ConfigError, match=f"not finished \\(2 shards written\\); relaunch {re.escape(command)}"):
        check_train(cfg, overrides)
    (store / "manifest.json").write_text('{"complete": true, "shards": [{}, {}]}')
    check_store(cfg, overrides)
    with pytest.raises(ConfigError, match="features.path is not set"):
        check_train(compose_resolved("train.py", ["features=offline"]))
    work = tmp_path / "work"
    recipe = ["experiment=smollm2_llava", f"recipe.work={work}", "stage='1'", "data.max_length=256"]
    with pytest.raises(ConfigError, match=re.escape(  # an experiment's, with the launch's data overrides
            f"`python scripts/generate_features.py experiment=smollm2_llava recipe.work={work} data.max_length=256`")):
        check_train(compose_resolved("train.py", recipe), recipe)


def test_a_recipe_step_out_of_order_names_the_command_that_comes_first(tmp_path):
    """Training from a store not made yet, stage 2 before stage 1, an experiment on another target:
    refused before anything is read or written, with the command to run first."""
    from msd_train.validate import ConfigError, check_train

    work = ["experiment=smollm2_llava", f"recipe.work={tmp_path}"]
    with pytest.raises(ConfigError, match=re.escape(
            f"`python scripts/generate_features.py experiment=smollm2_llava recipe.work={tmp_path}`")):
        check_train(compose_resolved("train.py", [*work, "stage=1"]))
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "manifest.json").write_text('{"complete": true}')
    with pytest.raises(ConfigError, match=re.escape(
            f"`deepspeed train.py experiment=smollm2_llava recipe.work={tmp_path} stage=1`")):
        check_train(compose_resolved("train.py", [*work, "stage=2"]))
    with pytest.raises(ConfigError, match="recipe for target=smollm2_llava, but this launch says target=tiny"):
        check_train(compose_resolved("train.py", [*work, "stage=1", "target=tiny"]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]  # nothing written


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_command_composes_each_experiment(name):
    """An experiment may pick its head (``override /head``: smollm2_llava_dflash): every command that
    takes ``experiment=`` composes it, and the commands after training read its head's folder."""
    work = [f"experiment={name}", "recipe.work=/w"]
    train = compose_resolved("train.py", [*work, "stage=2"])
    head = train["recipe"]["head"]
    assert compose_resolved("eval.py", work)["draft"] == head
    assert compose_resolved("serve_check.py", work)["original"] == head
    for entry in ("generate_features.py", "scripts/check_data.py"):
        assert compose_resolved(entry, work)["target"] == train["target"]
    assert compose_resolved("regenerate_data.py", [*work, "out=x"])["target"] == train["target"]


def test_the_dflash_recipe_is_smollm2_llavas_with_its_head():
    """Same folder, store and splits as smollm2_llava (one store serves both), its own run folder."""
    msd = compose_resolved("train.py", ["experiment=smollm2_llava", "stage=2"])
    dflash = compose_resolved("train.py", ["experiment=smollm2_llava_dflash", "stage=2"])
    assert dflash["draft"]["architecture"] == "dflash" and dflash["draft"]["feature_layers"] == [30]
    assert dflash["draft"]["decouple_visual"] is True and dflash["draft"]["train_vocab"] == 8192
    assert (dflash["recipe"]["work"], dflash["features"], dflash["data"]) == (msd["recipe"]["work"], msd["features"], msd["data"])
    assert dflash["run_dir"] != msd["run_dir"]
