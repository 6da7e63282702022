"""The acceptance rules: which drafted tokens a verification keeps (vLLM's rejection sampler).

Greedy (``accept_greedy``): the longest root-to-node path whose every token is the
target's argmax after its parent, found on the device; ``read_acceptance`` is the cycle's
one device-to-host transfer. Sampling (``accept_sampling``): recursive rejection sampling
over siblings, so the output is distributed exactly as the (warped) target. ``accept``
picks the rule a cycle's ``SamplingParams`` asks for; both give an ``Acceptance``.

Host reads of sampling: the tree's tokens, parents and validity (3 transfers), then one
``u < ratio`` and one residual-mass test per sibling tried, and the final draw (1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from msd_train.decoding.sampling import SamplingParams, logits_to_probs, sample
from msd_train.decoding.tree import Tree


@dataclass
class Acceptance:
    """A cycle's outcome, on the host."""

    path: list[int]  # accepted nodes, root first
    tokens: list[int]  # the accepted draft tokens, then the bonus token
    tried: int  # draft positions tested
    nodes: torch.Tensor  # (D + 1,) device: the path's nodes, padded (commit moves these)
    device_tokens: torch.Tensor  # (len(tokens),) device: the same tokens, for the next block


def accept_greedy(tree: Tree, logits: torch.Tensor) -> torch.Tensor:
    """On the device: the longest root-to-node path whose every token is the target's
    argmax after its parent; the target's argmax after that path is the bonus token.

    A node is acceptable when it and all its ancestors match; siblings hold distinct
    tokens, so at most one node per depth is acceptable and the deepest one ends the
    path. Returns one packet ``[bonus, has_children, path nodes (D+1, -1 padded),
    path tokens (D+1)]`` for ``read_acceptance``.
    """
    best = logits.argmax(-1)  # the target's token after each node
    match = tree.tokens == best[tree.parents.clamp_min(0)]
    if tree.valid is not None:
        match &= tree.valid
    match[0] = True  # the root is committed already
    paths = tree.paths()  # padding (-1) below a node's depth reads the root's match: True
    ok = match[paths.clamp_min(0)].all(-1)
    leaf = torch.where(ok, tree.depths, -1).argmax()
    nodes = paths[leaf]
    has_children = tree.has_children(leaf)
    tokens = tree.tokens[nodes.clamp_min(0)]
    return torch.cat([best[leaf].view(1), has_children.long().view(1), nodes, tokens])


def read_acceptance(tree: Tree, packet: torch.Tensor) -> Acceptance:
    """The one device-to-host transfer of a greedy cycle."""
    values = packet.tolist()
    d = (len(values) - 2) // 2
    nodes, tokens = values[2 : 2 + d], values[2 + d :]
    a = sum(x >= 0 for x in nodes) - 1
    on_device = torch.cat([packet[2 + d + 1 : 2 + d + 1 + a], packet[:1]])  # accepted tokens, bonus
    return Acceptance(nodes[: a + 1], tokens[1 : a + 1] + [values[0]], a + values[1], packet[2 : 2 + d], on_device)


def accept_sampling(tree: Tree, target_probs: torch.Tensor,
                    generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Recursive rejection sampling over siblings; the output is distributed exactly as
    the (warped) target.

    At a node with target distribution p, try its children x in order: accept x with
    probability min(1, p(x)/q(x)), else p <- norm(max(p - q, 0)) and try the next one;
    if none is accepted the bonus is drawn from what remains of p. q is the distribution
    x was sampled from, or a point mass on x for deterministic (top-k) proposals, which
    makes the rule "accept x w.p. p(x), else remove x from p": lossless for any tree
    the head builds, however its shape was chosen.
    """
    tokens, kids = tree.tokens.tolist(), tree.children()
    path = [0]
    while True:
        p = target_probs[path[-1]].float()
        accepted = None
        for c in kids[path[-1]]:
            x = tokens[c]
            if tree.draft_probs is None:
                ratio = p[x]
                residual = p.clone()
                residual[x] = 0
            else:
                q = tree.draft_probs[c].float()
                ratio = p[x] / q[x]
                residual = (p - q).clamp_min(0)
            u = torch.rand((), generator=generator, device=p.device)
            if bool(u < ratio):
                accepted = c
                break
            mass = residual.sum()
            # mass is 0 only when p == q, where x is always accepted; guard round-off
            p = residual / mass if bool(mass > 0) else p
        if accepted is None:
            return path, int(sample(p, generator))
        path.append(accepted)


def path_acceptance(tree: Tree, path: list[int], bonus: int) -> Acceptance:
    """The ``Acceptance`` of a path decided on the host (sampling's; a benchmark's forced one)."""
    d = tree.depth_bound
    tokens = tree.tokens[path[1:]].tolist() + [bonus]
    tried = len(path) - 1 + int(bool(tree.has_children(path[-1])))
    device = tree.tokens.device
    nodes = torch.as_tensor(path + [-1] * (d + 1 - len(path)), device=device)
    return Acceptance(path, tokens, tried, nodes, torch.as_tensor(tokens, device=device))


def accept(tree: Tree, logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None = None) -> Acceptance:
    """The acceptance rule of a cycle, over the target's ``logits`` (N, V) after each tree
    node: greedy (``accept_greedy`` on the device, then its one host read) or, when
    sampling, recursive rejection sampling (``accept_sampling``) over the warped target."""
    if sampling.greedy:
        return read_acceptance(tree, accept_greedy(tree, logits))
    path, bonus = accept_sampling(tree, logits_to_probs(logits, sampling), generator)
    return path_acceptance(tree, path, bonus)
