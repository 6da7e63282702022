"""The training loss, where the recipe reads it: the losses live with the heads
(``msd_train.draft.loss``), since a head's ``training_loss`` is part of its interface."""

from msd_train.draft.loss import CHUNK, draft_loss_mask, lm_head_argmax, loss_index, msd_loss

__all__ = ["CHUNK", "draft_loss_mask", "lm_head_argmax", "loss_index", "msd_loss"]
