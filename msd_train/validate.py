"""Config checks run once, up front, before any model or dataset loads: the entry points'.

The bounds themselves (the primitives and the decoder's settings) live below the decoder,
in ``msd_train.checks``; this module adds what needs the hub or the file system (targets,
heads, data files, output folders) and sits above them.

Every entry point (``train.py``, ``eval.py``, ``scripts/generate_features.py``,
``scripts/push_to_hub.py``) calls its ``check_*`` on the plain config and runs under
:func:`user_errors`, which prints a user's mistake as one paragraph and exits non-zero.
Tracebacks stay available: ``MSD_DEBUG=1`` re-raises instead.

Light on purpose (no torch, no omegaconf at import): the evaluation and hub side import it
on machines without the training stack.
"""

from __future__ import annotations

import netrc
import os
import re
import sys
import tempfile
from pathlib import Path

from msd_train.checks import (  # noqa: F401  (the primitives, and the decoder's bounds, re-exported)
    _MISSING,
    CUDA_GRAPHS,
    ENSEMBLES,
    METHODS,
    RANK_BY,
    VARIANTS,
    _bool,
    _choice,
    _get,
    _number,
    check_cpu_linear,
    check_decoding,
    check_sampling,
    onednn_max_isa,
)
from msd_train.errors import ConfigError, debug, user_errors  # noqa: F401  (re-exported: callers import them from here)
from msd_train.formatting import with_article
from msd_train.paths import experiments, is_repo_id, user_path


def _sources(cfg, group: str, need_images: bool) -> None:
    """Each data source's file exists and is a file; an image_root is a folder."""
    sources = _get(cfg, f"data.{group}")
    for i, src in enumerate([] if sources is _MISSING or not sources else sources):
        path = src.get("path") if hasattr(src, "get") else None
        key = f"data.{group}.{i}.path"
        if not path:
            raise ConfigError(f"{key} is empty; give the data file's path")
        p = user_path(str(path))
        if p.is_dir():
            raise ConfigError(f"{key}={p} is a folder; give the JSON / JSONL file inside it")
        if not p.is_file():
            raise ConfigError(f"{key}={p}: no such file")
        root = src.get("image_root")
        if need_images and root and not user_path(str(root)).is_dir():
            raise ConfigError(f"data.{group}.{i}.image_root={root}: no such folder (the image paths of "
                              f"{p.name} are relative to it)")


def _wandb(cfg, key: str) -> None:
    """``mode=online`` needs a key; without one wandb would stop the run to ask for it."""
    mode = _get(cfg, f"{key}.mode")
    _choice(cfg, f"{key}.mode", ("online", "offline", "disabled"))
    if mode != "online" or os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE") in ("offline", "disabled"):
        return
    host = re.sub(r"^https?://", "", os.environ.get("WANDB_BASE_URL", "api.wandb.ai")).split("/")[0]
    try:
        if netrc.netrc(os.environ.get("NETRC")).authenticators(host):
            return
    except (OSError, netrc.NetrcParseError):
        pass
    raise ConfigError(f"{key}.mode=online but no wandb API key is set (WANDB_API_KEY, or `wandb login`); "
                      f"log in, or use {key}.mode=offline (sync later with `wandb sync`) or disabled")


def _recipe_command(cfg, script: str, *args: str) -> str:
    """The command that runs ``script`` for this launch's experiment (``conf/experiment/NAME.yaml``),
    with the work folder when it is not the experiment's own, then ``args``."""
    name, work = _get(cfg, "recipe.name"), _get(cfg, "recipe.work")
    parts = [script, f"experiment={name}"]
    if work not in (_MISSING, None) and str(work) != f"work/{name}":
        parts.append(f"recipe.work={work}")
    return " ".join([*parts, *args])


