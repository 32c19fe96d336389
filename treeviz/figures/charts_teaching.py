"""Teaching charts drawn from records: the acceptance-length histogram (one run, or several side by side in Compare)
and node sizes for the tree figure that show how unsure the draft was where it branched.

The counting and the entropies are engine.measure.timeline's (pure Python over the records); this module only draws.
"""
from __future__ import annotations

import html
import math
from typing import Sequence

import plotly.graph_objects as go

from engine.core.trace import TOP_K, IterationRecord, RunResult
from engine.measure.timeline import accepted_length_counts, parent_entropies
from treeviz.figures.charts import SERIES_COLORS

MAX_ENTROPY = math.log(TOP_K + 1)  # the largest a top-10 list with its rest lumped can reach
ENTROPY_NOTE = "entropy of the draft's top-10 q at the node's parent (the rest lumped: a lower bound)"


def acceptance_histogram_figure(runs: Sequence[tuple[str, RunResult]]) -> go.Figure:
    """How often 0, 1, 2, … draft tokens were accepted in an iteration, as the share of each run's iterations
    (runs of different lengths compare), grouped bars per run; hover gives the counts."""
    fig = go.Figure()
    longest = 0
    for i, (label, run) in enumerate(runs):
        counts = accepted_length_counts(run.iterations)
        if not counts:
            continue
        n = sum(counts)
        longest = max(longest, len(counts) - 1)
        fig.add_trace(go.Bar(x=list(range(len(counts))), y=[c / n for c in counts], name=html.escape(label),
                             marker_color=SERIES_COLORS[i % len(SERIES_COLORS)], customdata=counts,
                             hovertemplate=(f"{html.escape(label)}: %{{customdata}} of {n} iterations accepted "
                                            "%{x} draft tokens (%{y:.0%})<extra></extra>")))
    if not fig.data:
        fig.add_annotation(text="no iterations to count", showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5,
                           font={"size": 14, "color": "#666"})
    fig.update_layout(
        title={"text": "accepted draft tokens per iteration (bonus excluded)", "font": {"size": 13}, "x": 0.01},
        template="plotly_white", barmode="group", height=340, margin={"l": 10, "r": 10, "t": 40, "b": 10},
        xaxis={"title": {"text": "draft tokens accepted in one iteration"}, "dtick": 1, "range": [-0.6, longest + 0.6]},
        yaxis={"title": {"text": "share of iterations"}, "tickformat": ".0%", "rangemode": "tozero"},
        legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 1, "xanchor": "right"})
    return fig


def entropy_sizes(iteration: IterationRecord, smallest: float = 9.0, largest: float = 26.0) -> dict[int, float]:
    """Marker size per node id from the draft's entropy at the node's parent (engine.measure.timeline.parent_entropies):
    big where the draft was unsure, small where it was sure. The scale is fixed, not per tree, so sizes compare across
    iterations: 0 nats -> `smallest`, MAX_ENTROPY (ten equal tokens plus an equal rest) -> `largest`. A node with no
    entropy (the root, a parent the draft did not expand) gets the middle size. ENTROPY_NOTE is the caption."""
    middle = (smallest + largest) / 2
    return {node_id: middle if h is None else smallest + (largest - smallest) * min(h / MAX_ENTROPY, 1.0)
            for node_id, h in parent_entropies(iteration).items()}
