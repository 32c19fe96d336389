"""SALF (salf-talf, Algorithm 2): batched optimal tree search that Stops At Low further gains.

Q is a capacity-N priority queue of unexpanded candidate nodes keyed by path probability pr; G is the tree, which
keeps the N best nodes. Each round pops the B best of Q into G and into a list D, sets eps = min pr in G when G is
full (else 0), keeps D's entries with pr > eps, and stops if sum pr(D) < th. Otherwise D is expanded in ONE
batched draft forward and every child of n enters Q with pr(n) q(child). The sums fall strictly from round to
round (Theorem 1), so th trades tree quality for draft forwards; th = 0 runs until D is empty and returns the top-N
nodes by path probability (SpecExec's optimal tree, Theorems 2-3).
Choices the paper leaves open: N counts drafted nodes (the root is the always-expanded first round); only each
node's top-N children are pushed (Q holds N entries, so lower ones could never survive: App. C says the same);
ties are broken towards earlier (shallower) nodes so G stays prefix-closed; nodes at max_depth stay in D (and in
the sum) but are not expanded. Nodes that G evicts are pruned at the end (ids renumbered, drafter rows remapped).
Per-round sums that drove the stop decision: tree.extra["salf_round_sums"].
"""
import heapq

import torch

from engine.strategies.base import Param, Strategy, StrategyError
from engine.strategies.sizing import SizeCost, accepted_within

MAX_ROUNDS = 4096  # a guard only: every round adds a node to G or ends the search


def replay(sample, n: int, b: int, th: float, max_depth: int) -> tuple[list[int], list[int]]:
    """SALF's rounds (build's loop) with capacity n on an observed tree instead of the draft: a node's children are
    its children there. (kept nodes, rows of each draft forward.) A smaller N than observed raises eps, so it pops and
    expands a subset of what was observed; the nodes it needs are those of highest path probability, which the
    observed tree holds."""
    children: dict[int, list[int]] = {}
    for node in range(1, sample.drafted + 1):
        children.setdefault(sample.parents[node], []).append(node)
    pr, depth = sample.path_q, sample.depths
    queue: list[tuple] = []
    kept: list[tuple] = []  # min-heap (pr, -node), as in build
    rows, batch = [], [0]
    for _ in range(MAX_ROUNDS):
        expand = [v for v in batch if depth[v] < max_depth]
        if expand:
            rows.append(sample.first_rows if expand == [0] else len(expand))
            queue = heapq.nsmallest(n, queue + [(-pr[c], c) for v in expand for c in children.get(v, [])])
        popped = []
        while queue and len(popped) < b:
            neg, node = heapq.heappop(queue)
            if len(kept) == n and (-neg, float("-inf")) <= kept[0]:
                popped.append((-neg, None))
                continue
            heapq.heappush(kept, (-neg, -node))
            if len(kept) > n:
                heapq.heappop(kept)
            popped.append((-neg, node))
        eps = kept[0][0] if len(kept) == n else 0.0
        in_g = {-entry[1] for entry in kept}
        batch = [v for p, v in popped if v is not None and p > eps and v in in_g]
        if not batch or sum(pr[v] for v in batch) < th:
            break
    return sorted(-entry[1] for entry in kept), rows


class SALF(Strategy):
    name = "salf"
    label = "SALF (optimal tree search, early stop)"
    summary = "Top-N path-probability tree grown B nodes per draft forward; stops when the batch's mass falls below th."
    params = (
        Param("n", 24, 1, 1024, 1, "N (tree size)", "nodes kept in the tree (root excluded)"),
        Param("b", 8, 1, 256, 1, "B (batch)", "nodes popped and expanded per draft forward"),
        Param("th", 0.6, 0.0, 0.999, 0.01, "th (SALF threshold)",
              "stop when the batch's path-probability sum < th; 0 = optimal tree"),
        Param("max_depth", 8, 1, 64, 1, "max depth", "nodes at this depth are not expanded (64: no limit)"),
    )
    auto_param = "n"  # the size the "auto" preset tunes from measured costs
    presets = {
        "cpu": {"n": 16, "b": 8, "th": 0.6, "max_depth": 8},
        "paper": {"n": 60, "b": 10, "th": 0.6, "max_depth": 64},
    }

    def check(self) -> None:
        c = self.settings
        if c.b > c.n:
            raise StrategyError(f"B ({c.b}) must not exceed N ({c.n}): a round pops at most N useful nodes")

    def sizes(self) -> range:
        return range(self.settings.b, super().sizes().stop)  # N < B is refused (check)

    def cost_at(self, sample, size: int) -> SizeCost:
        """N moves eps and so the stop: replay the rounds with N = size on the observed tree (`replay`)."""
        kept, rows = replay(sample, size, self.settings.b, self.settings.th, self.settings.max_depth)
        return SizeCost(len(kept), accepted_within(sample, kept), rows, len(kept) + 1)

    def build(self, drafter, tree) -> None:
        c = self.settings
        n, b, th, max_depth = c.n, c.b, c.th, c.max_depth
        queue: list[tuple] = []   # Q: (-pr, seq, parent, token, q, rank), trimmed to the N best after each round
        kept: list[tuple] = []    # G (root excluded) as a min-heap (pr, -node): evicts the latest of equal nodes
        seq = 0
        batch, sums = [0], [1.0]  # round 1: D = [root], pr = 1
        for _ in range(MAX_ROUNDS):
            expand = [node for node in batch if tree.depths[node] < max_depth]
            if expand:
                dists = drafter.expand(expand)  # all of D in one draft forward
                probs, tokens = torch.topk(dists, min(n, dists.shape[-1]), dim=-1)
                for node, dist, ps, ts in zip(expand, dists, probs.tolist(), tokens.tolist()):
                    tree.child_dist[node] = dist
                    tree.child_mode[node] = "topk"
                    pr = tree.path_q[node]
                    for rank, (p, token) in enumerate(zip(ps, ts)):
                        if p <= 0.0:
                            break
                        queue.append((-pr * p, seq, node, token, p, rank))
                        seq += 1
                queue = heapq.nsmallest(n, queue)  # Q keeps its N best entries (sorted: a valid heap)

            # Pop the B best of Q into G and D.
            popped = []
            while queue and len(popped) < b:
                neg, _, parent, token, p, rank = heapq.heappop(queue)
                if len(kept) == n and (-neg, float("-inf")) <= kept[0]:
                    popped.append((-neg, None))  # would enter a full G as its minimum and be evicted at once
                    continue
                node = tree.add(parent, token, p, rank)
                heapq.heappush(kept, (tree.path_q[node], -node))
                if len(kept) > n:
                    heapq.heappop(kept)  # evicted; pruned at the end (its descendants rank lower still)
                popped.append((tree.path_q[node], node))
            eps = kept[0][0] if len(kept) == n else 0.0
            in_g = {-entry[1] for entry in kept}
            batch = [node for pr, node in popped if node is not None and pr > eps and node in in_g]
            total = sum(tree.path_q[node] for node in batch)
            sums.append(total)
            if not batch or total < th:
                break
        tree.extra["salf_round_sums"] = sums
        mapping = tree.prune([0] + sorted(-e[1] for e in kept))
        drafter.remap(mapping)