def check_experiment(cfg) -> None:
    """An experiment (``experiment=NAME``) launched on its own target, by every command that takes
    one; refused before anything is read or written."""
    name = _get(cfg, "recipe.name")
    if name in (_MISSING, None):
        return
    want, chosen = _get(cfg, "recipe.target"), _get(cfg, "recipe.target_chosen")
    if want not in (_MISSING, None) and chosen not in (_MISSING, None) and want != chosen:
        raise ConfigError(f"experiment={name} is the recipe for target={want}, but this launch says target={chosen}; "
                          f"drop target= (to use {want}), or pick the experiment of another target "
                          f"({', '.join(experiments())}), or point the target elsewhere with target.name_or_path=DIR")


def check_stage_order(cfg) -> None:
    """A stage of an experiment launched after the one it starts from (stage N-1 before stage N),
    refused before anything is read or written, naming the command that comes first."""
    name = _get(cfg, "recipe.name")
    if name in (_MISSING, None):
        return
    stage = _get(cfg, "stage.id")
    init, run_dir = _get(cfg, "stage.init_from"), _get(cfg, "run_dir")
    if isinstance(stage, int) and stage > 1 and init not in (_MISSING, None) and run_dir not in (_MISSING, None):
        earlier = user_path(str(run_dir)) / f"stage{stage - 1}" / "final"
        if user_path(str(init)) == earlier and not (earlier / "config.json").is_file():
            first = _recipe_command(cfg, "deepspeed train.py", f"stage={stage - 1}")
            raise ConfigError(f"stage {stage} of experiment={name} starts from stage {stage - 1}'s head ({earlier}), "
                              f"which does not exist yet; run `{first}` first (a stopped one resumes when launched again)")


#: the settings of a training launch that the feature store command takes too (its target, data and store)
_STORE_KEYS = ("target", "data", "features", "experiment", "recipe")


def _store_command(cfg, store: Path, overrides) -> str:
    """The ``scripts/generate_features.py`` command that makes the store this launch reads: the
    experiment's, with this launch's target, data and ``features.*`` overrides."""
    import shlex

    script = "python scripts/generate_features.py"
    experiment = _get(cfg, "recipe.name") not in (_MISSING, None)
    keep = []
    for o in overrides or ():
        key = o.split("=", 1)[0].lstrip("+~")
        if key.split(".")[0] not in _STORE_KEYS or key in ("features", "features.mode", "features.verify"):
            continue
        if experiment and (key in ("experiment", "recipe.work") or key.startswith("recipe.stages")):
            continue  # _recipe_command names them; the stages are training's
        keep.append(shlex.quote(o))
    if experiment:
        return _recipe_command(cfg, script, *keep)
    if not any(o.lstrip("'+~").startswith("features.path=") for o in keep):
        keep.insert(0, shlex.quote(f"features.path={store}"))
    return " ".join([script, *keep])


def check_store(cfg, overrides=None) -> None:
    """``features.mode=offline``: the feature store (``features.path``) exists and its generation
    finished, before anything is read or written; else the command that makes (or finishes) it.
    ``overrides``: the launch's command-line overrides, whose target and data the command repeats."""
    import json

    if _get(cfg, "features.mode") != "offline":
        return
    path = _get(cfg, "features.path")
    if path in (_MISSING, None, "", "???"):
        raise ConfigError("features.mode=offline trains from a feature store, and features.path is not set; give the "
                          "store's folder (features.path=DIR, made by `python scripts/generate_features.py "
                          "features.path=DIR` with the same target and data), or train without one: features=online")
    store = user_path(str(path))
    command = _store_command(cfg, store, overrides)
    manifest = store / "manifest.json"
    if not manifest.is_file():
        raise ConfigError(f"features.path={path}: no feature store there yet (no {manifest.name}); make it first: "
                          f"`{command}` (or train without one: features=online)")
    try:
        record = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"features.path={path}: its {manifest.name} cannot be read ({e}); run `{command}` again: it "
                          f"keeps the finished shards and rewrites {manifest.name}") from None
    if not isinstance(record, dict) or not record.get("complete"):
        shards = len(record.get("shards") or []) if isinstance(record, dict) else 0
        raise ConfigError(f"features.path={path}: the feature store is not finished ({shards} shards written); "
                          f"relaunch `{command}` to finish it (it keeps what is written)")


