"""Draft-side visual compression: the head keeps at most K slots per image in its own context.

The target always reads the whole image and verifies every draft, so compression can cost
acceptance (tau), never exactness. What it saves is the draft's attention over hundreds to
thousands of visual tokens at every drafting step (ViSpec; the MSD authors' newest heads
keep 32 visual tokens chosen by KMeans).

Which slots: the head's visual slots (``DraftHead.visual_slots``: for an msd head the
decoupled block that ``visual_offset`` places, for msd3 the slots whose embedding is an
image token), one image being a maximal run of them. A run of N > K slots becomes at most K
slots; a run of N <= K is left as it is, so K >= N is no compression, bit for bit.

    method "pool"    K contiguous groups in the tokens' order (member j of N goes to group
                     floor(j * K / N)): a partition, not ``adaptive_avg_pool1d``, whose
                     windows overlap when K does not divide N, so that every token lies
                     in one slot and both methods are the same scatter-mean below.
    method "kmeans"  KMeans over the slots' visual embeddings (the projector outputs),
                     started from the "pool" groups' means, KMEANS_ITERS Lloyd steps.

What a compressed slot carries: the mean over its members of every per-slot input (the
visual embeddings, so a decoupled msd slot reads the cluster's centroid; the paired
target features and embeddings too, which only an msd3 head or a head without decoupling
reads). Its position id: the floor of its members' mean id, in each M-RoPE row (the
centroid of a cluster on the target's image grid under ``draft_positions="mrope"``). Slots
of one image are ordered by their members' mean index, so the block keeps the image's
reading order. Positions after the image keep the target's ids, as without compression:
the draft's cache is shorter than the target's, its position ids are not.

Outputs go back to the uncompressed slots with ``SlotMap.expand``: every slot reads the
output of the slot it was merged into. Loss positions never lie inside an image block in
chat data (the image sits in a user turn, the loss on assistant tokens); if one did, it
would be trained on the prediction of its merged slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

METHODS = ("none", "kmeans", "pool")

#: Lloyd iterations of the k-means. Fixed (no convergence test): no host read per
#: iteration, and the same clusters for the same image on every run. Written by hand
#: rather than taken from scikit-learn or faiss: twenty lines over tensors already on the
#: device are not worth a dependency.
KMEANS_ITERS = 10


def pool_groups(n: int, k: int) -> torch.Tensor:
    """(n,) group of each of n tokens in k contiguous groups, in order."""
    return torch.arange(n) * k // n


def kmeans(x: torch.Tensor, k: int, iters: int = KMEANS_ITERS) -> torch.Tensor:
    """(n,) cluster of each row of ``x`` (n, H) among k clusters, deterministic.

    Started from the means of ``pool_groups`` (spread over the image, no random draw);
    sums are one-hot matmuls rather than ``index_add_`` (whose CUDA atomics add in no
    fixed order); an empty cluster keeps its centroid; ties go to the lower cluster."""
    x = x.float()
    labels = pool_groups(x.shape[0], k).to(x.device)
    centroids = torch.zeros(k, x.shape[1], device=x.device)
    for _ in range(iters):  # means of the clusters, then each row to its nearest mean
        onehot = torch.nn.functional.one_hot(labels, k).to(x.dtype)  # (n, k)
        counts = onehot.sum(0)
        means = (onehot.T @ x) / counts.clamp_min(1)[:, None]
        centroids = torch.where(counts[:, None] > 0, means, centroids)
        # ||x - c||^2 up to the per-row ||x||^2, which does not change the argmin
        labels = ((centroids * centroids).sum(1)[None] - 2 * x @ centroids.T).argmin(1)
    return labels


@dataclass
class SlotMap:
    """Where each of the T slots of a batch goes among the T' compressed ones.

    ``dest`` (B, T) device: each slot's compressed slot (rows are right-padded to T' with
    slots nothing goes to: zeros, position 0, never attended to by a real slot)."""

    dest: torch.Tensor
    length: int

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) -> (B, T', ...): the mean of each compressed slot's members (a
        slot of one member keeps its value exactly)."""
        index = self.dest.view(*self.dest.shape, *([1] * (x.ndim - 2))).expand_as(x)
        out = torch.zeros(x.shape[0], self.length, *x.shape[2:], dtype=torch.float32, device=x.device)
        return out.scatter_reduce(1, index, x.float(), "mean", include_self=False).to(x.dtype)

    def compress_positions(self, pos: torch.Tensor) -> torch.Tensor:
        """(B, T) or M-RoPE (3, B, T) ids -> the floor of each compressed slot's members' mean."""
        rows = pos.ndim == 3
        x = pos.permute(1, 2, 0) if rows else pos[..., None]
        index = self.dest[..., None].expand_as(x)
        out = torch.zeros(x.shape[0], self.length, x.shape[2], dtype=torch.float64, device=x.device)
        out = out.scatter_reduce(1, index, x.double(), "mean", include_self=False).floor().to(pos.dtype)
        return out.permute(2, 0, 1) if rows else out[..., 0]

    def expand(self, y: torch.Tensor) -> torch.Tensor:
        """(B, T', ...) -> (B, T, ...): each slot reads its compressed slot's value."""
        return y.gather(1, self.dest.view(*self.dest.shape, *([1] * (y.ndim - 2))).expand(
            *self.dest.shape, *y.shape[2:]))

    def compress_inputs(self, inputs: dict) -> dict:
        """A head's keyword inputs over T slots (``target_inputs``) over the T' slots."""
        out = {}
        for name, x in inputs.items():
            if x is None:
                out[name] = None
            elif name == "position_ids":
                out[name] = self.compress_positions(x)
            else:  # per-slot tensors (B, T, ...); a bool mask keeps True where any member is
                out[name] = self.compress(x)
        return out


