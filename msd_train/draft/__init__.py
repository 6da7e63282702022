"""MSD draft head: config, model, and the alignment of target features to draft inputs."""

from msd_train.draft.config import MSDDraftConfig
from msd_train.draft.model import MSDDraftModel, MSDDraftOutput, align_inputs, attention_bias, crop_cache

__all__ = ["MSDDraftConfig", "MSDDraftModel", "MSDDraftOutput", "align_inputs", "attention_bias", "crop_cache"]