def _missing_head(cfg, key: str) -> str | None:
    """``key``'s value when it names a head the launch's experiment trains (``RUN_DIR/stageN/final``)
    and that head is not written yet: the message naming the stage's command; else None."""
    name, head, run_dir = _get(cfg, "recipe.name"), _get(cfg, key), _get(cfg, "run_dir")
    if any(v in (_MISSING, None) for v in (name, head, run_dir)):
        return None
    path = user_path(str(head))
    stage = re.fullmatch(r"stage(\d+)", path.parent.name)
    if (path / "config.json").is_file() or path.name != "final" or stage is None:
        return None
    if path.parent.parent.resolve() != user_path(str(run_dir)).resolve():
        return None
    return (f"{key}={head} is the head stage {stage[1]} of experiment={name} exports, and it does not exist yet; "
            f"train it first: `{_recipe_command(cfg, 'deepspeed train.py', f'stage={stage[1]}')}` (a stopped one "
            f"resumes when launched again)")


def check_recipe_head(cfg, key: str) -> None:
    """A step after training (eval.py's ``draft=``, export.py's ``checkpoint=``...) reads the head its
    experiment's training writes: refused before anything loads while that head does not exist,
    naming the training command."""
    message = _missing_head(cfg, key)
    if message:
        raise ConfigError(message)


def hub_experiment(cfg, script: str) -> dict | None:
    """``experiment=NAME`` of a hub script (export.py, push_to_hub.py): its ``checkpoint=`` and
    ``out=`` filled from the experiment (``hub_cli.experiment_defaults``), and refused while the
    head its recipe ends with is not trained yet, naming the command. Returns the experiment's
    ``recipe`` block (its ``target``...), or None without one."""
    from msd_train.hub_cli import experiment_defaults

    found = experiment_defaults(cfg, script)
    if found is None:
        return None
    check_recipe_head(found, "checkpoint")
    return found["recipe"]


def check_recipe_export(cfg, key: str, fmt: str, head_key: str | None = None) -> None:
    """``key`` names the experiment's export in format ``fmt`` (``recipe.exports``/FMT, what
    ``scripts/export.py experiment=NAME format=FMT`` writes): refused while it does not exist, naming
    the training command when the head it is made from (``head_key``) is missing too, else the export."""
    from msd_train.config import recipe_export

    name, value, exports = _get(cfg, "recipe.name"), _get(cfg, key), _get(cfg, "recipe.exports")
    if any(v in (_MISSING, None) for v in (name, value, exports)):
        return
    path = user_path(str(value))
    if (path / "config.json").is_file() or path.resolve() != user_path(recipe_export(exports, fmt)).resolve():
        return
    first = _missing_head(cfg, head_key) if head_key else None
    if first:
        raise ConfigError(f"{key}={value} is experiment={name}'s format={fmt} export, made from its trained "
                          f"head; {first}")
    raise ConfigError(f"{key}={value} is experiment={name}'s format={fmt} export, which does not exist yet; make it "
                      f"first: `{_recipe_command(cfg, 'python scripts/export.py', f'format={fmt}')}`")


# A DataLoader worker hands each batch to the trainer through a Unix socket that multiprocessing
# makes at TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX (torch's file-descriptor sharing, Linux's
# default). Linux caps a socket's path at 107 bytes; past it the worker's feeder thread fails and
# the trainer waits for its batch for ever.
_SOCKET_PATH_MAX = 107
_SOCKET_SUFFIX = len("/pymp-XXXXXXXX/listener-XXXXXXXX")


def check_worker_tmpdir(workers, tmpdir: str | None = None) -> None:
    """``train.loader_workers`` > 0 needs a temporary folder whose sockets Linux can name."""
    if not sys.platform.startswith("linux") or workers in (_MISSING, None) or int(workers) == 0:
        return
    tmpdir = tmpdir or tempfile.gettempdir()
    n = len(os.fsencode(tmpdir))
    if n + _SOCKET_SUFFIX > _SOCKET_PATH_MAX:
        raise ConfigError(
            f"the temporary folder {tmpdir} (TMPDIR) is {n} bytes long: train.loader_workers={workers} hand "
            f"batches to the trainer through sockets made under it, and Linux caps a socket's path at "
            f"{_SOCKET_PATH_MAX} bytes (the workers would fail and the launch wait for ever); point TMPDIR at a "
            f"folder of at most {_SOCKET_PATH_MAX - _SOCKET_SUFFIX} bytes (e.g. /tmp or a short node-local path), "
            f"or set train.loader_workers=0")


