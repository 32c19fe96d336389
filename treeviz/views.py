"""Component values built from one RunResult (final, replayed, or a partial snapshot while a run streams).

No models here: scrubbing, replays and the streamed updates all go through these functions.
"""
from __future__ import annotations

import html
import os
import tempfile
import time
from pathlib import Path

import plotly.graph_objects as go

from engine.trace import RunResult
from treeviz import figures as F

# the six view components, in this order, in every handler's outputs
VIEW_NAMES = ("tree", "text", "metrics", "charts", "throughput", "badge")
PENDING_BADGE = "<span class='tv-badge tv-na'>output vs AR: measured when the run ends</span>"


def status_html(text: str, error: bool = False, progress: float | None = None) -> str:
    bar = ""
    if progress is not None:
        bar = f"<div class='tv-bar'><div style='width:{progress * 100:.0f}%'></div></div>"
    return f"<div class='tv-status{' err' if error else ''}'>{html.escape(text)}{bar}</div>"


def last_index(run: RunResult | None) -> int | None:
    return len(run.iterations) - 1 if run is not None and run.iterations else None


def render_views(run: RunResult | None, ar_run: RunResult | None, index: int | None,
                 stage_mode: str = "per iteration") -> tuple:
    """(tree, text, metrics, charts, throughput, badge) for iteration `index` of `run`."""
    if run is None:
        return (F.tree_figure(None), F.tokens_html(None), "", F.charts_figure(None), F.throughput_figure(None, None),
                F.badge_html(None))
    its = run.iterations
    if its:
        index = len(its) - 1 if index is None else max(0, min(int(index), len(its) - 1))
        tree = F.tree_figure(its[index], frame=F.run_frame(its))
    else:
        index, tree = None, F.tree_figure(None)
    comparison = run.comparison
    div = comparison.get("first_divergence") if comparison and not comparison.get("exact_match") else None
    return (tree, F.tokens_html(run, selected=index, divergence=div), F.metrics_html(run, ar_run, index),
            F.charts_figure(run, selected=index, stage_mode=stage_mode), F.throughput_figure(run, ar_run),
            F.badge_html(comparison, sampled=bool(run.config.get("sampling", {}).get("temperature"))))


def streamed_views(run: RunResult, frame: dict) -> tuple[go.Figure, str, str]:
    """The cheap part of the views for a live update: the newest tree, the text so far, the metrics row."""
    it = run.iterations[-1]
    return (F.tree_figure(it, frame=frame), F.tokens_html(run, selected=it.index),
            F.metrics_html(run, None, len(run.iterations) - 1))


def run_summary(run: RunResult) -> str:
    m, cfg = run.metrics, run.config
    return (f"{run.strategy}: {m['new_tokens']} tokens in {m['iterations']} iterations, "
            f"{m['tokens_per_s'] or 0:.1f} tokens/s ({run.stop_reason or 'done'}; {cfg.get('dtype')} on "
            f"{cfg.get('device')})")


def save_trace(run: RunResult) -> str:
    directory = Path(tempfile.gettempdir()) / "treeviz-traces"
    directory.mkdir(exist_ok=True)
    path = directory / f"treeviz-{run.strategy}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{id(run)}.json"
    run.save(path)
    return str(path)


def compare_table(rows: list[dict]) -> dict:
    cols = ["strategy", "tokens/s", "speedup", "L̄", "ℓ̄", "acceptance", "#iterations", "new tokens", "matches AR"]

    def cell(v):
        return round(v, 3) if isinstance(v, float) else ("–" if v is None else v)
    return {"headers": cols, "data": [[cell(r.get(c)) for c in cols] for r in rows]}


def compare_row(result: RunResult, ar: RunResult) -> dict:
    row = F.metrics_rows(result, ar)
    comparison = result.comparison or {}
    row["matches AR"] = "yes" if comparison.get("exact_match") else f"from token {comparison.get('first_divergence')}"
    return row
