"""A draft tree: the candidate continuations one target forward verifies.

Node 0 is the root, the newest committed token (not yet in the target's cache). Every
other node is a drafted token; ``parents[i] < i``, so nodes are in topological order and
a chain is the special case ``parents = [-1, 0, 1, ...]``. Siblings are tried in index
order by the acceptance rules, most likely first.

Shapes are fixed by the drafting settings, not by the data: a drafted tree always has
``total_tokens`` nodes (padding nodes, whose draft score is -inf, are marked invalid and
never accepted) and ``max_depth`` is the deepest a node can be, so everything below runs
on the device without reading it back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    #: (N,) bool: nodes the acceptance rules may accept (False: shape padding); None: all
    valid: torch.Tensor | None = None
    #: the largest depth a node can have (static: the drafting settings), None: len - 1
    max_depth: int | None = None
    #: (N,) long: where each node's children's draft distribution came from, as an index
    #: into the draft steps' outputs concatenated in drafting order (-1: not expanded);
    #: set by ``drafter.draft_tree`` / ``draft_chain``, read by a TABED ensemble
    children_from: torch.Tensor | None = None
    _paths: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def has_children(self, node) -> torch.Tensor:
        """On the device: whether ``node`` (an index or a 0-d tensor) has a real child."""
        kids = self.parents == node
        return (kids if self.valid is None else kids & self.valid).any()

    def children(self) -> list[list[int]]:
        """Children of every node, in index (= trial) order; padding nodes are nobody's.
        On the host (sampling acceptance): one read of the parents, one of ``valid``."""
        kids: list[list[int]] = [[] for _ in range(len(self))]
        valid = self.valid.tolist() if self.valid is not None else [True] * len(self)
        for i, p in enumerate(self.parents.tolist()[1:], start=1):
            if valid[i]:
                kids[p].append(i)
        return kids

    @property
    def depth_bound(self) -> int:
        return len(self) - 1 if self.max_depth is None else self.max_depth

    def paths(self) -> torch.Tensor:
        """(N, D + 1) long, the root-to-node path matrix: ``[i, d]`` is the node at depth
        d on the path from the root to i (``[i, depths[i]] = i``), -1 below i's depth.
        Built on the device by climbing one level per step, all nodes at once (once per
        tree: verification and acceptance share it)."""
        if self._paths is not None:
            return self._paths
        n, d = len(self), self.depth_bound
        out = torch.full((n, d + 2), -1, dtype=torch.long, device=self.tokens.device)
        node = torch.arange(n, device=self.tokens.device)
        for _ in range(d + 1):
            ok = node >= 0
            col = torch.where(ok, self.depths[node.clamp_min(0)], d + 1)  # column d + 1 collects the misses
            out.scatter_(1, col[:, None], torch.where(ok, node, -1)[:, None])
            node = torch.where(ok, self.parents[node.clamp_min(0)], -1)
        self._paths = out[:, : d + 1]
        return self._paths

    def ancestor_mask(self) -> torch.Tensor:
        """(N, N) bool: ``[i, j]`` is True when j is i itself or one of its ancestors."""
        n = len(self)
        paths = self.paths()
        mask = torch.zeros(n, n + 1, dtype=torch.bool, device=self.tokens.device)
        mask.scatter_(1, torch.where(paths >= 0, paths, n), True)  # column n collects the padding
        return mask[:, :n]


def chain(root: torch.Tensor, tokens: torch.Tensor | None = None, draft_probs: torch.Tensor | None = None) -> Tree:
    """The chain root -> tokens[0] -> tokens[1] ...; ``root`` (1,), ``tokens`` (k,),
    ``draft_probs`` (k, V) the distributions the tokens were sampled from, if they were."""
    toks = root if tokens is None else torch.cat([root, tokens])
    idx = torch.arange(toks.shape[0], device=toks.device)
    if draft_probs is not None:
        draft_probs = torch.cat([torch.zeros_like(draft_probs[:1]), draft_probs], dim=0)
    return Tree(toks, idx - 1, idx, draft_probs, is_chain=True, max_depth=toks.shape[0] - 1)

