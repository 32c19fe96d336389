"""The teaching panels drawn from a run's records: draft calibration (DySpec's Hypothesis 1) and this machine's costs.

Both read only engine.trace records, so a gallery trace or an uploaded one shows them with no model loaded. The
calibration cells are engine.metrics.calibration's; the costs are the engine's per-iteration `extra["cost"]`
(predicted from the measured cost table beside measured seconds, engine/decoder.py `_cost`).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine.metrics import DRIFT_TOLERANCE, calibration, cost_drift, drift_off
from engine.trace import RunResult

SERIES_COLORS = ("#2980b9", "#e67e22", "#27ae60", "#8e44ad", "#c0392b", "#16a085", "#7f8c8d", "#d4ac0d")


def _empty(fig: go.Figure, text: str) -> go.Figure:
    fig.add_annotation(text=text, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5,
                       font={"size": 14, "color": "#666"})
    return fig


# -- calibration ---------------------------------------------------------------------------------------------------
def calibration_figure(runs: Sequence[tuple[str, RunResult]], bins: int = 10) -> go.Figure:
    """Tested nodes binned by draft probability q against the fraction accepted, one line per run, with y = x:
    a draft whose q is calibrated sits on the diagonal (what DySpec's greedy tree expansion assumes)."""
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=[0, 1], y=[0, 1], mode="lines", name="y = x (calibrated)", hoverinfo="skip",
                             line={"color": "#95a5a6", "dash": "dash", "width": 1.5}))
    tested = 0
    for i, (label, run) in enumerate(runs):
        cells = calibration(run.iterations, bins)
        if not cells:
            continue
        tested += sum(c["nodes"] for c in cells)
        fig.add_trace(go.Scatter(
            x=[c["mean_q"] for c in cells], y=[c["accepted"] for c in cells], mode="lines+markers", name=label,
            line={"color": SERIES_COLORS[i % len(SERIES_COLORS)], "width": 2},
            marker={"size": [6 + 3 * math.log2(c["nodes"]) for c in cells]},
            customdata=[[c["lo"], c["hi"], c["nodes"]] for c in cells],
            hovertemplate=(f"{label}<br>q in [%{{customdata[0]:.1f}}, %{{customdata[1]:.1f}}): mean q %{{x:.3f}}"
                           "<br>accepted %{y:.3f} of %{customdata[2]} nodes<extra></extra>")))
    title = "draft calibration: P(accepted) against draft q (DySpec Hypothesis 1)"
    fig.update_layout(title={"text": f"{title}; {tested} tested nodes", "font": {"size": 13}, "x": 0.01},
                      template="plotly_white", height=420, margin={"l": 10, "r": 10, "t": 40, "b": 10},
                      xaxis={"range": [0, 1],
                             "title": {"text": "draft probability q (bin mean; marker size ~ log nodes)"}},
                      yaxis={"range": [0, 1.02], "title": {"text": "fraction accepted"}},
                      legend={"font": {"size": 11}})
    if not tested:
        _empty(fig, "no tested draft nodes in this run (AR, or no iterations yet)")
    return fig


# -- costs ---------------------------------------------------------------------------------------------------------
def ar_seconds_per_token(run: RunResult, ar_run: RunResult | None = None) -> float | None:
    """AR's seconds per token on the same prompt: from the AR run, or from the speedup recorded with the run."""
    if ar_run is not None and ar_run.metrics.get("tokens_per_s"):
        return 1.0 / ar_run.metrics["tokens_per_s"]
    speedup = (run.comparison or {}).get("speedup_vs_ar")
    tps = run.metrics.get("tokens_per_s")
    return speedup / tps if speedup and tps else None


def cost_rows(run: RunResult) -> list[dict[str, Any]]:
    """Per iteration with a recorded cost: its index, committed tokens and the engine's cost record."""
    return [{"index": it.index, "committed": it.committed, **it.extra["cost"]}
            for it in run.iterations if isinstance(it.extra.get("cost"), dict)]


def drift_title(run: RunResult) -> str:
    """How far this run's measured times are from the cost table's, with a warning when beyond tolerance."""
    drift = run.metrics.get("cost_drift") or cost_drift(run.iterations)
    ratios = ", ".join(f"{stage} {drift[stage]:.2f}×" for stage in ("draft", "verify") if stage in drift)
    if not ratios:
        return "measured against the cost table"
    off = drift_off(drift)
    note = (f" <span style='color:#c0392b'>beyond ×{DRIFT_TOLERANCE}: the machine's speed changed since the table "
            f"was measured</span>" if off else "")
    return f"measured ÷ predicted over this run: {ratios}{note}"


