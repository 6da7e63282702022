"""This project's own export folder (format ``msd``): config.json with model_type
``msd_draft`` / ``msd3_draft`` and model.safetensors, as `save_pretrained` writes it and
`MSDDraftModel.from_pretrained` (``hub.folders.load_export``) reads it."""

from __future__ import annotations

import json
from pathlib import Path

from msd_train.draft.head import HEADS, DraftHead, head_class_of_config
from msd_train.draft.vocabulary import COUNTS_FILE, load_counts, save_counts
from msd_train.hub.folders import detect_layout, load_export, resolve_folder
from msd_train.hub.formats import FORMATS, HeadFormat
from msd_train.hub.reference import IMPORT_RECORD, convert_reference, read_reference, source_name
from msd_train.hub.target import TargetInfo, cast_head
from msd_train.runtime import atomic_dir
from msd_train.targets import resolve_dtype
from msd_train.targets.protocol import TargetProtocol


def export_msd(checkpoint, out: str | Path, target: TargetInfo | None = None, dtype: str | None = None) -> dict:
    """Write this project's export folder from a head, or from a folder (or Hub id) in
    any format that loads (a released-layout folder is imported, with its record),
    optionally cast to `dtype` (fp16/bf16/fp32): training exports are fp32."""
    extra, counts = {}, None
    if isinstance(checkpoint, DraftHead):
        model = checkpoint
        counts = getattr(model, "token_counts", None)
    else:
        folder = resolve_folder(checkpoint)
        layout = detect_layout(folder)
        if layout == "reference":
            ref = read_reference(folder)
            model, report = convert_reference(ref, target, source=source_name(checkpoint))
            extra[IMPORT_RECORD] = json.dumps(report.record(ref.config), indent=1)
        elif layout == "msd":
            model = load_export(folder)
            for name in ("training.json", IMPORT_RECORD):
                if (folder / name).is_file():
                    extra[name] = (folder / name).read_text()
            counts = load_counts(folder)
        else:
            model = _load_other(layout, folder, checkpoint)
    if target is not None:
        target.refuse_misfit(model.config, "the head" if isinstance(checkpoint, DraftHead) else checkpoint)
    if dtype:
        model = cast_head(model, dtype=resolve_dtype(dtype, "cpu"))

    def write(tmp: Path):
        model.save_pretrained(tmp)
        for name, text in extra.items():
            (tmp / name).write_text(text)
        if counts is not None:
            save_counts(tmp, counts)

    atomic_dir(Path(out), write)
    files = ["config.json", "model.safetensors", *extra] + ([COUNTS_FILE] if counts is not None else [])
    return {"out": str(out), "files": sorted(files), "dtype": str(model.dtype)}


def _load_other(layout: str, folder: Path, checkpoint):
    fmt = FORMATS[layout]
    if fmt.load is None:
        raise ValueError(f"{checkpoint}: a folder in the {layout} format is written for other engines and does "
                         f"not load back; export from the head it was written from")
    return fmt.load(folder, source=str(checkpoint))


def is_export(config: dict) -> bool:
    return head_class_of_config(config.get("model_type")) is not None


def load_msd(folder: Path, target: TargetProtocol | None = None, source=None) -> DraftHead:
    return load_export(folder)


FORMAT = HeadFormat(
    name="msd", heads=None, write=export_msd, detect=is_export, options=("target", "dtype"), load=load_msd,
    describe="this project's export folder, model_type "
             + " or ".join(repr(cls.config_class.model_type) for cls in HEADS.values()),
)
