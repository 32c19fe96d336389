"""Component values built from one RunResult (final, replayed, or a partial snapshot while a run streams).

No models here: scrubbing, replays and the streamed updates all go through these functions.
"""
from __future__ import annotations

import html
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import gradio as gr
import plotly.graph_objects as go

from engine.core.trace import Comparison, RunResult
from engine.measure import gpu_tables
from treeviz.figures.charts import calibration_figure, charts_figure, cost_figure, throughput_figure
from treeviz.figures.charts_teaching import ENTROPY_NOTE, acceptance_histogram_figure, entropy_sizes
from treeviz.figures.html import badge_html, metrics_html, metrics_rows, tokens_html
from treeviz.figures.inspector import inspect
from treeviz.figures.stepthrough import stepthrough_figure
from treeviz.figures.tree_figure import run_frame, tree_figure

# the view components, in this order, after the run state, AR state, scrubber, status and download in every handler's
# outputs (RUN_OUTPUTS); handlers name the values they change and `outputs` fills the rest with "unchanged"
VIEW_NAMES = ("tree", "text", "metrics", "charts", "throughput", "badge", "node", "inspector", "inspector_plot",
              "calibration", "costs")
RUN_OUTPUTS = ("run", "ar", "scrubber", "status", "download") + VIEW_NAMES
PANEL_NAMES = ("step_plot", "acceptance")  # the teaching panels of the shown run (iteration_panels)
PENDING_BADGE = "<span class='tv-badge tv-na'>output vs AR: measured when the run ends</span>"
MEASURING_BADGE = "<span class='tv-badge tv-na'>output vs AR: measuring AR on the same prompt…</span>"


def outputs(values: dict[str, Any], names: tuple[str, ...] = RUN_OUTPUTS) -> tuple:
    """`values` by component name as a tuple in `names` order; components not named stay as they are."""
    unknown = set(values) - set(names)
    if unknown:
        raise KeyError(f"not an output here: {', '.join(sorted(unknown))}")
    return tuple(values[n] if n in values else gr.skip() for n in names)


def status_html(text: str, error: bool = False, progress: float | None = None) -> str:
    bar = ""
    if progress is not None:
        bar = f"<div class='tv-bar'><div style='width:{progress * 100:.0f}%'></div></div>"
    return f"<div class='tv-status{' err' if error else ''}'>{html.escape(text)}{bar}</div>"


def last_index(run: RunResult | None) -> int | None:
    return len(run.iterations) - 1 if run is not None and run.iterations else None


def render_views(run: RunResult | None, ar_run: RunResult | None, index: int | None,
                 stage_mode: str = "per iteration", node: Any = None) -> dict[str, Any]:
    """Every view of iteration `index` of `run` (node `node` in the inspector), by component name."""
    if run is None:
        return {"tree": tree_figure(None), "text": tokens_html(None), "metrics": "",
                "charts": charts_figure(None), "throughput": throughput_figure(None, None),
                "badge": badge_html(None), **inspector_views(None, None, None),
                "calibration": calibration_figure([]), "costs": cost_figure(None)}
    its = run.iterations
    if its:
        index = len(its) - 1 if index is None else max(0, min(int(index), len(its) - 1))
        tree = tree_figure(its[index], frame=run_frame(its))
    else:
        index, tree = None, tree_figure(None)
    comparison = run.comparison
    div = comparison.first_divergence if comparison and not comparison.exact_match else None
    return {"tree": tree, "text": tokens_html(run, selected=index, divergence=div),
            "charts": charts_figure(run, selected=index, stage_mode=stage_mode),
            **baseline_views(run, ar_run), **inspector_views(run, index, node),
            "calibration": calibration_figure([(run.strategy, run)])}


def baseline_views(run: RunResult, ar_run: RunResult | None) -> dict[str, Any]:
    """The views that change when AR's measurement arrives: metrics row, throughput bars, badge, costs."""
    return {"metrics": metrics_html(run, ar_run), "throughput": throughput_figure(run, ar_run),
            "badge": badge_html(run.comparison, sampled=not run.config.sampling.greedy, dtype=run.config.dtype),
            "costs": cost_figure(run, ar_run, gpu_tables.shipped())}


def inspector_views(run: RunResult | None, index: int | None, node: Any) -> dict[str, Any]:
    shown, summary, figure = inspect(run, index, node)
    return {"node": shown, "inspector": summary, "inspector_plot": figure}