def cost_figure(run: RunResult | None, ar_run: RunResult | None = None) -> go.Figure:
    """Left: verifying n tree nodes in one target forward, and the draft's forwards, against n (measured points,
    the cost table's prediction as a line; AR's one-token step for scale). Right: each iteration's draft + verify
    seconds, predicted and measured, against the break-even: the time AR takes for the tokens it committed."""
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1, column_widths=[0.45, 0.55], subplot_titles=(
        "verify n nodes, draft n rows in all (ms)", "each iteration: draft + verify vs break-even (ms)"))
    fig.update_layout(template="plotly_white", height=450, margin={"l": 10, "r": 10, "t": 75, "b": 10},
                      legend={"orientation": "h", "y": -0.18, "font": {"size": 11}})
    rows = cost_rows(run) if run is not None else []
    if not rows:
        return _empty(fig, "no cost records in this run (the engine records them when the pair's costs are measured)")
    fig.update_layout(title={"text": drift_title(run), "font": {"size": 12}, "x": 0.01})
    ms = 1000.0
    verify = sorted(rows, key=lambda r: r["verify_rows"])
    fig.add_trace(go.Scatter(x=[r["verify_rows"] for r in rows], y=[r["measured_verify_s"] * ms for r in rows],
                             mode="markers", name="verify, measured", marker={"color": "#2980b9", "size": 8},
                             hovertemplate="n = %{x}: %{y:.1f} ms<extra>verify, measured</extra>"), row=1, col=1)
    fig.add_trace(go.Scatter(x=[r["verify_rows"] for r in verify], y=[r["predicted_verify_s"] * ms for r in verify],
                             mode="lines", name="verify, predicted (cost table)", line={"color": "#1f4e79"},
                             hovertemplate="n = %{x}: %{y:.1f} ms<extra>verify, predicted</extra>"), row=1, col=1)
    drafted = [r for r in rows if r["draft_rows"]]
    if drafted:
        by_rows = sorted(drafted, key=lambda r: sum(r["draft_rows"]))
        fig.add_trace(go.Scatter(
            x=[sum(r["draft_rows"]) for r in drafted], y=[r["measured_draft_s"] * ms for r in drafted],
            mode="markers", name="draft, measured", marker={"color": "#f39c12", "size": 8, "symbol": "diamond"},
            customdata=[len(r["draft_rows"]) for r in drafted],
            hovertemplate="%{x} rows in %{customdata} forwards: %{y:.1f} ms<extra>draft, measured</extra>"),
            row=1, col=1)
        fig.add_trace(go.Scatter(
            x=[sum(r["draft_rows"]) for r in by_rows], y=[r["predicted_draft_s"] * ms for r in by_rows],
            mode="lines", name="draft, predicted", line={"color": "#b9770e", "dash": "dot"},
            hovertemplate="%{x} rows: %{y:.1f} ms<extra>draft, predicted</extra>"), row=1, col=1)
    step = ar_seconds_per_token(run, ar_run)
    if step:
        fig.add_hline(y=step * ms, line={"color": "#7f8c8d", "dash": "dash", "width": 1}, row=1, col=1,
                      annotation_text=f"AR: one token {step * ms:.0f} ms", annotation_position="top left")
    idx = [r["index"] for r in rows]
    fig.add_trace(go.Scatter(x=idx, y=[r["predicted_s"] * ms for r in rows], mode="lines+markers",
                             name="iteration, predicted", line={"color": "#8e44ad"},
                             hovertemplate="iteration %{x}: %{y:.1f} ms<extra>predicted</extra>"), row=1, col=2)
    fig.add_trace(go.Scatter(x=idx, y=[r["measured_s"] * ms for r in rows], mode="lines+markers",
                             name="iteration, measured", line={"color": "#27ae60"},
                             hovertemplate="iteration %{x}: %{y:.1f} ms<extra>measured</extra>"), row=1, col=2)
    if step:
        fig.add_trace(go.Scatter(
            x=idx, y=[r["committed"] * step * ms for r in rows], mode="lines",
            name="break-even: AR for the same tokens",
            line={"color": "#c0392b", "dash": "dash", "shape": "hvh"}, customdata=[r["committed"] for r in rows],
            hovertemplate="iteration %{x}: AR needs %{y:.1f} ms for its %{customdata} tokens<extra>break-even</extra>"),
            row=1, col=2)
    # log n: the first iteration's draft forward also reads the whole prompt, hundreds of rows
    fig.update_xaxes(title_text="n (rows, log scale)", type="log", row=1, col=1)
    fig.update_yaxes(rangemode="tozero", row=1, col=1)
    fig.update_xaxes(title_text="iteration", row=1, col=2)
    fig.update_yaxes(rangemode="tozero", row=1, col=2)
    if not step:
        fig.add_annotation(text="break-even appears once AR is measured", showarrow=False, xref="x2 domain",
                           yref="y2 domain", x=0.5, y=1.0, font={"color": "#888"})
    return fig
