"""The run's charts, drawn from its records: per-iteration charts, throughput beside AR, and the teaching panels —
draft calibration (DySpec's Hypothesis 1) and this machine's costs.

All read only engine.core.trace records, so a gallery trace or an uploaded one shows them with no model loaded. The
run-level numbers are the engine's (RunResult.metrics); the calibration cells are engine.measure.metrics.calibration's;
the costs are the engine's per-iteration `IterationRecord.cost` (predicted from the measured cost table beside measured
seconds), and, where a GPU cost table is shipped for the run's models (engine/measure/gpu_tables.py, assets/gpu/),
the same trees priced on that GPU, labelled as a prediction with the GPU's name and the table's date.
"""
from __future__ import annotations

import html
import math
import textwrap
from dataclasses import asdict
from typing import Any, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine.core.trace import RunResult
from engine.measure.gpu_tables import GpuTable, Prediction, find, predict
from engine.measure.metrics import DRIFT_TOLERANCE, calibration, cost_drift, drift_off
from treeviz.figures.html import ar_source_text

# -- per-run charts ------------------------------------------------------------------------------------------------
STAGE_COLORS = {"draft": "#f39c12", "build": "#9b59b6", "verify": "#2980b9", "commit": "#7f8c8d", "record": "#bdc3c7"}


def charts_figure(run: RunResult | None, selected: int | None = None, stage_mode: str = "per iteration") -> go.Figure:
    """2x2: tokens per iteration with the run's L̄; acceptance per iteration; per-depth acceptance; stage times.
    Per-iteration series come from the records, every run-level number from run.metrics (the engine's)."""
    fig = make_subplots(rows=2, cols=2, horizontal_spacing=0.1, vertical_spacing=0.2, subplot_titles=(
        "L: tokens committed per iteration", "acceptance rate per iteration",
        "per-depth acceptance P(ℓ ≥ d)", "stage time (ms)"))
    its = run.iterations if run is not None else []
    if its:
        _add_iteration_charts(fig, run, stage_mode)
        if selected is not None:
            for row, col in ((1, 1), (1, 2)) + (((2, 2),) if stage_mode != "total" else ()):
                fig.add_vline(x=selected, line={"color": "#e74c3c", "width": 1.5, "dash": "dot"}, row=row, col=col)
        fig.update_layout(barmode="stack")
        fig.update_yaxes(range=[0, 1.05], row=1, col=2)
        fig.update_yaxes(range=[0, 1.05], row=2, col=1)
        fig.update_xaxes(title_text="iteration", row=1, col=1)
        fig.update_xaxes(title_text="iteration", row=1, col=2)
        fig.update_xaxes(title_text="depth d", dtick=1, row=2, col=1)
    fig.update_layout(template="plotly_white", height=520, margin={"l": 10, "r": 10, "t": 40, "b": 10},
                      legend={"font": {"size": 10}}, showlegend=True)
    return fig


def _add_iteration_charts(fig: go.Figure, run: RunResult, stage_mode: str) -> None:
    its, m = run.iterations, run.metrics
    idx = [it.index for it in its]
    fig.add_trace(go.Bar(x=idx, y=[it.committed for it in its], name="L (this iteration)", marker_color="#7fb3d5",
                         hovertemplate="iteration %{x}: %{y} tokens<extra></extra>"), row=1, col=1)
    fig.add_trace(go.Scatter(x=[idx[0], idx[-1]], y=[m.mean_tokens_per_iter] * 2, mode="lines",
                             name=f"L̄ = {m.mean_tokens_per_iter:.2f} (run)", line={"color": "#1f4e79", "width": 2.5},
                             hovertemplate="L̄ = %{y:.2f}<extra></extra>"), row=1, col=1)
    fig.add_trace(go.Scatter(x=idx, y=[it.accepted / it.drafted if it.drafted else None for it in its],
                             mode="lines+markers", name="acceptance rate", line={"color": "#27ae60"},
                             connectgaps=False, hovertemplate="iteration %{x}: %{y:.2f}<extra></extra>"), row=1, col=2)
    depth = m.per_depth_acceptance
    if depth:
        fig.add_trace(go.Bar(x=list(range(1, len(depth) + 1)), y=depth, name="P(ℓ ≥ d)", marker_color="#16a085",
                             hovertemplate="depth %{x}: %{y:.2f}<extra></extra>"), row=2, col=1)
    for stage, color in STAGE_COLORS.items():
        if stage_mode == "total":
            x, y = ["run"], [getattr(m.stage_s, stage) * 1000]
        else:
            x, y = idx, [getattr(it.times, stage) * 1000 for it in its]
        fig.add_trace(go.Bar(x=x, y=y, name=stage, marker_color=color, legendgroup="stage",
                             hovertemplate=f"{stage}: %{{y:.1f}} ms<extra></extra>"), row=2, col=2)


