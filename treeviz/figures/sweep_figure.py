"""The trade-off curves of a sweep (engine.bench.sweep): L̄, acceptance and tokens/s against the strategy's size knob,
with AR's tokens/s as a line, the cost model's prediction beside the measurement, and the measured peak marked.

Reads only the sweep's plain data (a live sweep or a precomputed assets/traces/sweeps/sweep_*.json).
"""
from __future__ import annotations

import html
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

MEASURED, PREDICTED, AR_COLOR, PEAK_COLOR = "#2980b9", "#e67e22", "#7f8c8d", "#c0392b"


def sweep_figure(sweep: dict[str, Any] | None) -> go.Figure:
    """Three panels sharing the size axis (log scale, as the sizes are spaced): L̄, acceptance, tokens/s."""
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.07, subplot_titles=(
        "L̄: tokens per target pass", "acceptance rate", "tokens/s (measured and predicted)"))
    fig.update_layout(template="plotly_white", height=400, margin={"l": 10, "r": 10, "t": 70, "b": 80},
                      legend={"orientation": "h", "y": -0.22, "x": 0, "font": {"size": 11}})
    points = (sweep or {}).get("points") or []
    if not points:
        fig.add_annotation(text="no sweep yet: pick a strategy with a size knob and press Sweep", showarrow=False,
                           xref="paper", yref="paper", x=0.5, y=0.5, font={"size": 14, "color": "#666"})
        return fig
    sizes = [p["size"] for p in points]
    _curve(fig, sizes, [p["mean_tokens_per_iter"] for p in points], 1, "L̄", MEASURED)
    _curve(fig, sizes, [p["acceptance_rate"] for p in points], 2, "acceptance", MEASURED)
    _curve(fig, sizes, [p["tokens_per_s"] for p in points], 3, "measured tokens/s", MEASURED)
    _prediction(fig, sweep, sizes)
    _ar_line(fig, sweep, sizes)
    _peak(fig, sweep)
    label = html.escape(str(sweep.get("param_label") or sweep.get("param")))
    for col in (1, 2, 3):
        fig.update_xaxes(type="log", title_text=label, tickvals=sizes, ticktext=[str(s) for s in sizes],
                         row=1, col=col)
    fig.update_yaxes(range=[0, 1.05], row=1, col=2)
    fig.update_yaxes(rangemode="tozero", row=1, col=1)
    fig.update_yaxes(rangemode="tozero", row=1, col=3)
    # the title sits below Plotly's mode bar (top right), which it would otherwise run under
    fig.update_layout(title={"text": _title(sweep), "font": {"size": 14}, "x": 0.01, "y": 0.93})
    return fig


def _title(sweep: dict[str, Any]) -> str:
    peak = sweep.get("peak")
    head = f"{html.escape(str(sweep['strategy']))}: sweeping {html.escape(str(sweep['param']))}"
    if peak is not None:
        head += f" · peak tokens/s at {sweep['param']} = {peak}"
    return head + f" · {sweep.get('max_new_tokens')} tokens per run on {html.escape(str(sweep.get('target')))}"


def _curve(fig: go.Figure, x: list, y: list, col: int, name: str, color: str, dash: str | None = None) -> None:
    fig.add_trace(go.Scatter(x=x, y=y, mode="lines+markers", name=name, showlegend=col == 3,
                             line={"color": color, "width": 2.5, "dash": dash},
                             hovertemplate=f"{name} at %{{x}}: %{{y:.3f}}<extra></extra>"), row=1, col=col)


def _prediction(fig: go.Figure, sweep: dict[str, Any], sizes: list) -> None:
    """The cost model's tokens/s beside the measurement, or a note saying why there is none."""
    predicted = [p.get("predicted_tokens_per_s") for p in sweep["points"]]
    if any(v is not None for v in predicted):
        _curve(fig, sizes, predicted, 3, "predicted tokens/s (cost table)", PREDICTED, "dash")
        return
    fig.add_annotation(text="no cost table for this pair:<br>predicted tokens/s unavailable", showarrow=False,
                       xref="x3 domain", yref="y3 domain", x=0.5, y=0.08, font={"size": 11, "color": "#888"})


def _ar_line(fig: go.Figure, sweep: dict[str, Any], sizes: list) -> None:
    ar = (sweep.get("ar") or {}).get("tokens_per_s")
    if ar:
        fig.add_trace(go.Scatter(x=[sizes[0], sizes[-1]], y=[ar, ar], mode="lines", name=f"AR {ar:.1f} tokens/s",
                                 line={"color": AR_COLOR, "width": 2, "dash": "dot"},
                                 hovertemplate="AR: %{y:.2f} tokens/s<extra></extra>"), row=1, col=3)


def _peak(fig: go.Figure, sweep: dict[str, Any]) -> None:
    """A star on the measured peak, with its speedup over AR."""
    best = next((p for p in sweep["points"] if p["size"] == sweep.get("peak")), None)
    if best is None or not best.get("tokens_per_s"):
        return
    ar = (sweep.get("ar") or {}).get("tokens_per_s")
    text = f"peak {best['tokens_per_s']:.1f} tok/s" + (f" ({best['tokens_per_s'] / ar:.2f}× AR)" if ar else "")
    # the label leans toward the middle of the axis so that a peak at either end is not cut off by the plot's edge
    sizes = [p["size"] for p in sweep["points"]]
    side = "top right" if best["size"] <= sizes[len(sizes) // 2] else "top left"
    fig.add_trace(go.Scatter(x=[best["size"]], y=[best["tokens_per_s"]], mode="markers+text", text=[text],
                             textposition=side, name="peak", showlegend=False,
                             marker={"symbol": "star", "size": 18, "color": PEAK_COLOR}), row=1, col=3)
