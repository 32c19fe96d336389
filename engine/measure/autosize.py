"""The `auto` preset: size each iteration's tree for this machine from the cost table and the run's own acceptance.

A strategy declares one size knob (`auto_param`: a node budget, a tree size N, or a chain length K). After every
iteration the sizer asks the strategy, for each size m it accepts (`Strategy.sizes`) up to the largest tree
observed, what its own construction rule would have done at m (`Strategy.cost_at`, engine/strategies/sizing.py):
which of the observed nodes it keeps (so how many accepted tokens survive), its draft forwards and their rows, and
the verify rows. Tokens = the kept accepted nodes + the bonus; seconds = those forwards priced by the measured cost
table at the iteration's context length (engine/measure/costs.py), scaled by how far the window's measured draft and
verify times are from the table's predictions (the machine's speed drifts between hours; the table gives the shape, the
run the scale), + the iteration's measured overhead outside both, pro rata to the rows kept (tree bookkeeping grows with
the tree; charging every m the whole tree's overhead would favour large trees).
Over a window of recent iterations the size m* with the highest predicted tokens/s wins, and the next tree gets room
to grow past it: size = the smallest accepted size >= ceil(GROWTH · m*), set only through `Strategy.resize`.
When the whole tree was best the size grows; when a smaller one was, it shrinks toward it. So trees settle where one
more node costs more (in this machine's t(n) and c) than it is expected to return.

And where no tree pays at all -- the best size is predicted slower than an AR step (one token per one-row target
forward, priced by the same table and scale) -- the next REST iterations draft nothing: each is an AR step. Then a
tree is tried again, so the evidence follows the text (a run that turns repetitive may pay again). `last` says so and
why, for the page.

The sizer is a run plug-in (engine/strategies/base.py RunHooks): `auto_sizing` makes one for each run whose strategy's
preset is "auto" (the recipe, engine/recipe.py, hands it to the Decoder); it says when an iteration rests (`rests`)
and learns from every record (`recorded`), which carries its choice (`record.cost.auto`).
"""
from __future__ import annotations

import math
from collections import deque

from engine.core.trace import BONUS, IterationRecord
from engine.measure.costs import PairCosts
from engine.measure.metrics import cost_ratios, drift_evidence
from engine.strategies.base import RunHooks, RunInfo
from engine.strategies.sizing import Sample, SizeCost

WINDOW = 12  # iterations of evidence; long enough to average acceptance, short enough to follow the text
GROWTH = 1.25  # headroom above the best observed size, so larger trees keep being tried
REST = 4  # AR steps after a verdict that no tree pays, before a tree is tried again

__all__ = ["GROWTH", "WINDOW", "AutoSizer", "Sample", "auto_sizing", "predicted", "sample_of"]


def sample_of(record: IterationRecord) -> Sample:
    nodes = sorted((n for n in record.nodes if n.status != BONUS), key=lambda n: n.id)
    rows = list(record.cost.draft_rows) if record.cost is not None else []
    times = record.times
    overhead = max(times.total - times.draft - times.verify, 0.0)
    path_q = [1.0 if n.path_q is None else n.path_q for n in nodes]
    return Sample([n.parent for n in nodes], [n.depth for n in nodes], list(record.accepted_path[1:]),
                  rows[0] if rows else 1, rows, overhead, path_q, record.position)


def predicted(sample: Sample, cost: SizeCost, costs: PairCosts, scale: tuple[float, float] = (1.0, 1.0)
              ) -> tuple[int, float]:
    """(committed tokens, predicted seconds) of `cost`, the strategy's answer for one size on `sample`; `scale`
    multiplies the table's draft and verify seconds (measured ÷ predicted, from the run)."""
    seconds = costs.predict(cost.draft_rows, cost.verify_rows, sample.context)
    overhead = sample.overhead_s * cost.verify_rows / (sample.drafted + 1)
    return cost.accepted + 1, seconds["draft_s"] * scale[0] + seconds["verify_s"] * scale[1] + overhead


def auto_sizing(run: RunInfo) -> "AutoSizer | None":
    """The run's sizer where its strategy runs the `auto` preset with a draft model and the pair has a cost table;
    else None (the strategy runs its starting values)."""
    if run.strategy.auto and run.costs is not None and run.drafter is not None:
        return AutoSizer(run.strategy, run.costs)
    return None