def throughput_figure(run: RunResult | None, ar_run: RunResult | None) -> go.Figure:
    """Tokens/s of the run beside AR on the same prompt in the same session, with the speedup."""
    fig = go.Figure()
    names, values, colors = [], [], []
    tps = run.metrics.tokens_per_s if run is not None else None
    speedup = run.comparison.speedup_vs_ar if run is not None and run.comparison is not None else None
    if ar_run is not None and ar_run.metrics.tokens_per_s:
        names.append("AR")
        values.append(ar_run.metrics.tokens_per_s)
        colors.append("#95a5a6")
    elif speedup and tps and run.strategy != "ar":
        names.append("AR (recorded)")  # a replayed trace: AR's rate from the speedup stored with it
        values.append(tps / speedup)
        colors.append("#95a5a6")
    if tps and run.strategy != "ar":
        names.append(str(run.strategy))
        values.append(tps)
        colors.append("#2980b9")
    fig.add_trace(go.Bar(x=values, y=names, orientation="h", marker_color=colors,
                         text=[f"{v:.1f} tok/s" for v in values], textposition="auto",
                         hovertemplate="%{y}: %{x:.2f} tokens/s<extra></extra>"))
    title = "throughput (tokens/s)"
    if len(values) == 2 and values[0] > 0:
        ar_steps = ar_run.config.steps if ar_run is not None else "recorded"
        title += f": speedup {values[1] / values[0]:.2f}× over AR ({ar_steps})"
    elif run is not None and ar_run is None and run.strategy != "ar":
        title += " (AR not measured yet)"
    source = ar_source_text(run.comparison) if run is not None and len(values) == 2 else ""
    if source:
        title += f"<br><span style='font-size:11px;color:#6b7280'>{source}</span>"
    fig.update_layout(title={"text": title, "font": {"size": 13}, "x": 0.01}, template="plotly_white",
                      height=170 + (16 if source else 0), showlegend=False,
                      margin={"l": 10, "r": 10, "t": 52 if source else 36, "b": 24},
                      xaxis={"rangemode": "tozero"})
    return fig


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
    if ar_run is not None and ar_run.metrics.tokens_per_s:
        return 1.0 / ar_run.metrics.tokens_per_s
    speedup = run.comparison.speedup_vs_ar if run.comparison is not None else None
    tps = run.metrics.tokens_per_s
    return speedup / tps if speedup and tps else None


def cost_rows(run: RunResult) -> list[dict[str, Any]]:
    """Per iteration with a recorded cost: its index, committed tokens and the engine's cost record."""
    return [{"index": it.index, "committed": it.committed, **asdict(it.cost)}
            for it in run.iterations if it.cost is not None]


def drift_title(run: RunResult) -> str:
    """How far this run's measured times are from the cost table's, with a warning when beyond tolerance."""
    drift = run.metrics.cost_drift or cost_drift(run.iterations)
    ratios = ", ".join(f"{stage} {drift[stage]:.2f}×" for stage in ("draft", "verify") if stage in drift)
    if not ratios:
        return "measured against the cost table"
    off = drift_off(drift)
    note = (f" <span style='color:#c0392b'>beyond ×{DRIFT_TOLERANCE}: the machine's speed changed since the table "
            f"was measured</span>" if off else "")
    return f"measured ÷ predicted over this run: {ratios}{note}"