def check_train(cfg, overrides=None) -> None:
    """``train.py``'s config (a plain dict or DictConfig); ``overrides``: the launch's command-line
    overrides (Hydra's), which a refusal's fix repeats."""
    # a recipe's steps in order: its target, the feature store, then the stage before this one
    check_experiment(cfg)
    check_store(cfg, overrides)
    check_stage_order(cfg)
    for key in ("train.max_steps", "train.micro_batch_size", "train.grad_accum", "train.max_bad_steps",
                "eval.every", "eval.rollout", "eval.batch_size", "checkpoint.every", "data.max_length",
                "data.num_proc"):
        _number(cfg, key, int, lo=1)
    for key in ("train.warmup_steps", "checkpoint.keep", "stage.curriculum.ramp_steps", "train.loader_workers"):
        _number(cfg, key, int, lo=0)
    for key in ("train.prefetch", "logging.log_every", "features.samples_per_shard"):
        _number(cfg, key, int, lo=1)
    check_worker_tmpdir(_get(cfg, "train.loader_workers"))
    # 0 would silently mean "all" to the readers' limit
    _number(cfg, "data.max_heldout", int, lo=1, hint=" (held-out conversations per modality for validation)")
    _number(cfg, "data.max_train", int, lo=1, allow_none=True,
            hint=" (training conversations per modality, the first in file order; null: all)")
    _number(cfg, "seed", int, lo=0, hint=" (it seeds numpy and the data order, which take no negative seed)")
    _number(cfg, "train.lr", float, lo=0, lo_open=True)
    for key in ("train.weight_decay", "train.grad_clip", "train.w_feat", "train.w_tok", "train.noise_scale"):
        _number(cfg, key, float, lo=0)
    _number(cfg, "train.min_lr_ratio", float, lo=0, hi=1)
    _number(cfg, "dist.timeout_minutes", float, lo=0, lo_open=True)
    betas = _get(cfg, "train.betas")
    if betas is not _MISSING:
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise ConfigError(f"train.betas={betas!r}: give two numbers, e.g. train.betas=[0.9,0.95]")
        for j in range(2):
            _number(cfg, f"train.betas.{j}", float, lo=0, hi=0.999999)
    for key in ("stage.curriculum.start", "stage.curriculum.end"):
        _number(cfg, key, float, lo=0, hi=1, hint=" (a share of each global batch, within [0, 1])")
    _choice(cfg, "stage.curriculum.schedule", ("linear", "cosine", "step"))
    _choice(cfg, "train.noise", ("uniform", "gaussian", "none"))
    _choice(cfg, "train.objective", ("supervised", "on_policy"))
    _choice(cfg, "train.rollout_weight", ("reach", "uniform"))
    _number(cfg, "train.rollout_steps", int, lo=1, hint=" (steps of each anchor's chain in on-policy training)")
    if _get(cfg, "train.objective") == "on_policy" and not _get(cfg, "stage.init_from"):
        raise ConfigError("train.objective=on_policy refines a trained head on its own drafts, and stage.init_from "
                          "is null (a fresh head); set stage.init_from=DIR (an exported head), or run stage=3 after "
                          "stages 1 and 2 with the same run_dir (it reads RUN_DIR/stage2/final)")
    _choice(cfg, "train.precision", ("auto", "bf16", "fp32"))
    _choice(cfg, "data.on_bad_sample", ("skip", "error"))
    _choice(cfg, "features.mode", ("online", "offline"))
    _choice(cfg, "draft.visual_compression", ("none", "kmeans", "pool"))
    _number(cfg, "draft.visual_compression_tokens", int, lo=1, hint=" (visual slots an image keeps in the draft)")
    _number(cfg, "draft.train_vocab", int, lo=1, allow_none=True,
            hint=" (target tokens the token loss covers), or drop it for the whole vocabulary")
    _number(cfg, "draft.draft_vocab_size", int, lo=1, allow_none=True, hint=" (an msd3 head's draft vocabulary)")
    _vocabulary_bounds(cfg)
    _number(cfg, "train.bucket_window", int, lo=0, allow_none=True, hint=" (samples sorted by length together; 0: off)")
    _bool(cfg, "train.gradient_checkpointing")
    resume = _get(cfg, "resume")
    if resume is not _MISSING and str(resume).lower() not in ("auto", "true", "false", "0", "1", "yes", "no"):
        raise ConfigError(f"resume={resume!r}: use auto (continue from the newest checkpoint) or false (start over)")
    run_dir = _get(cfg, "run_dir")
    if run_dir not in (_MISSING, None, ""):
        from msd_train.outputs import holds_data

        data = holds_data(user_path(run_dir))  # the guard every writer takes (a run_dir is resumed in place)
        if data:
            raise ConfigError(f"run_dir={run_dir} is {data}: a training run never writes into another command's "
                              f"data; choose another run_dir (e.g. a new folder beside it)")
    from msd_train.config import SPLITS

    splits = _get(cfg, "stage.splits")  # what the stage's YAML says it reads (all four if unset)
    for g in SPLITS if splits is _MISSING or splits is None else splits:
        if g in SPLITS:
            _sources(cfg, g, need_images=g.endswith("multimodal"))
    _wandb(cfg, "logging.wandb")
    check_target(_get(cfg, "target"))


