"""The draft model's side of an iteration: batched expansion of tree nodes on the draft's own KV cache.

The draft cache holds a prefix of the committed sequence. Tokens committed since (accepted leaves the draft never
expanded, the previous bonus) are "pending" and ride along with the root in the iteration's first draft forward.
Each later `expand` feeds one batch of tree nodes in one forward, under the same ancestor-only mask as the target.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from engine.core.steps import DynamicSteps
from engine.core.tree import DraftTree

# Turns draft logits [k, V] (float32) into the processed draft distributions q [k, V].
Processor = Callable[[torch.Tensor], torch.Tensor]
DREW_ROOT = -1  # the node a watcher sees for the draft row before the root: its q drew the root


def softmax_processor(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits, dim=-1)


class Drafter:
    def __init__(self, model, process: Processor = softmax_processor, generator: torch.Generator | None = None,
                 steps=None):
        self.model = model
        self.device = model.device
        self.process = process
        self.generator = generator  # the run's seeded generator when sampling: strategies draw children with it
        self.steps = steps if steps is not None else DynamicSteps(model)  # its forwards and cache (engine/core/steps.py)
        self.cached = 0  # committed tokens held in the draft cache
        self.forwards = 0
        self.seconds = 0.0
        # Callbacks that see every processed draft row as it is made: (nodes, q [k, V]); node DREW_ROOT is the row
        # before the root, which drew it (kept by the root forward only when someone watches and the previous token
        # is pending). The run sets them from its hooks (RunHooks.drafted); none: nothing extra is kept.
        self.watchers: list[Callable[[list[int], torch.Tensor], None]] = []

    @property
    def cache(self):
        return self.steps.cache

    # -- per iteration -------------------------------------------------------------------------------------------
    def begin(self, tree: DraftTree, committed: list[int]) -> None:
        """Start drafting `tree`; `committed` is the whole committed sequence, ending with the root."""
        assert committed[-1] == tree.root_token
        self.tree = tree
        self.root_pos = len(committed) - 1
        self.pending = committed[self.cached:-1]
        self.rows: dict[int, int] = {}  # tree node -> draft cache row
        self.forwards = 0
        self.seconds = 0.0
        self.row_counts: list[int] = []  # rows of each draft forward this iteration (the cost model prices them)

    def expand(self, nodes: list[int]) -> torch.Tensor:
        """One draft forward over `nodes`; returns their processed next-token distributions q, float32 [k, V]."""
        start = time.perf_counter()
        tree = self.tree
        if 0 not in self.rows:
            if nodes != [0]:
                raise ValueError("the root must be expanded alone, before any other node")
            logits = self._forward_root()
            self.row_counts.append(len(self.pending) + 1)
        else:
            logits = self._forward_nodes(nodes)
            self.row_counts.append(len(nodes))
        probs = self.process(logits.float())
        confidence = probs.max(dim=-1).values.tolist()  # the level's one read to the host
        self.forwards += 1
        self.seconds += time.perf_counter() - start
        for i, node in enumerate(nodes):
            tree.confidence[node] = confidence[i]
        for watch in self.watchers:
            watch(nodes, probs)
        return probs

    # -- the device draft phase (engine/core/device_draft.py): forwards whose inputs and outputs stay on the device --
    def expand_root_on_device(self) -> torch.Tensor:
        """The root's forward (with the pending tokens), its processed q [1, V]: nothing read back."""
        start = time.perf_counter()
        probs = self.process(self._forward_root().float())
        self._counted(len(self.pending) + 1, start)
        return probs

    def expand_on_device(self, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """One draft forward over device rows (visible [n, cached + n] over the draft cache's columns): their
        processed q [n, V], nothing read back. Which node a row is, the caller says with `adopt` afterwards."""
        start = time.perf_counter()
        probs = self.process(self.steps.forward_tensors(tokens, positions, visible).float())
        self._counted(len(tokens), start)
        return probs

    def adopt(self, rows: dict[int, int]) -> None:
        """The draft cache rows of the nodes a device draft phase expanded (node -> row), for `finish`."""
        self.rows.update(rows)

    def _counted(self, rows: int, start: float) -> None:
        self.row_counts.append(rows)
        self.forwards += 1
        self.seconds += time.perf_counter() - start

    def _forward_root(self) -> torch.Tensor:
        ids = self.pending + [self.tree.root_token]
        keep = 2 if self.watchers and self.pending else 1  # the pending row before the root drew the root
        logits = self.steps.forward(ids, list(range(self.cached, self.root_pos + 1)), last=keep)
        self.rows[0] = self.root_pos
        if keep == 2:
            drew_root = self.process(logits[:1].float())
            for watch in self.watchers:
                watch([DREW_ROOT], drew_root)
        return logits[-1:]

    def _forward_nodes(self, nodes: list[int]) -> torch.Tensor:
        tree = self.tree
        base = self.steps.length
        batch_col = {node: base + i for i, node in enumerate(nodes)}
        rows, cols = [], []  # each node's own column and its ancestors' (one tensor write for the batch)
        for i, node in enumerate(nodes):
            a = node
            while a > 0:
                col = batch_col.get(a, self.rows.get(a))
                if col is None:
                    raise ValueError(f"node {node}: ancestor {a} has not been expanded by the draft")
                rows.append(i)
                cols.append(col)
                a = tree.parents[a]
        visible = torch.zeros(len(nodes), base + len(nodes), dtype=torch.bool)
        visible[:, : self.root_pos + 1] = True  # committed prefix and the root
        visible[rows, cols] = True
        logits = self.steps.forward([tree.tokens[n] for n in nodes], [self.root_pos + tree.depths[n] for n in nodes],
                                    visible)
        self.rows.update(batch_col)
        return logits

    def remap(self, mapping: dict[int, int]) -> None:
        """Follow a `DraftTree.reorder`/`prune` renumbering: rows of kept nodes move to their new ids, rows of
        dropped nodes are forgotten (they stay in the cache until `finish` crops everything not accepted)."""
        self.rows = {mapping[node]: row for node, row in self.rows.items() if node in mapping}

    def finish(self, path: list[int]) -> None:
        """Keep the committed part of the draft cache: the root and the accepted nodes the draft expanded."""
        if 0 not in self.rows:
            return  # this iteration drafted nothing; the cache is untouched
        kept = []
        for node in path[1:]:
            if node not in self.rows:
                break  # a node's descendants can only have rows if it has one
            kept.append(self.rows[node])
        self.steps.keep(self.root_pos + 1, kept)
        self.cached = self.root_pos + 1 + len(kept)
