"""Shipping heads: import of released MSD heads, export to every head format (ours, the
released layout, EAGLE-3's), `load_head` for every way a head arrives, and publishing to
the Hugging Face Hub.

Needs only torch, transformers, safetensors and huggingface_hub (no hydra, deepspeed),
so evaluation boxes can load heads with it.
"""

from msd_train.hub import eagle3, ours, reference, vllm
from msd_train.hub.folders import IncompleteHeadError, detect_layout, load_export, resolve_folder
from msd_train.hub.formats import HeadFormat, register
from msd_train.hub.load import load_head
from msd_train.hub.ours import export_msd
from msd_train.hub.push import PushError, plan_push, push_head
from msd_train.hub.reference import ImportReport, convert_reference, export_reference, import_reference, read_reference
from msd_train.hub.target import TargetInfo
from msd_train.hub.vocab import VocabMap, check_embedding

# The head formats (msd_train.hub.formats), in the order `detect_layout` tries them and
# scripts/export.py lists them: one register(...) call each.
register(ours.FORMAT)
register(reference.FORMAT)
register(eagle3.FORMAT)
register(vllm.FORMAT)

__all__ = [
    "HeadFormat",
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
    "register",
    "resolve_folder",
]