def streamed_views(run: RunResult, frame: dict) -> dict[str, Any]:
    """The cheap part of the views for a live update: the newest tree, the text so far, the metrics row."""
    it = run.iterations[-1]
    return {"tree": tree_figure(it, frame=frame), "text": tokens_html(run, selected=it.index),
            "metrics": metrics_html(run, None)}


def run_summary(run: RunResult) -> str:
    m, cfg = run.metrics, run.config
    return (f"{run.strategy}: {m.new_tokens} tokens in {m.iterations} iterations, "
            f"{m.tokens_per_s or 0:.1f} tokens/s ({run.stop_reason or 'done'}; {cfg.dtype} on "
            f"{cfg.device})")


def save_trace(run: RunResult) -> str:
    directory = Path(tempfile.gettempdir()) / "treeviz-traces"
    directory.mkdir(exist_ok=True)
    path = directory / f"treeviz-{run.strategy}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{time.time_ns()}.json"
    run.save(path, compact=True)
    return str(path)


def compare_table(rows: list[dict]) -> dict:
    cols = ["strategy", "tokens/s", "speedup", "L̄", "ℓ̄", "acceptance", "#iterations", "new tokens", "matches AR"]

    def cell(v):
        return round(v, 3) if isinstance(v, float) else ("–" if v is None else v)
    return {"headers": cols, "data": [[cell(r.get(c)) for c in cols] for r in rows]}


def compare_row(result: RunResult, ar: RunResult) -> dict:
    row = metrics_rows(result, ar)
    comparison = result.comparison or Comparison()
    row["matches AR"] = "yes" if comparison.exact_match else f"from token {comparison.first_divergence}"
    return row


# -- the shown run's teaching panels ---------------------------------------------------------------------------------
def empty_figure(text: str, height: int = 360) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(template="plotly_white", height=height, xaxis={"visible": False}, yaxis={"visible": False},
                      margin={"l": 10, "r": 10, "t": 30, "b": 10},
                      annotations=[{"text": text, "showarrow": False, "font": {"size": 14, "color": "#666"}}])
    return fig


def iteration_panels(run, index: Any, entropy: bool) -> tuple:
    """The selected iteration step by step, the run's acceptance-length histogram, and (with the entropy switch on)
    the tree with nodes sized by the draft's entropy; the tree is left alone otherwise."""
    if run is None or not run.iterations:
        return empty_figure("pick a gallery trace or run a prompt"), acceptance_histogram_figure([]), gr.skip()
    its = run.iterations
    it = its[max(0, min(int(index or 0), len(its) - 1))]
    try:
        step = stepthrough_figure(it, run)
    except (ValueError, KeyError, StopIteration) as err:  # a hand-made trace without a root, say
        step = empty_figure(f"iteration {it.index} cannot be stepped through: {err}")
    histogram = acceptance_histogram_figure([(str(run.strategy), run)])
    return step, histogram, (shown_tree(run, index, True) if entropy else gr.skip())


def shown_tree(run, index: Any, entropy: bool) -> go.Figure:
    """The tree view of iteration `index`, its nodes sized by draft entropy when `entropy`."""
    if run is None or not run.iterations:
        return tree_figure(None)
    its = run.iterations
    it = its[max(0, min(int(index or 0), len(its) - 1))]
    if not entropy:
        return tree_figure(it, frame=run_frame(its))
    fig = tree_figure(it, frame=run_frame(its), sizes=entropy_sizes(it))
    fig.update_layout(title_text=f"{fig.layout.title.text}<br><span style='font-size:11px'>node size: "
                                 f"{ENTROPY_NOTE}</span>")
    return fig


def shown_run(run: RunResult, ar_run: RunResult | None, index: int | None, stage_mode: str,
              entropy: bool, node: Any = None) -> dict[str, Any]:
    """Every view and both teaching panels of iteration `index` (None: the last; node `node` inspected) of a
    finished run, by name: what the last update of a Run or Compare carries."""
    index = last_index(run) if index is None else index
    step, histogram, tree = iteration_panels(run, index, entropy)  # tree: the entropy tree, or "unchanged"
    views = render_views(run, ar_run, index, stage_mode, node)
    if entropy and run.iterations:
        views["tree"] = tree
    return {**views, "step_plot": step, "acceptance": histogram}
