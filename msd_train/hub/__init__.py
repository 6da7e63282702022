"""Shipping heads: import of released MSD heads, export (ours or the released layout),
`load_head` for every way a head arrives, and publishing to the Hugging Face Hub.

Needs only torch, transformers, safetensors and huggingface_hub (no hydra, deepspeed),
so evaluation boxes can load heads with it.
"""

from msd_train.hub.folders import IncompleteHeadError, detect_layout, load_export, resolve_folder
from msd_train.hub.load import load_head
from msd_train.hub.push import PushError, plan_push, push_head
from msd_train.hub.reference import (
    ImportReport,
    TargetInfo,
    convert_reference,
    export_msd,
    export_reference,
    import_reference,
    read_reference,
)
from msd_train.hub.vocab import VocabMap, check_embedding

__all__ = [
    "ImportReport",
    "IncompleteHeadError",
    "PushError",
    "TargetInfo",
    "VocabMap",
    "check_embedding",
    "convert_reference",
    "detect_layout",
    "export_msd",
    "export_reference",
    "import_reference",
    "load_export",
    "load_head",
    "plan_push",
    "push_head",
    "read_reference",
    "resolve_folder",
]
