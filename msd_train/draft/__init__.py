"""MSD draft head: config, model, and the alignment of target features to draft inputs."""

from transformers import AutoConfig, AutoModel

from msd_train.draft.config import MSDDraftConfig
from msd_train.draft.model import (
    MSDDraftModel,
    MSDDraftOutput,
    NonFiniteWeightsError,
    align_inputs,
    attention_bias,
    check_finite,
    crop_cache,
)
from msd_train.draft.positions import draft_position_ids, draft_rope_deltas

# Lets AutoConfig/AutoModel open an exported head folder once this package is imported.
AutoConfig.register(MSDDraftConfig.model_type, MSDDraftConfig, exist_ok=True)
AutoModel.register(MSDDraftConfig, MSDDraftModel, exist_ok=True)

__all__ = ["MSDDraftConfig", "MSDDraftModel", "MSDDraftOutput", "NonFiniteWeightsError", "align_inputs",
           "attention_bias", "check_finite", "crop_cache", "draft_position_ids", "draft_rope_deltas"]