NO_GPU_TABLE = ("GPU: no GPU cost table is shipped (assets/gpu/ holds none), so nothing here predicts a GPU; "
                "`python -m scripts.gpu_check` on a GPU measures one (docs/gpu.md)")


def gpu_prediction(run: RunResult, tables: Sequence[GpuTable]) -> tuple[GpuTable | None, Prediction | None]:
    """The shipped table for the run's models and the run's own trees priced by it (None, None: no table fits)."""
    table = find(list(tables), run.config.target, run.config.draft)
    if table is None or not run.iterations:
        return table, None
    return table, predict(table, run.iterations)


def gpu_note(run: RunResult, tables: Sequence[GpuTable]) -> str:
    """One plain line: what this run's trees would cost on the GPU of a shipped table (its verify rows and draft
    forwards from the run's records, priced by the table: a prediction, with the GPU's name and date), or why
    there is no such line."""
    if not tables:
        return NO_GPU_TABLE
    table, prediction = gpu_prediction(run, tables)
    if table is None:
        models = f"{run.config.target} + {run.config.draft or 'no draft'}"
        return (f"GPU: tables are shipped for {', '.join(t.pair for t in tables)}; none for this run's models "
                f"({models})")
    if prediction is None:
        return f"GPU: {table.label}: no iterations to price yet"
    text = (f"{table.label} ({table.steps}, {table.dtype}, shapes {table.pair}): these {prediction.iterations} "
            f"iterations would take {prediction.seconds * 1e3:.1f} ms there for their {prediction.tokens} tokens, "
            f"{prediction.speedup:.2f}× AR's one-row step ({prediction.ar_seconds * 1e3:.1f} ms for the same tokens)")
    if table.overhead_s:
        text += f"; {table.overhead_s * 1e3:.2f} ms of measured overhead per iteration included"
    if prediction.estimated:
        text += (f"; {prediction.estimated} iterations have no cost record, their rows are estimated from their "
                 "trees")
    return text


COST_TITLE_LINE_PX = 17  # one line of the cost panel's 12 px title
COST_TITLE_TOP_PX = 12   # the title's first line below the figure's top edge
COST_SUBPLOT_TITLES_PX = 36  # the two subplot titles above the plots, below the last title line
COST_PLOTS_PX = 375      # the plots, their axes and the legend: the figure's height below the top margin


def cost_figure(run: RunResult | None, ar_run: RunResult | None = None,
                gpu_tables: Sequence[GpuTable] | None = None) -> go.Figure:
    """Left: verifying n tree nodes in one target forward, and the draft's forwards, against n (measured points,
    the cost table's prediction as a line; AR's one-token step for scale). Right: each iteration's draft + verify
    seconds, predicted and measured, against the break-even: the time AR takes for the tokens it committed. With
    `gpu_tables` (the shipped GPU tables, maybe none) the title ends with `gpu_note`, and where a table fits the
    run, its price of each iteration is a line on the right."""
    note = "" if gpu_tables is None or run is None else gpu_note(run, gpu_tables)
    gpu = [html.escape(line) for line in textwrap.wrap(note, 130, break_on_hyphens=False)]
    rows = cost_rows(run) if run is not None else []
    fig = _cost_frame(([drift_title(run)] if rows else []) + gpu)
    if not rows:
        return _empty(fig, "no cost records in this run (the engine records them when the pair's costs are measured)")
    step = ar_seconds_per_token(run, ar_run)
    _add_row_costs(fig, rows, step)
    _add_iteration_costs(fig, run, rows, step, gpu_tables)
    return fig


