"""DDTree (Ringel, Romano, Algorithm 1): the B most probable prefixes of per-position draft distributions.

Given distributions q_1..q_L for the next L positions, a prefix is a rank tuple (r_1..r_d) (r_i-th most likely
token at position i) with score sum_i log q_i(r_i). A max-heap starts from (1,); popping a tuple adds its prefix to
the tree and pushes its next sibling (last rank + 1) and its first child (append rank 1). The first B pops are the
B most probable prefixes, in non-increasing order, so they form a prefix-closed tree (paper Prop. 3); only the
top-min(B, V) tokens per position can matter (Lemma 1).
DDTree's drafter is a block-diffusion model that emits q_1..q_L in one pass. Our draft is autoregressive, so q_i
is the draft's distribution along its own top-1 chain: L draft forwards of one node each. The chain nodes are in
the tree while the draft runs (the drafter keys its cache rows by node id); the other selected prefixes are added
as plain, never-expanded nodes, and the tree is renumbered in heap-pop order (topological), dropping chain nodes
that did not make the top B.
"""
import heapq
import math

import torch

from engine.strategies.base import BudgetedStrategy, Param
from engine.strategies.graft import GRAFT_PARAMS
from engine.strategies.sizing import SizeCost, accepted_within, first_nodes


def best_first_prefixes(probs: list[list[float]], budget: int) -> list[tuple[int, ...]]:
    """Algorithm 1. probs[i] = position i's probabilities sorted in non-increasing order (any length). Returns the
    `budget` rank tuples (0-based ranks) of highest product probability, in pop (non-increasing) order."""
    if not probs or budget <= 0 or not probs[0] or probs[0][0] <= 0.0:
        return []
    heap = [(-math.log(probs[0][0]), 0, (0,))]
    seq, out = 1, []
    while heap and len(out) < budget:
        neg, _, ranks = heapq.heappop(heap)
        out.append(ranks)
        d, r = len(ranks), ranks[-1]
        if r + 1 < len(probs[d - 1]) and probs[d - 1][r + 1] > 0.0:  # next sibling
            score = neg + math.log(probs[d - 1][r]) - math.log(probs[d - 1][r + 1])
            heapq.heappush(heap, (score, seq, ranks[:-1] + (r + 1,)))
            seq += 1
        if d < len(probs) and probs[d] and probs[d][0] > 0.0:  # first child
            heapq.heappush(heap, (neg - math.log(probs[d][0]), seq, ranks + (0,)))
            seq += 1
    return out


class DDTree(BudgetedStrategy):
    name = "ddtree"
    label = "DDTree (best-first prefixes)"
    summary = "The B most probable prefixes of the draft's per-position distributions along its top-1 chain."
    params = (
        Param("budget", 16, 1, 1024, 1, "B (node budget)", "drafted nodes per iteration"),
        Param("block", 5, 1, 64, 1, "L (block length)", "positions drafted = draft forwards per iteration"),
        *GRAFT_PARAMS,
    )
    auto_param = "budget"  # the size the "auto" preset tunes from measured costs
    presets = {
        "cpu": {"budget": 8, "block": 3},
        "paper": {"budget": 256, "block": 16},  # budgets 16..1024 swept; speedup peaks around 256-512 (Fig. 3)
    }

    def cost_at(self, sample, size: int) -> SizeCost:
        """Nodes are numbered in pop order, so budget `size` keeps the first `size`. The draft walks its top-1 chain
        one single-row forward per position, as deep as the kept prefixes reach plus the one forward that shows
        nothing deeper wins (build's early stop), at most L."""
        kept = first_nodes(sample, size)
        deepest = max((sample.depths[v] for v in kept), default=0)
        forwards = max(min(self.settings.block, deepest + 1, len(sample.draft_rows)), 1)
        rows = [sample.first_rows] + [1] * (forwards - 1)
        return SizeCost(len(kept), accepted_within(sample, kept), rows, len(kept) + 1)

    def build_within(self, drafter, tree, budget: int) -> None:
        block = self.settings.block
        chain, dists, probs, tokens = [0], [], [], []
        for i in range(block):
            dist = drafter.expand([chain[-1]])[0]
            p, t = torch.topk(dist, min(budget, dist.shape[-1]))
            dists.append(dist)
            probs.append(p.tolist())
            tokens.append(t.tolist())
            # If no depth-(i+1) prefix makes the top B of the prefixes known so far, no deeper one can make the
            # final top B (it would need such a parent): stop drafting early, the result is the same.
            if i + 1 < block and max(map(len, best_first_prefixes(probs, budget)), default=0) <= i:
                break
            if i + 1 < block:  # the last position's token is chosen by the heap, never expanded
                chain.append(tree.add(chain[-1], tokens[i][0], probs[i][0], 0))
        node_of = {(0,) * d: chain[d] for d in range(1, len(chain))}
        order = [0]
        for ranks in best_first_prefixes(probs, budget):
            node = node_of.get(ranks)
            if node is None:
                d, r = len(ranks), ranks[-1]
                parent = node_of[ranks[:-1]] if d > 1 else 0
                node = tree.add(parent, tokens[d - 1][r], probs[d - 1][r], r)
                node_of[ranks] = node
            order.append(node)
        expanded = set(chain)
        for node in order:  # children were picked from q_{d+1}, the chain's distribution at that depth
            if node in expanded or (tree.children[node] and tree.depths[node] < len(dists)):
                tree.child_dist[node] = dists[tree.depths[node]]
                tree.child_mode[node] = "topk"
        drafter.remap(tree.reorder(order))
