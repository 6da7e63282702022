"""Every setting checked up front, every entry point speaks in messages,
no non-finite head is used, paths as users write them.

The checks run in-process (``check_*``, the readers); each entry point is also run once as a
user runs it (a subprocess) to see one paragraph, exit code 1 and no traceback.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from builders.heads import released_head
from builders.runs import compose_entry

from msd_train.validate import ConfigError, check_eval, check_train

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "data" / "tiny-llava")
ENV = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
       "HF_HUB_OFFLINE": "1"}
ENV.pop("MSD_DEBUG", None)


def run(script, *args, env=None, timeout=300, cwd=ROOT):
    start = time.monotonic()
    out = subprocess.run([sys.executable, str(ROOT / script), *args], cwd=cwd, env=env or ENV,
                         capture_output=True, text=True, timeout=timeout)
    return out, time.monotonic() - start


def refused(out, *phrases):
    """Exit code 1, no traceback, one paragraph (the error and the MSD_DEBUG hint) naming ``phrases``."""
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-3000:]
    assert "Traceback" not in text, text[-5000:]
    error = text[text.index("error: "):]
    assert "(set MSD_DEBUG=1 for the traceback)" in error, error
    assert len([x for x in error.splitlines() if x.strip()]) == 2, error
    for p in phrases:
        assert p in error, error
    return error


def nested(key: str, value) -> dict:
    *parents, last = key.split(".")
    cfg = node = {}
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    return cfg


# ----------------------------------------------------------------------------- 3: settings


@pytest.mark.parametrize("key,value", [
    ("train.lr", math.nan), ("train.lr", math.inf), ("train.grad_clip", math.nan), ("train.weight_decay", -math.inf),
    ("train.min_lr_ratio", math.nan), ("train.betas", [0.9, math.nan]), ("train.noise_scale", math.inf),
    ("stage.curriculum.start", math.nan), ("stage.curriculum.end", math.nan),
])
def test_non_finite_training_settings_are_refused(key, value):
    cfg = nested(key, value)
    shown = key if key != "train.betas" else "train.betas.1"
    with pytest.raises(ConfigError, match=rf"{shown}=(nan|inf|-inf) is not a finite number"):
        check_train(cfg)


@pytest.mark.parametrize("key,value,phrase", [
    ("draft.train_vocab", "abc", "is not an integer"), ("draft.train_vocab", 0, "must be at least 1"),
    ("draft.draft_vocab_size", 0, "must be at least 1"), ("train.bucket_window", -1, "must be at least 0"),
])
def test_vocabulary_and_bucket_settings_are_checked_before_loading(key, value, phrase):
    with pytest.raises(ConfigError, match=rf"^{key}=\S+ {phrase}"):
        check_train(nested(key, value))


def _float_leaves(node, prefix=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _float_leaves(v, f"{prefix}{k}.")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _float_leaves(v, f"{prefix}{i}.")
    elif isinstance(node, float):
        yield prefix[:-1]


@pytest.mark.parametrize("entry,overrides", [("train.py", ["stage=2"]), ("eval.py", ["decoding=tree"])])
def test_every_float_setting_of_the_configs_must_be_finite(entry, overrides):
    """Each float the shipped YAML holds, set to nan, is refused naming it: a float setting
    added later without a check fails here."""
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(compose_entry(entry, overrides), resolve=False)
    keys = list(_float_leaves(plain))
    assert "train.lr" in keys or "decoding.sampling.top_p" in keys
    for key in keys:
        cfg = json.loads(json.dumps(plain))
        *parents, last = key.split(".")
        node = cfg
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        node[int(last) if isinstance(node, list) else last] = math.nan
        with pytest.raises(ConfigError, match=rf"{key}=nan is not a finite number"):
            check_train(cfg) if entry == "train.py" else check_eval(cfg, "tree")


@pytest.mark.parametrize("key,value,phrase", [
    ("sampling.temperature", math.nan, "decoding.sampling.temperature=nan is not a finite number"),
    ("sampling.temperature", math.inf, "decoding.sampling.temperature=inf is not a finite number"),
    ("sampling.top_p", math.nan, "decoding.sampling.top_p=nan is not a finite number"),
    ("sampling.top_k", -5, "decoding.sampling.top_k=-5 must be at least 0 (0: off)"),
    ("total_tokens", 1, "decoding.total_tokens=1 must be at least 2 (the root plus at least one drafted token)"),
    ("top_k", 2049, "decoding.top_k=2049 is more than the target's 2048 tokens"),
    ("depth", -1, "decoding.depth=-1 must be at least 0"),
    ("variants", ["M", "X"], "decoding.variants=['M', 'X']: give distinct entries"),
])
def test_decoding_settings_are_checked_against_their_real_bounds(key, value, phrase):
    cfg = {"target": {"name_or_path": TINY}, "decoding": {"method": "tree", **nested(key, value)}}
    with pytest.raises(ConfigError) as e:
        check_eval(cfg, "tree")
    assert phrase in str(e.value)


def test_top_k_up_to_the_vocabulary_and_depth_0_pass():
    """The bounds are inclusive: top_k equal to the vocabulary and depth 0 pass, one more token does not."""
    cfg = {"target": {"name_or_path": TINY}, "decoding": {"method": "tree", "top_k": 2048, "depth": 0}, "draft": TINY}
    assert check_eval(cfg, "ar") is None and check_eval(cfg, "tree") is None  # tree: checked against the vocabulary
    with pytest.raises(ConfigError, match="decoding.top_k=2049 is more than the target's 2048 tokens"):
        check_eval({**cfg, "decoding": {**cfg["decoding"], "top_k": 2049}}, "tree")


def test_the_decoders_take_their_bounds_from_the_same_checks():
    """DecodeConfig and SamplingParams (library users) refuse what eval.py refuses, in its words."""
    from msd_train.decoding import DecodeConfig, SamplingParams

    with pytest.raises(ConfigError, match="decoding.total_tokens=1 must be at least 2"):
        DecodeConfig(method="tree", total_tokens=1)
    with pytest.raises(ConfigError, match="decoding.sampling.temperature=nan is not a finite number"):
        SamplingParams(temperature=math.nan)
    with pytest.raises(ConfigError, match="decoding.sampling.top_k=-5 must be at least 0"):
        SamplingParams(temperature=0.7, top_k=-5)


def test_cuda_graphs_on_a_cpu_target_is_refused_up_front():
    cfg = {"target": {"name_or_path": TINY, "device": "cpu"}, "decoding": {"method": "tree", "cuda_graphs": True}}
    with pytest.raises(ConfigError, match="decoding.cuda_graphs=true needs a CUDA target"):
        check_eval(cfg, "ar")


@pytest.mark.parametrize("script, args, phrase", [
    ("scripts/push_to_hub.py", ["checkpoint=x", "repo_id=me/bad name", "dry_run=true"], "is not a Hub repository id"),
    ("scripts/export.py", [], "missing required argument(s): checkpoint=... out=..."),
    ("scripts/import_reference.py", [], "missing required argument(s)"),
])
def test_hub_scripts_refuse_their_arguments_before_torch_loads(script, args, phrase):
    """The hub scripts check their arguments with msd_train.hub_cli, outside the hub package
    (which loads torch and transformers): a typo costs a fraction of a second, not five."""
    out = subprocess.run([sys.executable, "-X", "importtime", str(ROOT / script), *args], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=300)
    imported = set(re.findall(r"^import time:.*\|\s*(\S+)$", out.stderr, re.M))
    assert "msd_train.hub_cli" in imported  # the import report is read: the check below can fail
    assert not imported & {"torch", "transformers", "msd_train.hub"}, sorted(imported & {"torch", "transformers"})
    out.stderr = "\n".join(x for x in out.stderr.splitlines() if not x.startswith("import time:"))
    refused(out, phrase)


def test_train_py_refuses_nan_before_anything_loads(tmp_path):
    out, seconds = run("train.py", f"run_dir={tmp_path}", "train.lr=nan")
    refused(out, "train.lr=nan is not a finite number")
    assert seconds < 30, seconds  # the check runs before torch and the training stack are imported
    assert not (tmp_path / "stage1").exists()


def test_a_kind_of_training_the_head_has_not_is_refused_before_anything_is_read(tmp_path):
    """A stage 3 (on-policy) launched for a dflash head: it trains supervised only. Refused naming the
    fix before the run folder, the target or the head it would start from is touched."""
    out, _ = run("train.py", "head=dflash", "stage=3", f"stage.init_from={tmp_path / 'nowhere'}", f"run_dir={tmp_path}")
    refused(out, "train.objective=on_policy: dflash heads have no on_policy objective",
            "use train.objective=supervised", "head=msd or head=msd3")
    assert not (tmp_path / "stage3").exists()


def test_an_unknown_head_architecture_names_the_heads(tmp_path):
    out, _ = run("train.py", "draft.architecture=dflsh", f"run_dir={tmp_path}")
    refused(out, "draft.architecture=dflsh is no head architecture; use head=dflash or head=msd or head=msd3")
    assert not (tmp_path / "stage1").exists()


def test_a_train_vocabulary_for_a_head_with_its_own_draft_vocabulary_is_refused_before_anything_is_read(tmp_path):
    """An experiment's draft.train_vocab (smollm2_llava sets one) given to an msd3 head, which trains
    over its own draft vocabulary: refused naming the override that clears it, nothing made."""
    out, _ = run("train.py", "head=msd3", "+draft.train_vocab=64", f"run_dir={tmp_path}")
    refused(out, "draft.train_vocab=64: an msd3 head trains over its own draft vocabulary (draft.draft_vocab_size)",
            "draft.train_vocab=null where an experiment sets it")
    assert not (tmp_path / "stage1").exists()


def test_a_run_dir_under_a_file_is_one_message(tmp_path):
    # Hydra makes its output folder under run_dir before any of the run's own checks
    (tmp_path / "blocker").write_text("a file, not a folder")
    out, _ = run("train.py", f"run_dir={tmp_path}/blocker/run")
    refused(out, f"run_dir={tmp_path}/blocker/run", f"{tmp_path}/blocker is a file", "choose another run_dir=")


@pytest.mark.slow
@pytest.mark.parametrize("override,phrase", [
    ("decoding.sampling.temperature=nan", "decoding.sampling.temperature=nan is not a finite number"),
    ("decoding.top_k=100000", "decoding.top_k=100000 is more than the target's 2048 tokens"),
])
def test_eval_py_refuses_impossible_decoding_settings(tmp_path, override, phrase):
    out, _ = run("eval.py", f"out={tmp_path / 'out'}", override, timeout=120)  # top_k: hung before
    refused(out, phrase)
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- 4: benchmark files

BENCH_CASES = {
    "empty": ("", "no records (an empty file)"),
    "not an object": ('"what is this?"\n', "record 1: not a JSON object (str)"),
    "empty turns": (json.dumps({"id": "q1", "turns": []}) + "\n", "record 1 (sample q1): 'turns' is []"),
    "non-string turns": (json.dumps({"id": "q1", "turns": [3]}) + "\n", "'turns' is [3]; give a non-empty list"),
    "markers": (json.dumps({"id": "q1", "image": "a.png", "turns": ["<image> <image> what?"]}) + "\n",
                "record 1 (sample q1): 2 <image> markers in the turns but 1 images; give one <image> marker per image"),
    "broken line": (json.dumps({"id": "q1", "turns": ["hi"]}) + '\n{"id": "q2", "turns": ["hi"\n',
                    "line 2: not valid JSON"),
}


@pytest.mark.parametrize("case", sorted(BENCH_CASES))
def test_bad_benchmark_files_name_file_record_and_fix(tmp_path, case):
    from msd_train.evaluation import load_bench

    text, phrase = BENCH_CASES[case]
    path = tmp_path / "bench.jsonl"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:  # what eval.py prints as one paragraph
        load_bench({"kind": "jsonl", "path": str(path)})
    assert str(path) in str(e.value) and phrase in str(e.value)


def test_bad_conversation_benchmark_is_a_message(tmp_path):
    from msd_train.evaluation import load_bench

    path = tmp_path / "conv.json"
    path.write_text(json.dumps([{"id": "a", "conversations": [{"from": "human", "value": "hi"},
                                                                 {"from": "gpt", "value": "yo"}]}, 7]))
    with pytest.raises(ConfigError, match=r"conv.json, sample #1: record is not a JSON object"):
        load_bench({"kind": "conversations", "sources": [{"path": str(path)}]})
    path.write_text("")
    with pytest.raises(ConfigError, match=r"conv.json: no records"):
        load_bench({"kind": "conversations", "sources": [{"path": str(path)}]})


@pytest.mark.slow
def test_eval_py_prints_a_bad_benchmark_record_as_one_paragraph(tmp_path):
    path = tmp_path / "bench.jsonl"
    path.write_text(json.dumps({"id": "q1", "turns": "hi"}) + "\n" + '"just a string"\n')
    out, _ = run("eval.py", "decoding=ar", "bench=jsonl", f"bench.path={path}", f"out={tmp_path / 'out'}")
    refused(out, f"{path}, record 2: not a JSON object")


# ----------------------------------------------------------------------------- 4: hub scripts


@pytest.mark.slow
def test_import_reference_speaks_in_messages(tmp_path):
    out, _ = run("scripts/import_reference.py", f"out={tmp_path / 'x'}")
    refused(out, "import_reference: missing required argument(s): src=...")
    src = tmp_path / "released"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llava", "hidden_size": 8}))
    (src / "pytorch_model.bin").write_bytes(pickle.dumps({"fc.weight": os.system}, protocol=2))
    out, _ = run("scripts/import_reference.py", f"src={src}", f"out={tmp_path / 'x'}")
    refused(out, "pytorch_model.bin: holds objects other than tensors and plain values", "posix.system",
            "it was not loaded", "Convert the weights to safetensors")
    assert not (tmp_path / "x").exists()


@pytest.fixture(scope="module")
def tiny_head(tmp_path_factory) -> Path:
    from transformers import AutoConfig

    from msd_train.draft import MSDDraftConfig, MSDDraftModel

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("head")
    MSDDraftModel(MSDDraftConfig.from_target_config(AutoConfig.from_pretrained(TINY), TINY)).save_pretrained(out)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("env,phrase", [
    ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set: unset it to push"),
    ({"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}, "The Hub at http://127.0.0.1:9 could not be reached"),
])
def test_push_without_network_is_one_message(tiny_head, env, phrase):
    token = "hf_NeverPrintThisToken0123456789"
    out, _ = run("scripts/push_to_hub.py", f"checkpoint={tiny_head}", "repo_id=me/msd-tiny",
                 env={**ENV, "HF_TOKEN": token, **env})
    error = refused(out, "push to me/msd-tiny failed", phrase)
    assert token not in out.stdout + out.stderr, error


# ----------------------------------------------------------------------------- 5: non-finite heads


@pytest.mark.slow
def test_a_nan_export_is_refused_naming_the_tensor(tiny_head, tmp_path):
    from safetensors.torch import load_file, save_file

    from msd_train.hub import IncompleteHeadError, load_head

    bad = tmp_path / "nan-head"
    bad.mkdir()
    (bad / "config.json").write_text((tiny_head / "config.json").read_text())
    state = load_file(tiny_head / "model.safetensors")
    state["fc.weight"][0, 0] = math.nan
    save_file(state, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(IncompleteHeadError, match=r"not finite \(NaN or inf in fc.weight \(1 of \d+\)\)"):
        load_head(str(bad))
    out, _ = run("eval.py", f"draft={bad}", "decoding=chain", "bench.max_per_category=1", f"out={tmp_path / 'o'}")
    refused(out, f"{bad}: the head's weights are not finite (NaN or inf in fc.weight")


def test_a_nan_released_head_is_not_imported(tmp_path):

    from msd_train.hub import IncompleteHeadError, import_reference

    nan = torch.full((64, 32), math.nan)
    released_head(tmp_path / "released", "llava", "bin", extra={"layers.0.mlp.gate_proj.weight": nan})
    with pytest.raises(IncompleteHeadError, match=r"pytorch_model.bin: .*layers.0.mlp.gate_proj.weight \(2048 of 2048\)"):
        import_reference(tmp_path / "released", tmp_path / "ours")
    assert not (tmp_path / "ours").exists()


# ----------------------------------------------------------------------------- 6: paths


def test_tilde_paths_are_read_where_they_are_checked(tmp_path, monkeypatch):
    """``~`` in a data path passes the up-front check and is what the reader opens."""
    from msd_train.data.formats import read_conversations
    from msd_train.evaluation import load_bench

    monkeypatch.setenv("HOME", str(tmp_path))
    data = json.loads((ROOT / "data/tiny/sharegpt_heldout.json").read_text())[:3]
    (tmp_path / "d.json").write_text(json.dumps(data))
    check_train({"data": {"text": [{"path": "~/d.json"}]}, "stage": {"splits": ["text"]}})
    assert len([c for c in read_conversations("~/d.json") if isinstance(c, dict)]) == 3
    (tmp_path / "b.jsonl").write_text(json.dumps({"id": "q", "turns": ["hi"]}) + "\n")
    assert [i.id for i in load_bench({"kind": "jsonl", "path": "~/b.jsonl"})] == ["q"]


@pytest.mark.slow
def test_check_data_reads_tilde_paths(tmp_path):
    """The training data readers, run as a user runs them, with HOME elsewhere."""
    for name, n in (("sharegpt_train.json", 6), ("sharegpt_heldout.json", 3)):
        data = json.loads((ROOT / "data/tiny" / name).read_text())[:n]
        (tmp_path / name).write_text(json.dumps(data))
    out, _ = run("scripts/check_data.py", "data.text.0.path='~/sharegpt_train.json'",
                 "data.heldout_text.0.path='~/sharegpt_heldout.json'", "splits=[text,heldout_text]",
                 env={**ENV, "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "ok: 6 usable samples in data.text" in out.stdout


@pytest.mark.slow
def test_train_py_runs_with_tilde_paths(tmp_path):
    """``~`` once passed the up-front check and failed in the reader. With HOME
    elsewhere, run_dir and the data files under ``~`` train and export there (no ./~ folder)."""
    for name, src, n in (("text.json", "sharegpt_train.json", 12), ("held.json", "sharegpt_heldout.json", 4)):
        (tmp_path / name).write_text(json.dumps(json.loads((ROOT / "data/tiny" / src).read_text())[:n]))
    from msd_train.training.build_locks import extensions_root

    # torch keeps its built extensions under ~/.cache: named where they are, so that DeepSpeed's
    # communication op is not compiled again under the new HOME (20 s of the test, and not its subject)
    env = {**ENV, "HOME": str(tmp_path), "TORCH_EXTENSIONS_DIR": str(extensions_root())}
    out, _ = run("train.py", "run_dir='~/run'", "data.text.0.path='~/text.json'", "data.heldout_text.0.path='~/held.json'",
                 "stage.splits=[text,heldout_text]", "train.max_steps=1", "eval.every=1000", "train.micro_batch_size=2",
                 "data.max_heldout=4", "logging.wandb.mode=disabled", "logging.progress=false",
                 env=env, timeout=900, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp_path / "run" / "stage1" / "final" / "model.safetensors").is_file()
    assert not (tmp_path / "~").exists()


def test_draft_vocab_size_is_bounded_by_the_targets_vocabulary():
    """An msd3 head's draft vocabulary is a subset of the target's: a larger one is refused up
    front (the target's config.json read, nothing loaded), naming the key and the range."""
    import json

    folder = ROOT / "data" / "tiny-llava"
    vocab = json.loads((folder / "config.json").read_text())["text_config"]["vocab_size"]
    cfg = {"target": {"name_or_path": str(folder)}, "draft": {"draft_vocab_size": vocab + 1}}
    with pytest.raises(ConfigError, match=rf"^draft\.draft_vocab_size={vocab + 1} must be at most {vocab} "
                                          rf"\(an msd3 head's draft vocabulary: between 1 and the target's {vocab} tokens\)"):
        check_train(cfg)
    cfg["draft"]["draft_vocab_size"] = vocab  # the whole vocabulary: allowed
    check_train(cfg)
