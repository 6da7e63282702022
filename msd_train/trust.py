"""What the project unpickles: tensors, plain values and a few named types, nothing else.

Weights, features and token counts are safetensors, configs and records JSON. The files that
are torch pickles (a checkpoint's DeepSpeed engine and optimizer states and its
``portable.pt``; a released head's or a target's ``pytorch_model.bin``) are read by
:func:`torch_load` alone: ``torch.load(weights_only=True)``, which rebuilds tensors, numbers,
strings, lists, dicts and sets and calls no other function, plus the classes ``allowed``
names (DeepSpeed's optimizer states hold three: :data:`DEEPSPEED_TYPES`). A file that needs
anything else is refused, naming it; what it holds never runs.
"""

from __future__ import annotations

import importlib
import pickle
from pathlib import Path

from msd_train.errors import ConfigError, unpickling_reason

#: the classes DeepSpeed's optimizer-state files hold besides tensors and plain values (ZeRO's
#: stage, the fp32 partitions' addresses, the loss scaler), by name
DEEPSPEED_TYPES = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
)


class UnsafeFileError(ConfigError):
    """A torch file holding objects this project does not load (the message names the file)."""


def _class(name: str):
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def torch_load(path: str | Path, *, allowed: tuple[str, ...] = (), fix: str = "", **kwargs):
    """``torch.load(path, weights_only=True, **kwargs)`` with the classes ``allowed`` names;
    a file holding any other object is an :class:`UnsafeFileError` naming ``path``, the
    object and ``fix`` (what the user can do). Other failures (a damaged file) are torch's."""
    import torch

    try:
        with torch.serialization.safe_globals([_class(n) for n in allowed]):
            return torch.load(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as err:
        raise unsafe_file(str(path), err, fix) from err


def unsafe_file(what: str, err: pickle.UnpicklingError, fix: str = "") -> UnsafeFileError:
    """The refusal of ``torch.load(weights_only=True)`` (``err``, torch's or raised by a library
    loading that way) as one message naming ``what`` (the file), the object refused and ``fix``."""
    reason = unpickling_reason(err)  # torch's one line of reason, without its advice
    return UnsafeFileError(
        f"{what}: holds objects other than tensors and plain values ({reason.rstrip('.')}); it was not loaded: "
        f"files are read with torch.load(weights_only=True), since unpickling anything else could run any code it "
        f"carries{'. ' + fix if fix else ''}")
