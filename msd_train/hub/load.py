"""`load_head`: one call for every way a head arrives (export folder, released layout, Hub)."""

from __future__ import annotations

import logging
from pathlib import Path

from msd_train.draft.head import DraftHead
from msd_train.draft.vocabulary import load_counts
from msd_train.hub import formats
from msd_train.hub.folders import IncompleteHeadError, detect_layout, resolve_folder
from msd_train.hub.target import cast_head
from msd_train.targets.protocol import TargetProtocol

log = logging.getLogger(__name__)


def load_head(path_or_repo_id: str | Path, target: TargetProtocol | None = None, revision: str | None = None
              ) -> DraftHead:
    """Load a draft head, in eval mode, from any of:

    * this project's export folder (`config.json` with model_type "msd_draft" +
      `model.safetensors`), e.g. `runs/tiny/stage2/final`;
    * a folder in the released MSD layout (`config.json` with model_type "llava" /
      "qwen2_vl" + `pytorch_model.bin` or `model.safetensors`), converted in memory
      exactly as `scripts/import_reference.py` would;
    * a folder in the EAGLE-3 layout (``msd_train.hub.eagle3``), as an msd3 head;
    * a folder in any other format of ``msd_train.hub.formats`` that can be loaded;
    * a Hugging Face Hub repo id of any of these (`lucylyn/MSD-LLaVA1.5-7B`), downloaded with
      `snapshot_download` (head files only), at `revision` if given.

    `target`: the `msd_train.targets.Target` the head will draft for, or None. When
    given, the head must fit it (hidden size; a released head's `embed_tokens` is
    compared with the target's table on the shared ids, with a warning on mismatch),
    and the head is moved to the target's device and dtype.
    """
    folder = resolve_folder(path_or_repo_id, revision)
    fmt = formats.get(detect_layout(folder))
    if fmt.load is None:
        raise IncompleteHeadError(f"{path_or_repo_id}: a head in the {fmt.name} format is written for another engine; "
                                  f"this project does not load it back (load the folder it was exported from)")
    model = fmt.load(folder, target=target, source=str(path_or_repo_id))
    counts = load_counts(folder)  # None without a counts file (decoding.draft_vocab needs it)
    if counts is not None or getattr(model, "token_counts", None) is None:  # a format may keep them elsewhere
        model.token_counts = counts
    if target is not None:
        check_fits(model, target, str(path_or_repo_id))
        model = cast_head(model, device=target.device, dtype=target.dtype)
    return model.eval()


def check_fits(model: DraftHead, target: TargetProtocol, where: str) -> None:
    """Refuse a head whose width differs from the target's; warn when the head names
    another target, vocabulary size or LoRA adapter than the one it is loaded with."""
    config = model.config
    text = target.config.get_text_config(decoder=True)
    if config.hidden_size != text.hidden_size:
        raise IncompleteHeadError(
            f"{where}: the head has hidden size {config.hidden_size}, the target {getattr(target, 'name', '')} "
            f"has {text.hidden_size}: this head was trained for another target ({config.target_name_or_path})"
        )
    if config.target_vocab_size not in (None, text.vocab_size):
        log.warning("%s: trained for a target with %d tokens, loaded with one of %d", where,
                    config.target_vocab_size, text.vocab_size)
    name = getattr(target, "name", None)
    if config.target_name_or_path and name and Path(str(name)).name != Path(config.target_name_or_path).name:
        log.warning("%s: trained for target %s, loaded with %s", where, config.target_name_or_path, name)
    adapter = getattr(target, "adapter", None)
    if (config.target_adapter or None) != (adapter or None):
        log.warning("%s: trained with target adapter %s, the target has %s", where, config.target_adapter, adapter)