def slot_map(method: str, k: int, slots: torch.Tensor, visual_embeds: torch.Tensor) -> SlotMap | None:
    """The compression of a batch: ``slots`` (B, T) bool marks visual slots, ``visual_embeds``
    (B, T, H) their visual embeddings (what k-means clusters). None when nothing is
    compressed (no image of more than ``k`` slots, or ``method="none"``).

    Reads ``slots`` on the host (one transfer), and the k-means labels (one more)."""
    if method == "none" or not bool(slots.any()):
        return None
    mask = slots.cpu()
    B, T = mask.shape
    runs = []  # (row, start, n) of every image longer than k
    for b in range(B):
        edges = torch.diff(mask[b].to(torch.int8), prepend=torch.zeros(1, dtype=torch.int8),
                           append=torch.zeros(1, dtype=torch.int8))
        starts, ends = (edges == 1).nonzero().flatten().tolist(), (edges == -1).nonzero().flatten().tolist()
        runs += [(b, s, e - s) for s, e in zip(starts, ends) if e - s > k]
    if not runs:
        return None
    if method == "kmeans":
        found = [kmeans(visual_embeds[b, s:s + n], k) for b, s, n in runs]
        labels = torch.cat(found).cpu().split([n for _, _, n in runs])
    else:
        labels = [pool_groups(n, k) for _, _, n in runs]
    dest, lengths = [], []
    for b in range(B):
        pieces, t, cursor = [], 0, 0
        for (rb, s, n), lab in zip(runs, labels):
            if rb != b:
                continue
            pieces.append(torch.arange(cursor, cursor + s - t))
            cursor += s - t
            # clusters in the order of their members' mean index, empty ones dropped
            onehot = torch.nn.functional.one_hot(lab, k).double()
            count = onehot.sum(0)
            mean_index = (onehot.T @ torch.arange(n, dtype=torch.float64)) / count.clamp_min(1)
            mean_index[count == 0] = float("inf")
            rank = torch.empty(k, dtype=torch.long)
            rank[mean_index.argsort(stable=True)] = torch.arange(k)
            pieces.append(cursor + rank[lab])
            cursor += int((count > 0).sum())
            t = s + n
        pieces.append(torch.arange(cursor, cursor + T - t))
        dest.append(torch.cat(pieces))
        lengths.append(cursor + T - t)
    return SlotMap(torch.stack(dest).to(slots.device), max(lengths))
