"""The draft token tree of one iteration.

Node 0 is the root: the last committed token, not yet in either KV cache. Every other node is a candidate
token conditioned on the root-to-node path. Nodes are stored in insertion order, and a node is always added
after its parent, so node order is a valid topological order: the verifier feeds `tokens` to the target as is.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine.core.reports import LookupReport, SelectorChoice


@dataclass
class DraftTree:
    root_token: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    q: list[float] = field(default_factory=list)        # draft probability of the token given its parent
    path_q: list[float] = field(default_factory=list)   # product of q along the root-to-node path
    ranks: list[int] = field(default_factory=list)      # rank of the token in the parent's draft distribution
    children: list[list[int]] = field(default_factory=list)
    # Exact (processed) draft distribution that produced each expanded node's children; sampling rules need it.
    child_dist: dict[int, torch.Tensor] = field(default_factory=dict)
    # How the children of each node were drawn: "topk" (deterministic), "iid" or "without_replacement".
    child_mode: dict[int, str] = field(default_factory=dict)
    confidence: dict[int, float] = field(default_factory=dict)  # max draft probability at expanded nodes
    # Children of a node in the order they were drawn, one entry per draw: a child that several i.i.d. draws produced
    # (merged into one node, see `add_draw`) appears once per draw. Only nodes with merged draws need an entry;
    # elsewhere the draw order is `children`. Sampling rules for i.i.d. children rely on this order being the true
    # (exchangeable) draw order, never "grouped by first appearance", which biases them.
    draws: dict[int, list[int]] = field(default_factory=dict)
    # Who proposed each node: "model" (the draft; `add`'s default), "lookup" (engine/core/lookup.py: the context), or
    # "both" (a lookup continuation through a model node); the root is "root".
    source: list[str] = field(default_factory=list)
    # What the strategy reports beside the tree (engine/core/reports.py); copied into the record.
    lookup: LookupReport | None = None      # the context lookup's work (the lookup strategy, lookup grafting)
    selector: SelectorChoice | None = None  # the delayed tree's neural selector's choice
    # Strategy-specific, JSON-able signals for this iteration (e.g. SALF's round sums); copied into the record.
    extra: dict[str, Any] = field(default_factory=dict)
    # The draft's q of the verdict's bonus token after the last accepted node, where the device draft phase read it
    # with the tree (engine/core/device_draft.py); None: the record reads it from `child_dist`.
    bonus_q: float | None = None

    def __post_init__(self):
        if not self.tokens:
            self.tokens.append(self.root_token)
            self.parents.append(-1)
            self.depths.append(0)
            self.q.append(1.0)
            self.path_q.append(1.0)
            self.ranks.append(0)
            self.children.append([])
            self.source.append("root")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_drafted(self) -> int:
        return len(self.tokens) - 1

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def add(self, parent: int, token: int, q: float, rank: int = 0) -> int:
        node = len(self.tokens)
        self.tokens.append(int(token))
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1)
        self.q.append(float(q))
        self.path_q.append(self.path_q[parent] * float(q))
        self.ranks.append(int(rank))
        self.children.append([])
        self.source.append("model")
        self.children[parent].append(node)
        return node

    def add_draw(self, parent: int, token: int, q: float, rank: int = 0) -> int:
        """Record one draw of `token` at `parent`, merging it into an existing child with that token (the merged
        node then stands for several i.i.d. draws; its subtree holds the draws of every path through it). A node's
        children come either all from `add_draw` or all from `add`."""
        child = self.child_with_token(parent, token)
        if child is None:
            child = self.add(parent, token, q, rank)
        self.draws.setdefault(parent, []).append(child)
        return child

    def draw_order(self, node: int) -> list[int]:
        """The children of `node` in draw order, a merged child repeated once per draw that produced it (a new
        list)."""
        return list(self.draws.get(node, self.children[node]))

    def multiplicity(self, node: int) -> int:
        """How many draws at its parent produced `node` (1 unless merged)."""
        parent = self.parents[node]
        order = self.draws.get(parent)
        return 1 if order is None else order.count(node)

    def path_to(self, node: int) -> list[int]:
        """Node ids from the root to `node`, both included."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def child_with_token(self, node: int, token: int) -> int | None:
        for child in self.children[node]:
            if self.tokens[child] == token:
                return child
        return None

    def ancestor_matrix(self) -> torch.Tensor:
        """Bool [n, n]: entry (i, j) is True iff j is i or an ancestor of i. Each row is a Python integer's bits (a
        node's is its parent's plus its own), unpacked in one call: a tensor write per row would cost more than the
        rest of the iteration's bookkeeping."""
        n = len(self.parents)
        masks: list[int] = []
        for i, parent in enumerate(self.parents):
            masks.append((masks[parent] if parent >= 0 else 0) | (1 << i))
        width = (n + 7) // 8
        raw = np.frombuffer(b"".join(m.to_bytes(width, "little") for m in masks), dtype=np.uint8).reshape(n, width)
        return torch.from_numpy(np.unpackbits(raw, axis=1, count=n, bitorder="little").astype(bool))

    def is_prefix_closed(self) -> bool:
        return all(p < i for i, p in enumerate(self.parents) if i > 0) and self.parents[0] == -1

    def reorder(self, order: list[int]) -> dict[int, int]:
        """Keep exactly the nodes in `order`, renumbered by their position in it; returns {old id: new id}.

        `order` must start with the root and list every node after its parent, so the new numbering stays
        topological. Works in place (the decoder and the drafter hold this object); per-node dicts are remapped.
        A drafter that expanded nodes of this tree must be told too: `drafter.remap(mapping)`.
        """
        mapping = {old: new for new, old in enumerate(order)}
        if len(mapping) != len(order) or not order or order[0] != 0:
            raise ValueError("order must list distinct nodes, starting with the root")
        for old in order[1:]:
            parent = self.parents[old]
            if mapping.get(parent, len(order)) >= mapping[old]:
                raise ValueError(f"node {old} comes before its parent {parent} (or its parent is dropped)")
        for name in ("tokens", "depths", "q", "path_q", "ranks", "source"):
            values = getattr(self, name)
            values[:] = [values[old] for old in order]
        self.parents[:] = [-1] + [mapping[self.parents[old]] for old in order[1:]]
        self.children[:] = [[mapping[c] for c in self.children[old] if c in mapping] for old in order]
        self.draws.update({k: [mapping[c] for c in v if c in mapping] for k, v in self.draws.items()})
        for name in ("child_dist", "child_mode", "confidence", "draws"):
            old_dict = getattr(self, name)
            new_dict = {mapping[k]: v for k, v in old_dict.items() if k in mapping}
            old_dict.clear()
            old_dict.update(new_dict)
        return mapping

    def prune(self, keep) -> dict[int, int]:
        """Keep only the nodes in `keep` (a prefix-closed set with the root), in their current order."""
        return self.reorder(sorted(set(keep)))