class AutoSizer(RunHooks):
    """Chooses a strategy's size knob before every iteration (the `auto` preset)."""

    def __init__(self, strategy, costs: PairCosts, window: int = WINDOW):
        self.strategy, self.costs = strategy, costs
        self.param = strategy.auto_param
        self.samples: deque[Sample] = deque(maxlen=window)
        self.cost_records: deque = deque(maxlen=window)  # the window's predicted and measured seconds
        self.last: dict = {}
        self.rest = 0  # AR steps still to take before the next tree

    def rests(self) -> bool:
        """The next iteration drafts nothing: an AR step (no tree pays, `choose`)."""
        return self.rest > 0

    def recorded(self, record: IterationRecord) -> None:
        """Learn from the iteration and say in its record what was chosen for the next."""
        self.learn(record)
        record.cost.auto = self.last

    def scale(self) -> tuple[float, float]:
        """Measured ÷ predicted draft and verify seconds over the window (1.0 until there is evidence)."""
        ratios = cost_ratios(list(self.cost_records))
        return ratios.get("draft", 1.0), ratios.get("verify", 1.0)

    def predicted_rates(self) -> dict[int, float]:
        """Predicted tokens/s of every size the strategy accepts, up to the largest tree observed, over the window."""
        largest = max(max(s.drafted for s in self.samples), 1)
        scale, rates = self.scale(), {}
        for m in self.strategy.sizes():
            if m > largest and rates:
                break
            tokens = seconds = 0.0
            for sample in self.samples:
                t, s = predicted(sample, self.strategy.cost_at(sample, m), self.costs, scale)
                tokens, seconds = tokens + t, seconds + s
            rates[m] = tokens / seconds
        return rates

    def learn(self, record: IterationRecord) -> int:
        """Learn from a finished iteration and set the knob for the next; returns the new value. An iteration that
        drafted with the lookup alone (engine/strategies/graft.py) says nothing about the model's tree: skipped."""
        if record.lookup is not None and record.lookup.alone:
            return self.strategy.size()
        if self.rest > 0:  # an AR step this sizer asked for: no evidence about trees
            self.rest -= 1
            return self.strategy.size()
        evidence = drift_evidence(record)
        if evidence is not None:
            self.cost_records.append(evidence)
        return self.choose(sample_of(record))

    def choose(self, sample: Sample) -> int:
        """Add `sample` to the window, pick the best size and resize the strategy to the next value; where even the
        best size is predicted slower than AR, rest for REST iterations (AR steps)."""
        self.samples.append(sample)
        rates = self.predicted_rates()
        best = max(rates, key=lambda m: (rates[m], -m))  # ties: the smaller tree
        sizes = self.strategy.sizes()
        value = next((m for m in sizes if m >= math.ceil(GROWTH * best)), sizes[-1])
        self.strategy.resize(value)
        ar = self.predicted_ar_rate()
        self.rest = REST if ar > rates[best] else 0
        self.last = {"param": self.param, "best_size": best, "next": value,
                     "predicted_tokens_per_s": rates[best], "predicted_ar_tokens_per_s": ar,
                     "table_scale": list(self.scale()), "draft": "none" if self.rest else "tree",
                     "why": self.why(best, rates[best], ar)}
        return value

    def predicted_ar_rate(self) -> float:
        """Predicted tokens/s of AR steps over the window: one token per one-row target forward at each sample's
        context, scaled like the trees' verification, plus a one-row share of the measured overhead."""
        seconds = sum(self.costs.predict([], 1, s.context)["verify_s"] * self.scale()[1]
                      + s.overhead_s / (s.drafted + 1) for s in self.samples)
        return len(self.samples) / seconds

    def why(self, best: int, rate: float, ar: float) -> str:
        """One sentence for the page: the choice and the numbers behind it (c, t(n) at the best tree's size)."""
        c, t = self.costs.c, self.costs.t(best + 1)
        numbers = (f"best tree {self.param}={best}: {rate:.1f} tok/s predicted, AR {ar:.1f} tok/s "
                   f"(c = {c:.2f}, t({best + 1}) = {t:.2f})" if c is not None else f"{rate:.1f} vs AR {ar:.1f} tok/s")
        if self.rest:
            return f"drafting nothing for {self.rest} iterations (AR steps): no tree pays here; {numbers}"
        return numbers
