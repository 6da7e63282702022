"""Rows of a tokenised split -> a padded batch with the target's pixel inputs."""

from __future__ import annotations

from pathlib import Path

import torch

from msd_train.data.dataset import DamagedImage, UnusableImage, load_images
from msd_train.targets.protocol import TargetProtocol


def sample_key(row: dict) -> str:
    """A stable name for a sample: its file's name and its position in that file."""
    return f"{Path(row['source']).name}#{row['index']}"


def collate(rows: list[dict], target: TargetProtocol, pad_id: int = 0, pixels: bool = True) -> dict:
    """Right-pad ``input_ids``/``loss_mask``; load images and run the image processor.

    Pixel tensors of all images of the batch are concatenated in sample order, which is
    the order the target's forward fills the image slots in. ``pixels=False`` skips the
    images (a feature store already holds their embeddings).
    """
    length = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    loss = torch.zeros((len(rows), length), dtype=torch.long)
    attn = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"])
        loss[i, :n] = torch.tensor(r["loss_mask"])
        attn[i, :n] = 1
    images = [im for r in rows for im in _row_images(r)] if pixels else []
    pixel: dict[str, torch.Tensor] = {}
    if images:
        pixel, counts = target.image_inputs(images)
        check_visual_counts(rows, counts)
    return {"input_ids": ids, "loss_mask": loss, "attention_mask": attn, "pixel": pixel,
            "ids": [r["id"] for r in rows], "keys": [sample_key(r) for r in rows],
            "n_images": sum(len(r["images"]) for r in rows)}


def _row_images(row: dict) -> list:
    try:
        return load_images(row["images"])
    except DamagedImage as e:
        raise UnusableImage.of(row, [e.filename], f"does not decode ({e.why}): the file is damaged, though its "
                                                  "header passed the check when the data was tokenised") from None


def check_visual_counts(rows: list[dict], counts: list[int]) -> None:
    """The processor's visual tokens per image against the rows' ``n_visual`` (counted from
    the image headers when the data was tokenised): an image replaced by one of another size
    since then would feed the target the wrong number of visual embeddings. Raises
    :class:`UnusableImage` naming the sample and its images."""
    at = 0
    for r in rows:
        n = len(r["images"])
        if "n_visual" in r and sum(counts[at:at + n]) != r["n_visual"]:
            raise UnusableImage.of(r, list(r["images"]), f"changed since the data was tokenised: it now gives "
                                                         f"{sum(counts[at:at + n])} visual tokens, "
                                                         f"{r['n_visual']} then")
        at += n


# ----------------------------------------------------------------------------- training batches
class StepBatches(torch.utils.data.Dataset):
    """Item ``(step, plan, cursor)`` -> this rank's collated micro-batches of that step.

    The plan (a global batch of (modality, index) pairs, see ``Curriculum.plan``) is made
    in the main process in step order; only the collation (image decode, image processor,
    padding) runs here, in DataLoader workers. Rank r takes rows ``(a * W + r) * mb``
    onwards for accumulation step ``a``, so W ranks with grad_accum A see the same samples
    as one rank with grad_accum W * A.
    """

    def __init__(self, text, mm, target: TargetProtocol, micro_batch_size: int, grad_accum: int, rank: int, world: int,
                 pixels: bool = True, features=None):
        self.text, self.mm, self.target = text, mm, target
        self.mb, self.ga, self.rank, self.world, self.pixels = micro_batch_size, grad_accum, rank, world, pixels
        # A feature source's host half (the offline store's reads and checks), run with the collation.
        self.host_features = getattr(features, "host", None)

    def __len__(self) -> int:  # items are addressed by the sampler, not by position
        raise TypeError("StepBatches is read through StepSampler")

    def rows(self, plan: list[tuple[str, int]]) -> list[dict]:
        return [(self.mm if kind == "mm" else self.text)[i] for kind, i in plan]

    def __getitem__(self, item) -> dict:
        step, plan, cursor = item
        rows = self.rows(plan)
        micro = []
        for a in range(self.ga):
            start = (a * self.world + self.rank) * self.mb
            try:
                batch = collate(rows[start:start + self.mb], self.target, pixels=self.pixels)
            except UnusableImage as e:  # to the trainer whole (a worker's exception reaches it as text)
                return {"step": step, "cursor": cursor, "unusable": (str(e), e.record)}
            if self.host_features is not None:
                batch["offline"] = self.host_features(batch)
            micro.append(batch)
        return {"step": step, "micro_batches": micro, "cursor": cursor,
                # Loss normalisation counts the loss tokens of the whole global batch (every rank knows it).
                "n_global": float(sum(sum(r["loss_mask"][2:]) for r in rows)),
                "tokens": float(sum(len(r["input_ids"]) for r in rows)),
                "n_mm": sum(1 for kind, _ in plan if kind == "mm"), "n_rows": len(plan)}


