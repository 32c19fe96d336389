"""The `auto` preset: size each iteration's tree for this machine from the cost table and the run's own acceptance.

A strategy declares one size knob (`auto_param`: a node budget, a tree size N, or a chain length K). After every
iteration the sizer asks, for each smaller size m, what that iteration would have given had the tree stopped at
its first m nodes (node ids are creation order, and a node's parent is always older, so the first m nodes form a
tree): committed tokens = the accepted path's nodes among them + the bonus; seconds = the draft forwards those
nodes needed (one per depth level, rows = the parents expanded there) + verifying m + 1 rows, from the measured
cost table (engine/costs.py), scaled by how far the window's measured draft and verify times are from the table's
predictions (the machine's speed drifts between hours; the table gives the shape, the run the scale), + the
iteration's measured overhead outside both. Over a window of recent
iterations the size m* with the highest predicted tokens/s wins, and the next tree gets room to grow past it:
size = ceil(GROWTH · m*). When the whole tree was best the size grows; when a prefix was, it shrinks toward it.
So trees settle where one more node costs more (in this machine's t(n) and c) than it is expected to return.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from engine.costs import PairCosts
from engine.metrics import cost_ratios, drift_evidence
from engine.trace import BONUS, IterationRecord

WINDOW = 12  # iterations of evidence; long enough to average acceptance, short enough to follow the text
GROWTH = 1.25  # headroom above the best observed size, so larger trees keep being tried


@dataclass
class Sample:
    """What one iteration's tree says about every smaller tree: per node (in id order) its parent and depth."""
    parents: list[int]  # parents[i] of node i; node 0 is the root
    depths: list[int]
    accepted: list[int]  # accepted node ids, root excluded, root to leaf
    first_rows: int  # rows of the iteration's first draft forward (pending tokens + root)
    draft_rows: list[int]  # rows of every draft forward actually made
    overhead_s: float  # measured seconds outside draft and verification (tree build, commit, bookkeeping)


def sample_of(record: IterationRecord) -> Sample:
    nodes = sorted((n for n in record.nodes if n.status != BONUS), key=lambda n: n.id)
    cost = record.extra.get("cost", {})
    rows = list(cost.get("draft_rows", []))
    times = record.times
    overhead = max(times.get("total", 0.0) - times.get("draft", 0.0) - times.get("verify", 0.0), 0.0)
    return Sample([n.parent for n in nodes], [n.depth for n in nodes], list(record.accepted_path[1:]),
                  rows[0] if rows else 1, rows, overhead)


def truncated(sample: Sample, m: int, costs: PairCosts, scale: tuple[float, float] = (1.0, 1.0)
              ) -> tuple[int, float]:
    """(committed tokens, predicted seconds) had the tree kept only its first m drafted nodes; `scale` multiplies the
    table's draft and verify seconds (measured ÷ predicted, from the run)."""
    drafted = len(sample.parents) - 1
    accepted = 0
    for node in sample.accepted:
        if node > m:
            break
        accepted += 1
    if m >= drafted and sample.draft_rows:
        rows = sample.draft_rows  # the whole tree: the forwards that were actually made
    else:
        levels: dict[int, set[int]] = {}
        for node in range(1, min(m, drafted) + 1):
            parent = sample.parents[node]
            levels.setdefault(sample.depths[parent], set()).add(parent)
        rows = [sample.first_rows if depth == 0 else len(parents) for depth, parents in sorted(levels.items())]
    predicted = costs.predict(rows, min(m, drafted) + 1)
    seconds = predicted["draft_s"] * scale[0] + predicted["verify_s"] * scale[1] + sample.overhead_s
    return accepted + 1, seconds


class AutoSizer:
    """Chooses a strategy's size knob before every iteration (the `auto` preset)."""

    def __init__(self, strategy, costs: PairCosts, window: int = WINDOW):
        self.strategy, self.costs = strategy, costs
        self.param = strategy.auto_param
        spec = next(p for p in strategy.params if p.name == self.param)
        self.lo, self.hi = int(max(spec.minimum or 1, 1)), int(spec.maximum or 1024)
        self.samples: deque[Sample] = deque(maxlen=window)
        self.cost_records: deque[dict] = deque(maxlen=window)  # the window's predicted and measured seconds
        self.last: dict = {}

    def scale(self) -> tuple[float, float]:
        """Measured ÷ predicted draft and verify seconds over the window (1.0 until there is evidence)."""
        ratios = cost_ratios(list(self.cost_records))
        return ratios.get("draft", 1.0), ratios.get("verify", 1.0)

    def predicted_rates(self) -> dict[int, float]:
        """Predicted tokens/s of every size m up to the largest tree observed, over the window."""
        largest = max(len(s.parents) - 1 for s in self.samples)
        scale = self.scale()
        rates = {}
        for m in range(1, max(largest, 1) + 1):
            tokens = seconds = 0.0
            for sample in self.samples:
                t, s = truncated(sample, m, self.costs, scale)
                tokens, seconds = tokens + t, seconds + s
            rates[m] = tokens / seconds
        return rates

    def observe(self, record: IterationRecord) -> int:
        """Learn from a finished iteration and set the knob for the next; returns the new value."""
        self.samples.append(sample_of(record))
        cost = drift_evidence(record)
        if cost is not None:
            self.cost_records.append(cost)
        rates = self.predicted_rates()
        best = max(rates, key=lambda m: (rates[m], -m))  # ties: the smaller tree
        value = min(max(math.ceil(GROWTH * best), self.lo), self.hi)
        self.strategy.config[self.param] = value
        self.last = {"param": self.param, "best_size": best, "next": value,
                     "predicted_tokens_per_s": rates[best], "table_scale": list(self.scale())}
        return value
