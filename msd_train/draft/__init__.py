"""Draft heads: the interface (head.py), the msd, msd3 and dflash architectures, their configs, and
the alignment of target features to draft inputs."""

from transformers import AutoConfig, AutoModel

from msd_train.draft.config import MSD3DraftConfig, MSDDraftConfig
from msd_train.draft.dflash import DFlashDraftConfig, DFlashDraftModel
from msd_train.draft.head import HEADS, DraftHead, head_class
from msd_train.draft.model import (
    MSDDraftModel,
    MSDDraftOutput,
    NonFiniteWeightsError,
    align_inputs,
    attention_bias,
    check_finite,
    crop_cache,
)
from msd_train.draft.msd3 import MSD3DraftModel
from msd_train.draft.positions import draft_position_ids, draft_rope_deltas

# Lets AutoConfig/AutoModel open an exported head folder once this package is imported.
AutoConfig.register(MSDDraftConfig.model_type, MSDDraftConfig, exist_ok=True)
AutoModel.register(MSDDraftConfig, MSDDraftModel, exist_ok=True)
AutoConfig.register(MSD3DraftConfig.model_type, MSD3DraftConfig, exist_ok=True)
AutoModel.register(MSD3DraftConfig, MSD3DraftModel, exist_ok=True)
AutoConfig.register(DFlashDraftConfig.model_type, DFlashDraftConfig, exist_ok=True)
AutoModel.register(DFlashDraftConfig, DFlashDraftModel, exist_ok=True)

__all__ = ["HEADS", "DFlashDraftConfig", "DFlashDraftModel", "DraftHead", "MSD3DraftConfig", "MSD3DraftModel", "MSDDraftConfig", "MSDDraftModel",
           "MSDDraftOutput", "NonFiniteWeightsError", "align_inputs", "attention_bias", "check_finite", "crop_cache",
           "draft_position_ids", "draft_rope_deltas", "head_class"]
