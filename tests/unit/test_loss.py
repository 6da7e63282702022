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


def test_chunked_loss_and_gradients_equal_the_unchunked_ones():
    """The token term built chunk by chunk (logits of a few positions at a time, the gradient
    taken per chunk) gives the loss, the logged parts and the gradients of the whole-batch
    formula, whatever the chunk size."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False).requires_grad_(False)
    tgt = torch.randn(3, 7, 8)
    mask = (torch.rand(3, 7) > 0.3).long()
    base = torch.randn(3, 7, 8)

    pred = base.clone().requires_grad_()
    m = mask.bool()
    p, f = pred[m], tgt[m]
    feat = torch.nn.functional.smooth_l1_loss(p, f, reduction="none").mean(-1).sum()
    q, logp = torch.softmax(head(f), -1), torch.log_softmax(head(p), -1)
    tok = -(q * logp).sum()
    ((feat + 0.1 * tok) / 20.0).backward()
    agree = (logp.argmax(-1) == q.argmax(-1)).sum()

    for chunk in (1, 4, int(m.sum()), 1000):
        pred_c = base.clone().requires_grad_()
        loss, parts = msd_loss(pred_c, tgt, head, mask, 20.0, chunk=chunk)
        loss.backward()
        torch.testing.assert_close(loss, (feat + 0.1 * tok).detach() / 20.0)
        torch.testing.assert_close(parts["tok_sum"], tok.detach())
        assert parts["agree_sum"] == agree and parts["n"] == m.sum()
        torch.testing.assert_close(pred_c.grad, pred.grad)
    with torch.no_grad():  # validation: no gradient kept
        loss, _ = msd_loss(base, tgt, head, mask, 20.0, chunk=2)
    torch.testing.assert_close(loss, (feat + 0.1 * tok).detach() / 20.0)


def test_chunked_argmax_is_the_argmax():
    from msd_train.training.loss import lm_head_argmax

    torch.manual_seed(1)
    head = torch.nn.Linear(8, 50, bias=False)
    x = torch.randn(2, 9, 8)
    assert torch.equal(lm_head_argmax(head, x, chunk=4), head(x).argmax(-1))


def _loss_and_grad(base, tgt, head, mask, **kw):
    pred = base.clone().requires_grad_()
    loss, parts = msd_loss(pred, tgt, head, mask, 20.0, **kw)
    loss.backward()
    return loss.detach(), parts, pred.grad


def test_a_train_vocabulary_of_every_token_is_the_full_loss():
    """draft.train_vocab=V: the same loss, logged parts and gradient as the full-vocabulary term."""
    from msd_train.draft.vocabulary import VocabSubset

    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=True).requires_grad_(False)
    tgt, base, mask = torch.randn(3, 7, 8), torch.randn(3, 7, 8), (torch.rand(3, 7) > 0.3).long()
    want = _loss_and_grad(base, tgt, head, mask)
    got = _loss_and_grad(base, tgt, head, mask, vocab=VocabSubset(head, torch.randperm(50)), chunk=4)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[2], want[2])
    assert got[1]["agree_sum"] == want[1]["agree_sum"]


def test_a_pruned_train_vocabulary_is_eagle3s_rule():
    """Over N rows: both softmaxes over those rows, positions whose target top-1 (over all V)
    is outside them out of the token term, a stored top-1 giving what the computed one gives;
    the gradient is finite and differs from the full one."""
    from msd_train.draft.loss import lm_head_argmax
    from msd_train.draft.vocabulary import VocabSubset

    torch.manual_seed(1)
    head = torch.nn.Linear(8, 50, bias=False).requires_grad_(False)
    tgt, base, mask = torch.randn(2, 9, 8), torch.randn(2, 9, 8), torch.ones(2, 9, dtype=torch.long)
    top = lm_head_argmax(head, tgt)
    ids = torch.unique(torch.cat([top.flatten()[:10], torch.arange(0, 50, 3)]))  # some tops in, some out
    vocab = VocabSubset(head, ids)
    loss, parts, grad = _loss_and_grad(base, tgt, head, mask, vocab=vocab)
    m = mask.bool()
    p, f, t = base[m], tgt[m], top[m]
    keep = vocab.member[t]
    assert 0 < int(keep.sum()) < len(t)  # the case the rule is about
    rows = head.weight[vocab.ids]
    q, logp = torch.softmax(f @ rows.T, -1), torch.log_softmax(p @ rows.T, -1)
    tok = (-(q * logp).sum(-1) * keep).sum()
    feat = torch.nn.functional.smooth_l1_loss(p, f, reduction="none").mean(-1).sum()
    torch.testing.assert_close(loss, (feat + 0.1 * tok) / 20.0)
    assert parts["agree_sum"] == int(((vocab.ids[logp.argmax(-1)] == t) & keep).sum())
    assert torch.isfinite(grad).all()
    full = _loss_and_grad(base, tgt, head, mask)[2]
    assert not torch.allclose(grad, full)
    stored = _loss_and_grad(base, tgt, head, mask, vocab=vocab, target_top=top)  # as a feature store gives it
    torch.testing.assert_close(stored[0], loss)
    torch.testing.assert_close(stored[2], grad)
