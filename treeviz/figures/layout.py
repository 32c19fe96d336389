"""Tidy layout of one iteration's draft tree (no tensor math, no plotting).

The tree is drawn by depth: depth is one axis, "breadth" the other. Siblings are ordered by draft probability q
(most probable first; nodes the draft never scored, e.g. an unscored bonus token, last). Leaves take consecutive
breadth slots in depth-first order and every parent sits at the midpoint of its first and last child, so the
drawing is crossing-free (at each depth the breadth order follows the parents' order) and parents are centred over
their children. The root is shifted to breadth 0 so that trees of different iterations share one frame.
"""
from __future__ import annotations

from typing import Iterable, Mapping

from engine.core.trace import NodeRecord


def sibling_key(node: NodeRecord) -> tuple:
    q, rank, status = node.q, node.rank, node.status
    # the bonus pseudo-node is the target's choice, not a draft candidate: after the draft's candidates
    return (status == "bonus", -(q if q is not None else -1.0), rank if rank is not None else 1 << 30,
            node.id)


def children_map(nodes: Iterable[NodeRecord]) -> tuple[int | None, dict[int, list[NodeRecord]]]:
    """(root id, parent id -> children sorted by q descending)."""
    root, children = None, {}
    by_id = {}
    for node in nodes:
        by_id[node.id] = node
    for node in by_id.values():
        parent = node.parent
        if parent is None or parent < 0 or parent not in by_id:
            if root is None:
                root = node.id
            continue
        children.setdefault(parent, []).append(node)
    for kids in children.values():
        kids.sort(key=sibling_key)
    return root, children


def tidy_layout(nodes: Iterable[NodeRecord]) -> dict[int, tuple[int, float]]:
    """node id -> (depth, breadth). Breadth 0 is the root; successive leaves are 1 apart."""
    nodes = list(nodes)
    root, children = children_map(nodes)
    if root is None:
        return {}
    pos: dict[int, tuple[int, float]] = {}
    next_leaf = 0.0
    # iterative post-order DFS (trees can be deep enough to trouble recursion in principle)
    stack: list[tuple[int, int, bool]] = [(root, 0, False)]
    while stack:
        node_id, depth, done = stack.pop()
        kids = children.get(node_id, [])
        if not kids:
            pos[node_id] = (depth, next_leaf)
            next_leaf += 1.0
        elif done:
            first, last = pos[kids[0].id][1], pos[kids[-1].id][1]
            pos[node_id] = (depth, (first + last) / 2.0)
        else:
            stack.append((node_id, depth, True))
            for kid in reversed(kids):
                stack.append((kid.id, depth + 1, False))
    shift = pos[root][1]
    return {k: (d, b - shift) for k, (d, b) in pos.items()}


def extent(layouts: Iterable[Mapping[int, tuple[int, float]]]) -> tuple[int, float, float]:
    """(max depth, min breadth, max breadth) over several layouts: one frame for a whole run."""
    max_depth, lo, hi = 1, -1.0, 1.0
    for lay in layouts:
        for depth, breadth in lay.values():
            max_depth = max(max_depth, depth)
            lo, hi = min(lo, breadth), max(hi, breadth)
    return max_depth, lo, hi
