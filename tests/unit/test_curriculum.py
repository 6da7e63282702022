"""The stage curriculum: schedules, determinism across ranks and resumes."""

import pytest

from msd_train.data.curriculum import Curriculum, mm_share


def test_schedules():
    assert mm_share(0, 0.0, 0.5, 100) == 0.0
    assert mm_share(50, 0.0, 0.5, 100) == pytest.approx(0.25)
    assert mm_share(100, 0.0, 0.5, 100) == 0.5 == mm_share(1000, 0.0, 0.5, 100)
    assert mm_share(50, 0.0, 1.0, 100, "cosine") == pytest.approx(0.5)
    assert mm_share(25, 0.0, 1.0, 100, "cosine") < 0.25
    assert mm_share(99, 0.0, 1.0, 100, "step") == 0.0 and mm_share(100, 0.0, 1.0, 100, "step") == 1.0
    with pytest.raises(ValueError, match="schedule=exp"):
        mm_share(1, 0, 1, 10, "exp")


def _cur(**kw):
    args = dict(n_text=50, n_mm=30, global_batch=8, seed=3, start=0.1, end=0.9, ramp_steps=40)
    args.update(kw)
    return Curriculum(**args)


def test_realised_share_tracks_schedule():
    cur = _cur()
    shares = [sum(k == "mm" for k, _ in cur.plan(s)) / 8 for s in range(60)]
    for s, r in enumerate(shares):
        assert abs(r - mm_share(s, 0.1, 0.9, 40)) < 1 / 8 + 1e-9
    # on average it is unbiased
    assert abs(sum(shares[40:]) / 20 - 0.9) < 0.05


def test_same_plan_on_every_rank_and_after_resume():
    a, b = _cur(), _cur()
    plans_a = [a.plan(s) for s in range(30)]
    assert plans_a == [b.plan(s) for s in range(30)]
    # resume at step 17 from the saved counters
    c = _cur()
    for s in range(17):
        c.plan(s)
    state = c.state_dict()
    d = _cur()
    d.load_state_dict(state)
    assert [d.plan(s) for s in range(17, 30)] == plans_a[17:]


def test_every_sample_once_per_epoch():
    cur = _cur(n_text=16, n_mm=0, start=0, end=0, ramp_steps=0)
    seen = [i for s in range(4) for _, i in cur.plan(s)]
    assert sorted(seen[:16]) == list(range(16)) and sorted(seen[16:]) == list(range(16))
    assert seen[:16] != seen[16:]  # reshuffled each epoch


def test_text_only_stage_never_draws_images():
    cur = _cur(start=0.0, end=0.0, ramp_steps=0)
    assert all(k == "text" for s in range(20) for k, _ in cur.plan(s))


def test_length_buckets_cut_padding_and_keep_epochs_and_resume():
    """train.bucket_window: micro-batches of similar lengths (far less padding than random
    ones), every sample still once per epoch, the same plan after a resume."""
    import numpy as np

    rng = np.random.default_rng(0)
    lengths = rng.integers(20, 512, size=96)

    def padded_share(cur, steps, mb=4):
        real = pad = 0
        for s in range(steps):
            plan = cur.plan(s)
            for m in range(0, len(plan), mb):
                lens = [int(lengths[i]) for _, i in plan[m:m + mb]]
                real, pad = real + sum(lens), pad + len(lens) * max(lens)
        return 1 - real / pad

    args = dict(n_text=96, n_mm=0, global_batch=8, seed=1, start=0, end=0, ramp_steps=0)
    plain = padded_share(_cur(**args), 24)
    bucketed = padded_share(_cur(**args, text_lengths=lengths, bucket_window=32), 24)
    assert bucketed < plain / 3
    cur = _cur(**args, text_lengths=lengths, bucket_window=32)
    seen = [i for s in range(24) for _, i in cur.plan(s)]
    assert sorted(seen[:96]) == list(range(96)) and sorted(seen[96:]) == list(range(96))
    a, b = _cur(**args, text_lengths=lengths, bucket_window=32), _cur(**args, text_lengths=lengths, bucket_window=32)
    want = [a.plan(s) for s in range(20)]
    for s in range(7):
        b.plan(s)
    c = _cur(**args, text_lengths=lengths, bucket_window=32)
    c.load_state_dict(b.state_dict())
    assert [c.plan(s) for s in range(7, 20)] == want[7:]


def test_sample_lengths_reads_the_token_counts():
    from datasets import Dataset

    from msd_train.data.curriculum import sample_lengths

    ds = Dataset.from_dict({"input_ids": [[1, 2, 3], [4], [5, 6]], "loss_mask": [[0, 1, 1], [1], [0, 1]]})
    assert sample_lengths(ds).tolist() == [3, 1, 2]
    assert sample_lengths(ds.select([])).tolist() == []