def target_vocab_size(name_or_path, trust_remote_code: bool = False) -> int | None:
    """The target's vocabulary size from its config.json (no weights loaded); None when
    the config cannot be read here (the target's loader then says why)."""
    if not name_or_path:
        return None
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(user_path(str(name_or_path))), trust_remote_code=trust_remote_code)
        return int(config.get_text_config().vocab_size)
    except Exception:  # a Hub id offline, a custom model without trust_remote_code, ...
        return None


def _vocabulary_bounds(cfg) -> None:
    """``draft.draft_vocab_size`` and ``draft.train_vocab`` are subsets of the target's
    vocabulary: at most its size, read from its config.json (nothing loaded) when given."""
    keys = {"draft.draft_vocab_size": "an msd3 head's draft vocabulary",
            "draft.train_vocab": "target tokens the token loss covers"}
    keys = {k: what for k, what in keys.items() if isinstance(_get(cfg, k), int) and not isinstance(_get(cfg, k), bool)}
    target = _get(cfg, "target.name_or_path")
    if not keys or target is _MISSING or not target or "${" in str(target):
        return
    vocab = target_vocab_size(target, _get(cfg, "target.trust_remote_code") is True)
    if vocab:
        for key, what in keys.items():
            _number(cfg, key, int, lo=1, hi=vocab, hint=f" ({what}: between 1 and the target's {vocab} tokens)")


# Target attention implementations that apply a dense 4-D mask exactly. Verification runs the
# whole draft tree in one target forward under a tree mask; flash-attention kernels take
# only causal/padding masks and would let each node see its siblings (wrong output).
EXACT_ATTENTION = ("auto", "sdpa", "eager")


