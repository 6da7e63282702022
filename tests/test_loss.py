"""The loss is normalised by the global-batch token count: splits do not change it."""

import torch

from msd_train.training.loss import draft_loss_mask, msd_loss


def test_loss_is_invariant_to_how_the_batch_is_split():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False)
    pred = torch.randn(4, 6, 8, requires_grad=True)
    tgt = torch.randn(4, 6, 8)
    mask = (torch.rand(4, 6) > 0.3).long()
    n = float(mask.sum())
    whole, _ = msd_loss(pred, tgt, head, mask, n)
    parts = sum(msd_loss(pred[i:i + 1], tgt[i:i + 1], head, mask[i:i + 1], n)[0] for i in range(4))
    torch.testing.assert_close(whole, parts)
    # and it is the per-token mean of the two terms
    m = mask.bool()
    feat = torch.nn.functional.smooth_l1_loss(pred[m], tgt[m], reduction="none").mean(-1)
    p = torch.softmax(head(tgt[m]), -1)
    ce = -(p * torch.log_softmax(head(pred[m]), -1)).sum(-1)
    torch.testing.assert_close(whole, (feat + 0.1 * ce).sum() / n)


def test_draft_mask_targets_token_t_plus_2():
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 0]])
    assert draft_loss_mask(loss_mask).tolist() == [[0, 1, 1, 0, 0]]