class StepSampler(torch.utils.data.Sampler):
    """Steps ``start, start+1, ...`` with their plans, drawn from a copy of the curriculum.

    The DataLoader reads ahead, so the copy runs ahead of the recipe's curriculum; each item
    carries the curriculum's state after its step (``cursor``), which the recipe adopts when
    it consumes that step. Checkpoints therefore record exactly the consumed position.
    """

    def __init__(self, curriculum, start: int, stop: int):
        import copy

        self.curriculum, self.start, self.stop = copy.deepcopy(curriculum), start, stop

    def __iter__(self):
        for step in range(self.start, self.stop):
            plan = self.curriculum.plan(step)
            yield step, plan, self.curriculum.state_dict()

    def __len__(self) -> int:
        return max(self.stop - self.start, 0)


def _unbatched(item):
    return item


def _stop_signals_from_the_trainer_only(worker_id: int) -> None:
    """Loader workers leave stopping to the trainer.

    Ctrl-C reaches the whole process group, and the ``deepspeed`` launcher answers a signal
    with SIGTERM to the trainer's whole process tree: workers that died of it would make the
    trainer's next DataLoader call (or torch's SIGCHLD check) raise while it saves its
    checkpoint. So a worker ignores SIGINT, and SIGTERM unless the trainer itself sent it
    (``multiprocessing`` ends workers that way at exit). The sender is only known to
    ``sigwaitinfo``, hence a thread waiting for the blocked signal: every other thread of the
    worker must block it, or the kernel hands it to that thread and torch's worker handler
    (installed in C before this function runs) ends the worker with it. Every thread of a
    worker, those that fork hooks start before this function included (wandb's OpenTelemetry
    exporters), inherits the mask of the trainer's thread that forked it, which
    :class:`_StepLoader` blocks for the fork. A worker whose trainer is killed outright still
    exits: torch's worker loop checks that its parent is alive.
    """
    import os
    import signal
    import threading

    trainer = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def wait_for_the_trainer():
        while True:
            if signal.sigwaitinfo({signal.SIGTERM}).si_pid == trainer:
                os._exit(0)

    threading.Thread(target=wait_for_the_trainer, daemon=True, name="stop-signals").start()


class _StepLoader(torch.utils.data.DataLoader):
    """A DataLoader whose workers fork with SIGTERM blocked in the forking thread.

    Threads that libraries start in a forked child before ``worker_init_fn`` (wandb's
    OpenTelemetry exporters restart from fork hooks) inherit that mask, so no thread of a
    worker takes the launcher's SIGTERM; see :func:`_stop_signals_from_the_trainer_only`.
    The trainer's mask is restored once the workers exist: a SIGTERM sent to it meanwhile
    waits, blocked, and is handled then.
    """

    def __iter__(self):
        if self.num_workers == 0:
            return super().__iter__()
        import signal

        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            return super().__iter__()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def step_loader(dataset: StepBatches, curriculum, start: int, stop: int, workers: int, pin_memory: bool,
                prefetch: int = 2) -> torch.utils.data.DataLoader:
    """The training steps ``start..stop-1`` of this rank, collated ahead by ``workers`` processes.

    Workers are forked (the dataset holds the target; its processor is all they touch, the
    weights are never pickled or used there). ``pin_memory`` only for CUDA: page-locked
    batches make the host-to-device copies asynchronous.
    """
    kw = {"num_workers": workers, "pin_memory": pin_memory}
    if workers > 0:
        kw.update(prefetch_factor=prefetch, multiprocessing_context="fork", persistent_workers=False,
                  worker_init_fn=_stop_signals_from_the_trainer_only)
    return _StepLoader(dataset, sampler=StepSampler(curriculum, start, stop), batch_size=None, collate_fn=_unbatched,
                       **kw)
