"""A draft tree: the candidate continuations one target forward verifies.

Node 0 is the root, the newest committed token (not yet in the target's cache). Every
other node is a drafted token; ``parents[i] < i``, so nodes are in topological order and
a chain is the special case ``parents = [-1, 0, 1, ...]``. Siblings are tried in index
order by the acceptance rules, most likely first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Tree:
    tokens: torch.Tensor  # (N,) long
    parents: torch.Tensor  # (N,) long, -1 for the root
    depths: torch.Tensor  # (N,) long, 0 for the root
    #: (N, V) the distribution each node's token was *sampled* from (row 0 unused), or
    #: None when the tokens were picked deterministically (top-k, argmax): the
    #: acceptance rule then treats each proposal as a point mass.
    draft_probs: torch.Tensor | None = None
    #: True when every node has at most one child: plain causal attention verifies it
    is_chain: bool = False
    #: (N,) cumulative draft log-probability of each node's path (root 0), when drafted by score
    scores: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def children(self) -> list[list[int]]:
        """Children of every node, in index (= trial) order."""
        kids: list[list[int]] = [[] for _ in range(len(self))]
        for i, p in enumerate(self.parents.tolist()[1:], start=1):
            kids[p].append(i)
        return kids

    def ancestor_mask(self) -> torch.Tensor:
        """(N, N) bool: ``[i, j]`` is True when j is i itself or one of its ancestors."""
        n = len(self)
        mask = torch.eye(n, dtype=torch.bool, device=self.tokens.device)
        rows = torch.arange(n, device=self.tokens.device)
        anc = self.parents.clone()
        for _ in range(int(self.depths.max())):  # climb one level per step, all nodes at once
            ok = anc >= 0
            mask[rows[ok], anc[ok]] = True
            anc = torch.where(ok, self.parents[anc.clamp_min(0)], anc)
        return mask


def chain(root: torch.Tensor, tokens: torch.Tensor | None = None, draft_probs: torch.Tensor | None = None) -> Tree:
    """The chain root -> tokens[0] -> tokens[1] ...; ``root`` (1,), ``tokens`` (k,),
    ``draft_probs`` (k, V) the distributions the tokens were sampled from, if they were."""
    toks = root if tokens is None else torch.cat([root, tokens])
    idx = torch.arange(toks.shape[0], device=toks.device)
    if draft_probs is not None:
        draft_probs = torch.cat([torch.zeros_like(draft_probs[:1]), draft_probs], dim=0)
    return Tree(toks, idx - 1, idx, draft_probs, is_chain=True)


def tree_attention_bias(tree_mask: torch.Tensor, past: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive 4-D mask (1, 1, N, past + A): each of N query nodes sees the whole cached
    prefix and, of the A tree nodes after it (the queries last), those ``tree_mask`` (N, A)
    allows: its own ancestors and itself (``Tree.ancestor_mask`` gives the square case)."""
    n, a = tree_mask.shape
    bias = torch.zeros(n, past + a, dtype=dtype, device=tree_mask.device)
    bias[:, past:].masked_fill_(~tree_mask, torch.finfo(dtype).min)
    return bias[None, None]
