"""DySpec (Xiong et al.): greedy heap expansion of the token tree by estimated acceptance.

A "slot" is the next draw at a position: the r-th child of node u. Its value is P(slot reached) x estimated
acceptance of the token drawn there. With top-k children and Hypothesis 1 (acceptance ~ draft probability), the
rank-r child of u is reached iff u is accepted and ranks < r were rejected, P = A(u) (1 - sum_{j<r} q_j), and is
then accepted with the residual probability q_r / (1 - sum_{j<r} q_j): value = A(u) q_r, the child's path probability.
Taking a slot adds its node and pushes two slots: the node's first child (value A(v) q_v(1), needs v's draft
distribution) and its next sibling (value A(u) q_{r+1}). Values popped are non-increasing, so the first `budget`
pops are the optimal tree under the surrogate (paper App. D).
Batching: a first-child slot whose node the draft has not expanded yet sits in the heap at its upper bound A(v)
(q <= 1). When such a slot reaches the top, ONE draft forward expands every pending node that could still be
taken, plus the nodes the greedy would take next if no pending slot won (created ahead, dropped if never taken),
and the pending slots re-enter at their true values. The pop order is exactly the unbatched greedy order; the
forwards are about one per tree level instead of one per node.
Threshold variant (paper §4.4, App. A.2; the "cpu" preset): layer by layer, take every slot whose value exceeds
`threshold` (best first under the budget), one draft forward per layer.
Optional DFS node order (App. C) renumbers the finished tree depth-first; DFS preorder is still topological.
The expansion order's slot values go to tree.extra["dyspec_values"] (node ids in tree.extra["dyspec_order"]).
"""
import heapq
from bisect import bisect_right

import torch

from engine.strategies.base import BudgetedStrategy, Param, StrategyError
from engine.strategies.graft import GRAFT_PARAMS


def dfs_order(tree) -> list[int]:
    """Depth-first preorder, children in insertion (rank) order: parent before child, subtrees contiguous."""
    order, stack = [], [0]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(tree.children[node]))
    return order