def check_eval(cfg, method: str) -> None:
    """``eval.py``'s config: numbers, the target's attention, the decoding settings (a tree's
    top_k against the target's vocabulary, read from its config.json), the head, the output
    folder (writable, checked now rather than after all the decoding); with an experiment, its target
    and its head trained first."""
    check_experiment(cfg)
    if method != "ar":
        check_recipe_head(cfg, "draft")
    attn = _get(cfg, "target.attn_implementation")
    if attn is not _MISSING and attn is not None and attn not in EXACT_ATTENTION:
        raise ConfigError(
            f"target.attn_implementation={attn} ignores the tree attention mask that verification needs, so "
            f"speculative outputs would not match the target's own; evaluate with target.attn_implementation=auto "
            f"(the default: sdpa, eager for bf16 on a CPU), sdpa or eager")
    _number(cfg, "warmup", int, lo=0)
    _number(cfg, "seed", int, lo=0, hint=" (it seeds the sampling generators, which take no negative seed)")
    _number(cfg, "dist.timeout_minutes", float, lo=0, lo_open=True)
    _number(cfg, "threads", int, lo=1, allow_none=True)
    for key in ("bench.max_samples", "bench.max_turns", "bench.max_per_category"):
        _number(cfg, key, int, lo=1, allow_none=True, hint=" (leave it null for all)")
    _number(cfg, "bench.max_new_tokens", int, lo=1, allow_none=True, hint=" (null: use decoding.max_new_tokens)")
    decoding = _get(cfg, "decoding")
    decoding = {} if decoding is _MISSING or decoding is None else decoding
    check_decoding(decoding)  # in a blink; then once more with the vocabulary (transformers' import)
    target = _get(cfg, "target.name_or_path")
    draft_vocab = decoding.get("draft_vocab") if hasattr(decoding, "get") else None
    # a tree's top_k and any method's draft_vocab are bounded by the target's vocabulary
    if (method == "tree" or (draft_vocab is not None and method != "ar")) and target is not _MISSING:
        check_decoding(decoding, target_vocab_size(target, _get(cfg, "target.trust_remote_code") is True))
    if str(_get(cfg, "decoding.cuda_graphs")).lower() in ("true", "on"):
        device = _get(cfg, "target.device")
        device = "auto" if device is _MISSING or device is None else str(device)
        if device.startswith("cpu") or (device == "auto" and not _cuda_available()):
            raise ConfigError("decoding.cuda_graphs=true needs a CUDA target, this one runs on the CPU; use "
                              "decoding.cuda_graphs=auto (on for CUDA targets, off on CPU)")
    _wandb(cfg, "wandb")
    check_target(_get(cfg, "target"))
    linear = _get(cfg, "target.cpu_linear")
    check_cpu_linear(None if linear is _MISSING else linear)
    onednn_max_isa()
    if method != "ar":
        check_head(_get(cfg, "draft"), draft_vocab, method, decoding.get("ensemble") if hasattr(decoding, "get") else None)


#: how to make the folders of the named targets that are built, not downloaded
BUILDERS = {"smollm2-llava": "python -m lab.targets.make_smollm2_llava (data/README.md, \"SmolLM2-LLaVA\")",
            "tiny-llava": "python -m lab.targets.make_tiny_target"}


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or not is_repo_id(name)


def check_target(target) -> None:
    """``target.*`` before anything loads: a local folder exists and is whole (config.json
    that parses, its weight files and index shards), its family is the named target's
    (``target.model_type``), and a LoRA adapter exists. A Hub id is checked when downloaded."""
    if target is _MISSING or not hasattr(target, "get"):
        return
    name = target.get("name_or_path")
    if name is None or str(name) == "":
        raise ConfigError("target.name_or_path is empty; give a target folder or Hub id (conf/target/*.yaml)")
    if "${" in str(name):
        return  # not resolved (a check of the YAML as written)
    path = user_path(str(name))
    if not path.exists():
        if _looks_like_path(str(name)):
            build = BUILDERS.get(path.name)
            fix = (f"build it first: {build}" if build else
                   "give an existing folder (config.json + weights) or a Hub id OWNER/NAME")
            raise ConfigError(f"target.name_or_path={name}: no such folder; {fix}")
    else:
        _check_target_folder(path, target.get("model_type"))
    adapter = target.get("adapter")
    if adapter:
        a = user_path(str(adapter))
        if not a.exists() and _looks_like_path(str(adapter)):
            raise ConfigError(f"target.adapter={adapter}: no such folder (a peft LoRA folder with "
                              f"adapter_config.json); give its path, or target.adapter=null")
        if a.is_dir() and not (a / "adapter_config.json").is_file():
            raise ConfigError(f"target.adapter={adapter}: no adapter_config.json in it; a LoRA adapter is a peft "
                              f"folder (adapter_config.json + adapter_model.safetensors)")


