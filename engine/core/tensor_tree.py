"""One iteration's draft tree as device tensors of fixed shapes, grown level by level without reading the device.

The host tree (tree.py) is a list of Python nodes: every level's choice reads the draft's probabilities back to the
host, which on a GPU is a synchronisation per level. Here the same choices are tensor operations on arrays sized to
the node budget, so a whole draft phase and its verification queue on the device, and the host reads the tree once,
with the accepted path (`read`). Node ids, order and values are those the host path gives for the same
distributions: parents served by path probability (stable), children by rank, the budget cut in that order, path
probabilities multiplied in float64 as Python does.

Slot `capacity` is a dump: writes of rejected candidates and padded frontier rows go there and are never read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from engine.core.tree import DraftTree


@dataclass
class Level:
    """One draft forward's rows: `frontier` [W] node ids (the dump slot where `valid` [W] is False), their processed
    draft distributions `dists` [W, V], and the first draft-cache column they were written at."""
    frontier: torch.Tensor
    valid: torch.Tensor
    dists: torch.Tensor
    column: int


@dataclass
class Readback:
    """What the one read brings back (`TensorTree.read`), as Python values: the node arrays up to `count`, per level
    the node each row expanded (the dump slot where none), its confidence (top q) and its q of the bonus token, the
    accepted path (root first) and the bonus token."""
    count: int
    tokens: list[int]
    parents: list[int]
    q: list[float]
    ranks: list[int]
    expanded: list[list[int]]
    confidences: list[list[float]]
    bonus_qs: list[list[float]]
    path: list[int]
    bonus: int


class TensorTree:
    """A tree of at most `budget` drafted nodes plus the root, as tensors on `device`."""

    def __init__(self, root_token: int, budget: int, device: torch.device):
        self.capacity, self.device = int(budget) + 1, device
        self.rows = self.capacity  # rows the verification forward runs: the first `rows` slots hold every node
        size = self.capacity + 1  # + the dump slot
        zeros = lambda dtype: torch.zeros(size, dtype=dtype, device=device)  # noqa: E731
        self.tokens, self.parents, self.depths, self.ranks = (zeros(torch.long) for _ in range(4))
        self.q, self.path_q = zeros(torch.float64), zeros(torch.float64)
        self.tokens[0], self.parents[0], self.q[0], self.path_q[0] = root_token, -1, 1.0, 1.0
        self.count = torch.ones((), dtype=torch.long, device=device)  # nodes so far, the root included
        self.ancestors = torch.eye(size, dtype=torch.bool, device=device)  # (i, j): j is i or an ancestor of i
        self.levels: list[Level] = []

    @property
    def dump(self) -> int:
        return self.capacity

    def root_frontier(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The first level's frontier: the root alone."""
        return (torch.zeros(1, dtype=torch.long, device=self.device),
                torch.ones(1, dtype=torch.bool, device=self.device))

    def grow(self, frontier: torch.Tensor, valid: torch.Tensor, probs: torch.Tensor, tokens: torch.Tensor,
             chosen: torch.Tensor) -> torch.Tensor:
        """Add the children `chosen` [W, K] (a prefix of each row's top-K `probs`/`tokens`, sorted descending) of the
        frontier's nodes, parents in order of path probability, until the budget; returns the new nodes' ids [W*K] in
        id order (the dump slot where none was added)."""
        order = torch.sort(self.path_q[frontier].masked_fill(~valid, -1.0), descending=True, stable=True).indices
        parents = frontier[order].repeat_interleave(probs.shape[1])
        chosen = (chosen & valid[:, None])[order].reshape(-1)
        ids = self.count + chosen.long().cumsum(0) - 1
        added = chosen & (ids < self.capacity)
        slot = torch.where(added, ids, self.dump)
        q = probs[order].reshape(-1).double()
        self.tokens[slot] = tokens[order].reshape(-1)
        self.parents[slot] = parents
        self.depths[slot] = self.depths[parents] + 1
        self.q[slot] = q
        self.path_q[slot] = self.path_q[parents] * q
        self.ranks[slot] = torch.arange(probs.shape[1], device=self.device).repeat(probs.shape[0])
        self.ancestors[slot] = self.ancestors[parents]
        self.ancestors[slot, slot] = True
        self.count += added.sum()
        return slot

    def compact(self, nodes: torch.Tensor, keep: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next frontier: the first `width` of the `nodes` where `keep`, in their order, padded with the dump slot
        (a plan's widths bound what a level can add, so none is cut in a run; the bound keeps every index in range)."""
        position = keep.long().cumsum(0) - 1
        position = torch.where(keep & (position < width), position, width)
        frontier = torch.full((width + 1,), self.dump, dtype=torch.long, device=self.device)
        frontier[position] = torch.where(keep, nodes, self.dump)
        return frontier[:width], torch.arange(width, device=self.device) < keep.sum()

    def keep_only(self, keep: torch.Tensor, rows: int) -> None:
        """Keep the nodes where `keep` [capacity] (prefix-closed, the root included), in their order and renumbered
        from 0, as `DraftTree.prune` does; the verification then runs `rows` rows (at least the nodes kept). The
        levels' frontiers follow the renumbering (a dropped node's row counts as expanding nothing)."""
        n = self.capacity
        order = torch.sort((~keep).to(torch.int8), stable=True).indices  # the kept nodes first, in id order
        renumbered = torch.full((n + 1,), self.dump, dtype=torch.long, device=self.device)
        renumbered[:n] = torch.where(keep, keep.long().cumsum(0) - 1, self.dump)
        for values in (self.tokens, self.depths, self.q, self.path_q, self.ranks):
            values[:n] = values[order]
        self.parents[:n] = torch.where(order == 0, -1, renumbered[self.parents[order].clamp(min=0)])
        self.ancestors[:n, :n] = self.ancestors[order][:, order]
        self.count = keep.sum()
        for level in self.levels:
            level.frontier = renumbered[level.frontier]
        self.rows = rows

    def visibility(self, prefix: int) -> torch.Tensor:
        """Bool [rows, prefix + rows] for the verification forward: each node sees the prefix, its ancestors and
        itself; rows past the tree see their own column only."""
        n = self.rows
        real = torch.arange(n, device=self.device) < self.count
        tree = self.ancestors[:n, :n] & real[:, None]
        tree.diagonal().fill_(True)
        return torch.cat([real[:, None].expand(n, prefix), tree], dim=1)

    def greedy_path(self, logits: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy verification on the device: the nodes whose every token is the target's argmax after its parent,
        root first, padded with -1 to `depth` + 1, and the bonus token (the argmax after the last of them)."""
        n = self.rows
        choice = logits[:n].argmax(dim=-1)
        real = torch.arange(n, device=self.device) < self.count
        match = real & (self.tokens[:n] == choice[self.parents[:n].clamp(min=0)])
        match[0] = True
        accepted = ~(self.ancestors[:n, :n] & ~match[None, :]).any(dim=1)
        path = torch.full((depth + 2,), -1, dtype=torch.long, device=self.device)
        path[torch.where(accepted, self.depths[:n], depth + 1)] = torch.arange(n, device=self.device)  # last: a sink
        last = path.gather(0, (accepted.sum() - 1)[None])
        return path[: depth + 1], choice.gather(0, last)

    def read(self, path: torch.Tensor, bonus: torch.Tensor) -> Readback:
        """The one read to the host: the tree's arrays, its levels' expanded nodes, their confidences and q of the
        `bonus` token, the accepted `path` and the bonus (one float64 copy: it holds every token id and the float32
        probabilities exactly)."""
        levels = self.levels
        parts = [self.count[None], self.tokens, self.parents, self.q, self.ranks,
                 *(torch.where(level.valid, level.frontier, self.dump) for level in levels),
                 *(level.dists.max(dim=-1).values for level in levels),
                 *(level.dists.index_select(1, bonus).reshape(-1) for level in levels), path, bonus]
        flat = torch.cat([p.reshape(-1).double() for p in parts]).tolist()
        lists, at = [], 0
        for part in parts:
            lists.append(flat[at:at + len(part)])
            at += len(part)
        ints = lambda values: [int(v) for v in values]  # noqa: E731
        count, tokens, parents, q, ranks = int(lists[0][0]), *lists[1:5]
        per_level = [lists[5 + i * len(levels):5 + (i + 1) * len(levels)] for i in range(3)]
        return Readback(count, ints(tokens[:count]), ints(parents[:count]), q[:count], ints(ranks[:count]),
                        [ints(nodes) for nodes in per_level[0]], *per_level[1:],
                        [int(node) for node in lists[-2] if node >= 0], int(lists[-1][0]))

    def expanded(self, back: Readback) -> Iterator[tuple[int, int, int]]:
        """(level index, row, node) of every row that expanded a node."""
        for index, nodes in enumerate(back.expanded):
            for row, node in enumerate(nodes):
                if node != self.dump:
                    yield index, row, node

    def host_tree(self, back: Readback) -> DraftTree:
        """The host tree (tree.py) from the read: the same nodes, values, confidences and draft distributions
        (device views) the host path records, and the bonus token's q."""
        tree = DraftTree(root_token=back.tokens[0])
        for node in range(1, back.count):
            tree.add(back.parents[node], back.tokens[node], back.q[node], back.ranks[node])
        for index, row, node in self.expanded(back):
            tree.confidence[node] = back.confidences[index][row]
            tree.child_dist[node] = self.levels[index].dists[row]
            tree.child_mode[node] = "topk"
            if node == back.path[-1]:
                tree.bonus_q = back.bonus_qs[index][row]
        return tree
