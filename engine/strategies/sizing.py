"""What a tree of another size would have cost and given: the pieces each strategy's `cost_at` is made of.

The `auto` sizer (engine/measure/autosize.py) keeps recent iterations as `Sample`s and asks the strategy, for each
candidate value m of its size knob, what its own construction rule would have spent at m (draft forwards and their rows,
verify rows) and which of the observed tree's nodes it would have kept (so how many accepted tokens survive). Strategies
differ: a level-by-level builder under a node budget keeps its first m nodes and pays one draft forward per level
they reach; EAGLE-2 pays depth + 1 forwards whatever N is; SALF pays rounds of B nodes; DDTree follows its top-1
chain only as deep as the kept prefixes reach.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Sample:
    """One observed iteration's tree, per node in id order (node 0 is the root)."""
    parents: list[int]
    depths: list[int]
    accepted: list[int]  # accepted node ids, root excluded, root to leaf
    first_rows: int  # rows of the iteration's first draft forward (pending tokens + root)
    draft_rows: list[int]  # rows of every draft forward actually made
    overhead_s: float  # measured seconds outside draft and verification (tree build, commit, bookkeeping)
    path_q: list[float] | None = None  # draft path probability per node (None: unknown, id order stands in)
    context: int | None = None  # committed tokens before the root (None: the cost table's own context)

    @property
    def drafted(self) -> int:
        return len(self.parents) - 1


@dataclass
class SizeCost:
    """What a strategy would have spent and got at one size, from an observed tree."""
    kept: int  # drafted nodes kept
    accepted: int  # accepted draft tokens among them
    draft_rows: list[int]  # rows of each draft forward
    verify_rows: int  # rows of the verification forward (kept nodes + the root)


def first_nodes(sample: Sample, m: int) -> list[int]:
    """The first m drafted nodes in id order: a tree, since a node's parent is always older."""
    return list(range(1, min(m, sample.drafted) + 1))


def most_probable(sample: Sample, m: int) -> list[int]:
    """The m drafted nodes of highest path probability, ties to the shallower then older node: prefix-closed (a child
    is never more probable than its parent), which is the set EAGLE-2's re-ranking and SALF's G keep at N = m."""
    if sample.path_q is None:
        return first_nodes(sample, m)
    ranked = sorted(range(1, sample.drafted + 1), key=lambda v: (-sample.path_q[v], sample.depths[v], v))
    return ranked[:m]


def accepted_within(sample: Sample, kept: list[int]) -> int:
    """Accepted tokens that a tree holding only `kept` would have accepted: the accepted path up to its first node
    that is missing (at T = 0 the target's choices do not depend on the other nodes)."""
    keep, count = set(kept), 0
    for node in sample.accepted:
        if node not in keep:
            break
        count += 1
    return count


def level_rows(sample: Sample, kept: list[int]) -> list[int]:
    """One draft forward per depth level the kept nodes' parents occupy, rows = the parents expanded there; the
    forwards actually made when every node is kept."""
    if len(kept) >= sample.drafted and sample.draft_rows:
        return list(sample.draft_rows)
    levels: dict[int, set[int]] = {}
    for node in kept:
        parent = sample.parents[node]
        levels.setdefault(sample.depths[parent], set()).add(parent)
    return [sample.first_rows if depth == 0 else len(parents) for depth, parents in sorted(levels.items())]


def by_levels(sample: Sample, m: int) -> SizeCost:
    """Level-by-level builders under a node budget (Linear, Fixed, DynaTree, DySpec): the first m nodes, one draft
    forward per level."""
    kept = first_nodes(sample, m)
    return SizeCost(len(kept), accepted_within(sample, kept), level_rows(sample, kept), len(kept) + 1)