def _check_target_folder(path: Path, model_type) -> None:
    import json

    where = f"target.name_or_path={path}"
    if not path.is_dir():
        raise ConfigError(f"{where} is a file; a target is a model folder (config.json + weights)")
    config_path = path / "config.json"
    if not config_path.is_file():
        build = BUILDERS.get(path.name)
        raise ConfigError(f"{where}: no config.json, so not a model folder (or one half-written); "
                          + (f"build it again: {build}" if build else "point at the folder holding config.json "
                             "and the weights, or download it again"))
    try:
        config = json.loads(config_path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{config_path}: not valid JSON ({e}); the folder is damaged or half-written: "
                          f"download or build it again") from e
    index = next((path / n for n in ("model.safetensors.index.json", "pytorch_model.bin.index.json")
                  if (path / n).is_file()), None)
    if index is not None:
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{index}: unreadable ({e}); the folder is half-written: download it again") from e
        missing = [sh for sh in shards if not (path / sh).is_file()]
        if missing:
            raise ConfigError(f"{where}: {index.name} lists weight files that are missing ({', '.join(missing[:4])}"
                              f"{' ...' if len(missing) > 4 else ''}); the download or build was cut short: "
                              f"download or build it again")
    elif not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise ConfigError(f"{where}: no weights (model.safetensors or pytorch_model.bin); the folder is half-written: "
                          f"download or build it again")
    build = BUILDERS.get(path.name)
    for f in [path / sh for sh in shards] if index is not None else sorted(path.glob("*.safetensors")):
        cut = _cut_safetensors(f) if f.suffix == ".safetensors" else None
        if cut:
            raise ConfigError(f"{f}: cut short ({cut}); the download or build was interrupted: "
                              + (f"build it again: {build}" if build else "download it again (or copy it whole)"))
    if model_type and isinstance(config, dict) and config.get("model_type") != model_type:
        raise ConfigError(
            f"{where} holds a {config.get('model_type')!r} model, but the named target expects {model_type!r} "
            f"(target.model_type; its chat template and settings are for that family); choose the target that "
            f"matches the folder (conf/target/*.yaml), or set target.model_type=null to use the folder as it is")


def _cut_safetensors(f: Path) -> str | None:
    """Why a safetensors file is cut short (it holds fewer bytes than its header describes), or
    None; read from the header alone (no tensor, no torch)."""
    import json
    import struct

    size = f.stat().st_size
    try:
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            if 8 + n > size:
                return f"{size} bytes, shorter than its own header"
            header = json.loads(fh.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, struct.error, UnicodeDecodeError):
        return "its header cannot be read"
    return f"{size} bytes, its header describes {8 + n + end}" if 8 + n + end > size else None


def _cuda_available() -> bool:
    import torch  # only when CUDA graphs are asked for

    return torch.cuda.is_available()