class DySpec(BudgetedStrategy):
    name = "dyspec"
    label = "DySpec (greedy heap)"
    summary = "Greedy best-first expansion of slots valued P(reached) x draft probability, under a node budget."
    params = (
        Param("budget", 24, 1, 1024, 1, "budget (tree size)", "maximum drafted nodes per iteration"),
        Param("max_depth", 6, 1, 64, 1, "max depth", "no slot below this depth"),
        Param("threshold_variant", True, label="threshold variant",
              help="layer by layer: expand every slot whose value exceeds the threshold (one draft forward per layer)"),
        Param("threshold", 0.02, 0.0, 1.0, 0.001, "threshold", "threshold variant: minimum slot value"),
        Param("dfs_order", False, label="DFS node order", help="renumber the tree depth-first (block-sparse masks)"),
        *GRAFT_PARAMS,
    )
    auto_param = "budget"  # the size the "auto" preset tunes from measured costs
    presets = {
        # On a CPU every draft forward counts: the paper's practical layer-by-layer version.
        "cpu": {"budget": 8, "max_depth": 6, "threshold_variant": True, "threshold": 0.02, "dfs_order": False},
        # The paper's trees hold 64 nodes (768 with threshold 0.001 under CPU offloading); it states no depth limit.
        "paper": {"budget": 64, "max_depth": 32, "threshold_variant": False, "threshold": 0.001, "dfs_order": False},
    }

    def check(self) -> None:
        c = self.settings
        if c.threshold_variant and c.threshold >= 1.0:
            raise StrategyError(f"threshold = {c.threshold}: no slot value exceeds 1, the tree would be empty; "
                                "use a threshold below 1")

    def build_within(self, drafter, tree, budget: int) -> None:
        c = self.settings
        build = self._threshold if c.threshold_variant else self._greedy
        values = build(drafter, tree, budget)
        tree.extra["dyspec_values"] = values
        order = list(range(1, len(tree)))  # node ids follow the expansion order
        if c.dfs_order and len(tree) > 2:
            mapping = tree.reorder(dfs_order(tree))
            drafter.remap(mapping)
            order = [mapping[n] for n in order]
        tree.extra["dyspec_order"] = order

    def _sorted_children(self, tree, nodes, dists, k):
        """Top-k (prob, token) lists per expanded node; also records the node's child distribution."""
        k = min(k, dists.shape[-1])
        probs, tokens = torch.topk(dists, k, dim=-1)
        out = {}
        for node, dist, p, t in zip(nodes, dists, probs.tolist(), tokens.tolist()):
            tree.child_dist[node] = dist
            tree.child_mode[node] = "topk"
            out[node] = (p, t)
        return out

    # -- the exact greedy (Algorithm 1), with batched draft forwards ---------------------------------------------
    def _greedy(self, drafter, tree, budget: int) -> list[float]:
        max_depth = self.settings.max_depth
        ranked = self._sorted_children(tree, [0], drafter.expand([0]), budget)  # node -> (probs, tokens)
        # Heap entries: (-value, seq, parent, rank). rank = -1 marks a pending first-child slot of an unexpanded
        # node `parent`, valued at its upper bound path_q(parent) since q <= 1.
        heap, seq = [], 0
        pending: set[int] = set()
        node_at: dict[tuple[int, int], int] = {}  # slot -> node, for nodes created ahead to be expanded early
        taken, values = [], []

        def push(value, parent, rank):
            nonlocal seq
            if value > 0.0:
                heapq.heappush(heap, (-value, seq, parent, rank))
                seq += 1

        push(ranked[0][0][0], 0, 0)
        while heap and len(taken) < budget:
            neg, _, parent, rank = heap[0]
            if rank < 0:  # the best slot needs a distribution the draft has not computed yet
                self._expand(drafter, tree, heap, pending, ranked, node_at, budget - len(taken), push)
                continue
            heapq.heappop(heap)
            probs, tokens = ranked[parent]
            node = node_at.pop((parent, rank), None)
            if node is None:
                node = tree.add(parent, tokens[rank], probs[rank], rank)
            taken.append(node)
            values.append(-neg)
            if rank + 1 < len(probs):  # next sibling: reached only if this node is rejected
                push(tree.path_q[parent] * probs[rank + 1], parent, rank + 1)
            if tree.depths[node] < max_depth:  # first child: reached only if this node is accepted
                if node in ranked:
                    push(tree.path_q[node] * ranked[node][0][0], node, 0)
                else:
                    pending.add(node)
                    push(tree.path_q[node], node, -1)
        # Nodes created ahead but never taken go; ids follow the expansion order (parents are taken first).
        drafter.remap(tree.reorder([0] + taken))
        return values

    def _expand(self, drafter, tree, heap, pending, ranked, node_at, room, push):
        """One draft forward over (a) every pending node whose first child could still be taken: fewer than `room`
        known slots beat its upper bound, and each of those is taken first; (b) the nodes the greedy would take
        next if no pending slot won, created ahead so that their distributions are ready when they are taken
        (without this, a flat draft costs one forward per node). Neither changes the pop order."""
        max_depth = self.settings.max_depth
        known = sorted(-e[0] for e in heap if e[3] >= 0)
        nodes = [n for n in sorted(pending) if len(known) - bisect_right(known, tree.path_q[n]) < room]
        top = heap[0][2]
        if top not in nodes:  # cannot happen (no known slot beats the top), but never loop without progress
            nodes.append(top)
        sim = [e for e in heap if e[3] >= 0]
        heapq.heapify(sim)
        for _ in range(room):
            if not sim:
                break
            _, s, parent, rank = heapq.heappop(sim)
            probs, tokens = ranked[parent]
            node = node_at.get((parent, rank))
            if node is None:
                node = node_at[(parent, rank)] = tree.add(parent, tokens[rank], probs[rank], rank)
            if tree.depths[node] < max_depth and node not in ranked:
                nodes.append(node)
            if rank + 1 < len(probs) and probs[rank + 1] > 0.0:
                heapq.heappush(sim, (-tree.path_q[parent] * probs[rank + 1], s, parent, rank + 1))
        ranked.update(self._sorted_children(tree, nodes, drafter.expand(nodes), room))
        expanded = set(nodes) & pending
        pending.difference_update(expanded)
        heap[:] = [e for e in heap if not (e[3] < 0 and e[2] in expanded)]
        heapq.heapify(heap)
        for node in expanded:
            push(tree.path_q[node] * ranked[node][0][0], node, 0)

    # -- the threshold variant (Appendix A.2): one draft forward per layer ----------------------------------------
    def _threshold(self, drafter, tree, budget: int) -> list[float]:
        threshold = self.settings.threshold
        frontier, values = [0], []
        while frontier and tree.num_drafted < budget:
            room = budget - tree.num_drafted
            ranked = self._sorted_children(tree, frontier, drafter.expand(frontier), room)
            slots = []
            for node in frontier:
                for rank, (p, token) in enumerate(zip(*ranked[node])):
                    value = tree.path_q[node] * p
                    if value <= threshold:
                        break  # sorted: every later sibling is below the threshold too
                    slots.append((-value, node, rank, token, p))
            slots.sort()
            added = []
            for neg, node, rank, token, p in slots[:room]:
                added.append(tree.add(node, token, p, rank))
                values.append(-neg)
            # A child of v is worth at most path_q(v): expand v only if that can clear the threshold.
            frontier = [v for v in added if tree.depths[v] < self.settings.max_depth and tree.path_q[v] > threshold]
        return values
