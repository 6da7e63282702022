"""Head folders: where they come from (local or Hub), which layout they are in, and
loading an export folder strictly (a missing tensor is an error, never a random init)."""

from __future__ import annotations

import json
from pathlib import Path

from msd_train.draft import MSDDraftModel, NonFiniteWeightsError
from msd_train.hub import formats
from msd_train.paths import is_repo_id
from msd_train.targets import ADAPTERS

#: model_type of the released heads' config.json -> draft layer family (from the target adapters)
REFERENCE_MODEL_TYPES = {c.reference_model_type: c.draft_layer_family for c in ADAPTERS if c.reference_model_type}
#: weight files of the released layout, in order of preference (never unpickled unsafely)
REFERENCE_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
#: what a head repository needs; anything else in it (images, logs) is not downloaded
HEAD_FILE_PATTERNS = ["*.json", "*.safetensors", "*.bin", "README.md"]


class IncompleteHeadError(ValueError):
    """A head folder that cannot be used: missing config or weights, or weights that do
    not load into the head its config describes."""


def resolve_folder(path_or_repo_id: str | Path, revision: str | None = None) -> Path:
    """A local folder as is; otherwise a Hub repo id, downloaded (head files only)."""
    path = Path(path_or_repo_id).expanduser()
    if path.exists():
        if not path.is_dir():
            raise IncompleteHeadError(f"{path}: a head is a folder (config.json + weights), not a file")
        return path
    name = str(path_or_repo_id)
    if not is_repo_id(name):
        raise FileNotFoundError(f"{name}: no such folder, and not a Hub repo id of the form user/name")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, revision=revision, allow_patterns=HEAD_FILE_PATTERNS))
    except Exception as err:  # offline, gated, missing repo: say which and why
        raise FileNotFoundError(
            f"{name}: not a local folder, and downloading it from the Hugging Face Hub failed "
            f"({type(err).__name__}: {err})"
        ) from err


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise IncompleteHeadError(f"{folder}: no config.json; this is not a head folder")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise IncompleteHeadError(f"{path}: not valid JSON ({err})") from err


def detect_layout(folder: Path) -> str:
    """The name of the head format (``msd_train.hub.formats``) a folder is in: 'msd' for
    this project's export folders (every head architecture), 'reference' for the released
    MSD layout, 'eagle3' for the EAGLE-3 layout, ..."""
    config = read_config(folder)
    fmt = formats.detect(config)
    if fmt is None:
        known = "; ".join(f"{f.name}: {f.describe}" for f in formats.FORMATS.values())
        raise IncompleteHeadError(f"{folder}/config.json (model_type {config.get('model_type')!r}) is in none of "
                                  f"the head formats this project reads ({known})")
    return fmt.name


def export_weight_files(folder: Path) -> list[Path]:
    """The weight files of an export folder (one safetensors file, or an index and its shards)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise IncompleteHeadError(f"{folder}: shards listed in {index.name} are missing: {', '.join(missing)}")
        return [index] + [folder / s for s in shards]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise IncompleteHeadError(
        f"{folder}: no weights (model.safetensors); a head export is config.json + model.safetensors, "
        f"as written to RUN_DIR/stageN/final by train.py or by scripts/export.py"
    )


def load_export(folder: str | Path, **from_pretrained_kwargs) -> MSDDraftModel:
    """`MSDDraftModel.from_pretrained(folder)`, refusing anything but a complete head."""
    folder = Path(folder)
    layout = detect_layout(folder)
    if layout != "msd":
        raise IncompleteHeadError(f"{folder} is a head in the {layout} format, not this project's export folder; "
                                  f"load it with msd_train.hub.load_head, or convert it with "
                                  f"scripts/export.py checkpoint={folder} format=msd out=...")
    export_weight_files(folder)
    try:
        model, info = MSDDraftModel.from_pretrained(folder, output_loading_info=True, **from_pretrained_kwargs)
    except NonFiniteWeightsError as err:
        raise IncompleteHeadError(str(err)) from err
    except Exception as err:
        raise IncompleteHeadError(f"{folder}: the weights do not load ({type(err).__name__}: {err})") from err
    problems = {k: list(v) for k, v in info.items() if k in ("missing_keys", "mismatched_keys", "unexpected_keys") and v}
    if problems:
        detail = "; ".join(f"{k}: {', '.join(map(str, v[:6]))}{' ...' if len(v) > 6 else ''}" for k, v in problems.items())
        raise IncompleteHeadError(f"{folder}: the weights do not match config.json ({detail})")
    return model.eval()
