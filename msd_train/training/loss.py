"""The training loss's pieces, where the recipe reads them: they live in
``msd_train.draft.loss`` (beside the heads); each head kind's objective, which combines
them, is in ``msd_train.training.objective``."""

from msd_train.draft.loss import CHUNK, draft_loss_mask, lm_head_argmax, loss_index, msd_loss

__all__ = ["CHUNK", "draft_loss_mask", "lm_head_argmax", "loss_index", "msd_loss"]