def check_head(draft, draft_vocab=None, method: str | None = None, ensemble: str | None = None) -> None:
    """``draft=`` names a head (an export or a released MSD head), checked before the target
    loads; ``draft_vocab`` (``decoding.draft_vocab``) only with a head that takes it;
    ``method`` (``decoding.method``, with ``decoding.ensemble``) only when the head's drafter
    honours it (``DraftHead.decoding_methods``: a dflash head drafts blocks, not trees)."""
    if draft is None or draft is _MISSING or str(draft) == "":
        raise ConfigError("decoding=tree|chain needs a head: draft=PATH (an export folder, e.g. "
                          "runs/tiny/stage2/final, a released MSD head or a Hub repo id)")
    path = user_path(str(draft))
    if not path.exists():
        if str(draft).count("/") != 1 or str(draft).startswith((".", "/", "~")):
            raise ConfigError(
                f"draft={draft}: no such folder (nor a Hub repo id OWNER/NAME). Train the embedded default with "
                "`python train.py stage=1` then `python train.py stage=2`, or pass draft=PATH to an export folder")
        return  # a Hub id: resolved (and checked) when downloaded
    from msd_train.hub.folders import IncompleteHeadError, detect_layout

    if not path.is_dir():
        raise ConfigError(f"draft={draft} is a file; a head is a folder (config.json + model.safetensors)")
    try:
        layout = detect_layout(path)
    except IncompleteHeadError as e:
        raise ConfigError(f"draft={draft} is not a draft head: {e}") from e
    if method is not None and method != "ar":
        import msd_train.draft  # noqa: F401  (registers the heads)
        from msd_train.checks import method_refusal
        from msd_train.draft.head import head_class_of_config
        from msd_train.hub.folders import read_config

        head = head_class_of_config(read_config(path).get("model_type", "")) if layout == "msd" else None
        methods = head.decoding_methods if head is not None else ("tree", "chain")  # other layouts: stepped heads
        why = method_refusal(head.architecture if head is not None else layout, methods, method, ensemble)
        if why is not None:
            raise ConfigError(f"draft={draft}: {why}")
    if draft_vocab is not None:
        import msd_train.draft  # noqa: F401  (registers the heads)
        from msd_train.draft.head import head_class_of_config
        from msd_train.hub.folders import read_config

        config = read_config(path)
        head = head_class_of_config(config.get("model_type", ""))
        if layout == "eagle3" or (head is not None and head.has_draft_vocabulary):
            kind = head.architecture if head is not None else "msd3"  # an EAGLE-3 folder imports as msd3
            raise ConfigError(f"decoding.draft_vocab={draft_vocab}: draft={draft} is {with_article(kind)} head, which drafts over "
                              f"the {config.get('draft_vocab_size')}-token vocabulary it was trained with "
                              f"(draft.draft_vocab_size at training); decoding.draft_vocab is for msd heads: drop it")


def check_serve(cfg) -> None:
    """``scripts/serve_check.py``'s heads, before vLLM is asked for: ``draft=`` given; with an
    experiment, its target, and its head trained and exported first (naming the command)."""
    check_experiment(cfg)
    check_recipe_export(cfg, "draft", "vllm", head_key="original")
    check_recipe_head(cfg, "original")
    if _get(cfg, "draft") in (_MISSING, None, "", "???"):
        raise ConfigError("draft is not set; give draft=DIR, a head exported with `python scripts/export.py "
                          "checkpoint=HEAD format=vllm out=DIR`, or experiment=NAME (its recipe's export)")


def check_out_dir(out: str | Path) -> None:
    """The output folder can be created and written, before anything is measured."""
    from msd_train.outputs import folder_path

    out = folder_path(user_path(out))
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out={out} is a file; give a folder for the report")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"out={out} cannot be written ({e.strerror or e}); choose a folder you can write to") from e


def check_generate(cfg) -> None:
    """``scripts/generate_features.py``'s config."""
    check_experiment(cfg)
    _number(cfg, "batch_size", int, lo=1)
    _number(cfg, "features.samples_per_shard", int, lo=1)
    _number(cfg, "dist.timeout_minutes", float, lo=0, lo_open=True)
    _number(cfg, "data.max_length", int, lo=1)
    _number(cfg, "data.max_heldout", int, lo=1)
    _number(cfg, "data.max_train", int, lo=1, allow_none=True)
    _choice(cfg, "data.on_bad_sample", ("skip", "error"))
    if not _get(cfg, "features.path") or _get(cfg, "features.path") is _MISSING:
        raise ConfigError("features.path is not set; give the folder to write the store into: features.path=DIR")
    from msd_train.outputs import check_output, feature_store

    check_target(_get(cfg, "target"))  # a missing, half-written or cut target: before it loads
    # the guard every writer takes; a store (even a damaged one, or one begun) is resumed
    check_output(user_path(_get(cfg, "features.path")), "scripts/generate_features.py", None, setting="features.path",
                 recognise=lambda p: feature_store(p) or (p / "manifest.json").exists() or (p / "progress").is_dir())
    from msd_train.config import SPLITS

    for split in _get(cfg, "splits") or []:
        if split not in SPLITS:
            raise ConfigError(f"splits: unknown {split!r}; choose from {', '.join(SPLITS)}")
        _sources(cfg, split, need_images=split.endswith("multimodal"))