def _cost_frame(title: list[str]) -> go.Figure:
    """The cost panel's two subplots under `title`, one line each, pinned to the figure's top edge with the top
    margin grown by a line per line: a title centred in the margin (plotly's default) runs into the subplot
    titles once the GPU note wraps. The height stays at one line's for an untitled panel, so it does not jump."""
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1, column_widths=[0.45, 0.55], subplot_titles=(
        "verify n nodes, draft n rows in all (ms)", "each iteration: draft + verify vs break-even (ms)"))
    top = COST_TITLE_TOP_PX + COST_TITLE_LINE_PX * max(len(title), 1) + COST_SUBPLOT_TITLES_PX
    fig.update_layout(template="plotly_white", height=top + COST_PLOTS_PX,
                      margin={"l": 10, "r": 10, "t": top, "b": 10},
                      legend={"orientation": "h", "y": -0.18, "font": {"size": 11}})
    if title:
        fig.update_layout(title={"text": "<br>".join(title), "font": {"size": 12}, "x": 0.01, "xanchor": "left",
                                 "yref": "container", "y": 1.0, "yanchor": "top",
                                 "pad": {"t": COST_TITLE_TOP_PX}})
    return fig


def _add_row_costs(fig: go.Figure, rows: list[dict[str, Any]], step: float | None) -> None:
    """The left plot: verify and draft seconds against their row counts, measured and predicted; AR's step."""
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
    if step:
        fig.add_hline(y=step * ms, line={"color": "#7f8c8d", "dash": "dash", "width": 1}, row=1, col=1,
                      annotation_text=f"AR: one token {step * ms:.0f} ms", annotation_position="top left")
    # log n: the first iteration's draft forward also reads the whole prompt, hundreds of rows
    fig.update_xaxes(title_text="n (rows, log scale)", type="log", row=1, col=1)
    fig.update_yaxes(rangemode="tozero", row=1, col=1)


def _add_iteration_costs(fig: go.Figure, run: RunResult, rows: list[dict[str, Any]], step: float | None,
                         gpu_tables: Sequence[GpuTable] | None) -> None:
    """The right plot: each iteration's seconds, predicted and measured, the shipped GPU table's price of it where
    one fits, and the break-even (AR's time for the tokens the iteration committed) once AR is measured."""
    ms = 1000.0
    idx = [r["index"] for r in rows]
    fig.add_trace(go.Scatter(x=idx, y=[r["predicted_s"] * ms for r in rows], mode="lines+markers",
                             name="iteration, predicted", line={"color": "#8e44ad"},
                             hovertemplate="iteration %{x}: %{y:.1f} ms<extra>predicted</extra>"), row=1, col=2)
    fig.add_trace(go.Scatter(x=idx, y=[r["measured_s"] * ms for r in rows], mode="lines+markers",
                             name="iteration, measured", line={"color": "#27ae60"},
                             hovertemplate="iteration %{x}: %{y:.1f} ms<extra>measured</extra>"), row=1, col=2)
    table, prediction = gpu_prediction(run, gpu_tables) if gpu_tables else (None, None)
    if prediction is not None:
        fig.add_trace(go.Scatter(
            x=[it.index for it in run.iterations], y=[s * ms for s in prediction.per_iteration], mode="lines",
            name=f"iteration, {table.label}", line={"color": "#16a085", "dash": "dot"},
            hovertemplate="iteration %{x}: %{y:.2f} ms<extra>" + html.escape(table.gpu) + "</extra>"), row=1, col=2)
    fig.update_xaxes(title_text="iteration", row=1, col=2)
    fig.update_yaxes(rangemode="tozero", row=1, col=2)
    if not step:
        fig.add_annotation(text="break-even appears once AR is measured", showarrow=False, xref="x2 domain",
                           yref="y2 domain", x=0.5, y=1.0, font={"color": "#888"})
        return
    fig.add_trace(go.Scatter(
        x=idx, y=[r["committed"] * step * ms for r in rows], mode="lines", name="break-even: AR for the same tokens",
        line={"color": "#c0392b", "dash": "dash", "shape": "hvh"}, customdata=[r["committed"] for r in rows],
        hovertemplate="iteration %{x}: AR needs %{y:.1f} ms for its %{customdata} tokens<extra>break-even</extra>"),
        row=1, col=2)
