"""Take it to class: the race, one iteration step by step and the run's draft trees as one standalone HTML page.

plotly.js is written into the page once, inline, so the file opens from a USB stick with no server and no network;
every figure keeps its animation frames and play buttons (nothing plays until clicked).
"""
from __future__ import annotations

import html
from pathlib import Path
from typing import Sequence

import plotly.graph_objects as go
import plotly.io as pio

from engine.core.trace import IterationRecord, RunResult
from treeviz.figures.race import NOTE, race_figure
from treeviz.figures.stepthrough import stepthrough_figure, teaching_iteration
from treeviz.figures.tree_figure import label_chars, run_frame, tree_figure, tree_traces

MAX_REPLAY_FRAMES = 200  # a page for class, not an archive: longer runs keep their first iterations


def tree_replay_figure(run: RunResult, max_frames: int = MAX_REPLAY_FRAMES) -> go.Figure:
    """The run's draft trees, one per iteration, as animation frames on one fixed frame (the live view's figure).
    Frames replace traces by position, so every frame carries the same slots, one per kind of trace (edge kind,
    outcome, with or without q); a kind an iteration lacks is an empty trace of the same name."""
    its = run.iterations[:max_frames]
    if not its:
        return tree_figure(None)
    frame = run_frame(its)
    per_iteration = [{_slot(t): t for t in tree_traces(it, chars=label_chars(frame["x"]))} for it in its]
    slots = list(dict.fromkeys(key for traces in per_iteration for key in traces))
    frames = [go.Frame(name=f"i{it.index}", data=[traces.get(key) or _empty(key) for key in slots],
                       layout={"title": {"text": tree_figure(it, frame).layout.title.text}})
              for it, traces in zip(its, per_iteration)]
    fig = tree_figure(its[0], frame)
    fig.data = []
    fig.add_traces(list(frames[0].data))
    fig.frames = frames
    step = {"frame": {"duration": 0, "redraw": True}, "mode": "immediate", "transition": {"duration": 0}}
    fig.update_layout(
        margin={"b": 160}, height=(fig.layout.height or 500) + 70, uirevision=None,
        updatemenus=[{"type": "buttons", "direction": "left", "showactive": False, "x": 0, "y": -0.32,
                      "xanchor": "left", "yanchor": "top", "buttons": [
                          {"label": "▶ play", "method": "animate",
                           "args": [None, {**step, "frame": {"duration": 900, "redraw": True}, "fromcurrent": True}]},
                          {"label": "❚❚ pause", "method": "animate",
                           "args": [[None], {**step, "frame": {"duration": 0, "redraw": False}}]}]}],
        sliders=[{"active": 0, "x": 0.2, "len": 0.8, "y": -0.3, "yanchor": "top", "pad": {"t": 0},
                  "currentvalue": {"prefix": "iteration "},
                  "steps": [{"label": str(it.index), "method": "animate", "args": [[f"i{it.index}"], step]}
                            for it in its]}])
    return fig


def _slot(trace: go.Scatter) -> tuple[str, bool]:
    """A trace's kind: its name (edge kind or outcome) and whether its nodes carry q (filled on the colour axis)."""
    return trace.name, trace.marker.coloraxis is not None


def _empty(key: tuple[str, bool]) -> go.Scatter:
    return go.Scatter(x=[], y=[], name=key[0], mode="markers", showlegend=False, hoverinfo="skip")


def teaching_html(race_runs: Sequence[tuple[str, RunResult]] | None, run: RunResult | None,
                  iteration: IterationRecord | None = None, title: str = "treeviz: speculative decoding, in class"
                  ) -> str:
    """One self-contained page: the race (when race_runs are given), `iteration` of `run` step by step (default: the
    treeviz.figures.stepthrough.teaching_iteration's choice) and the replay of `run`'s trees. plotly.js is inlined
    once."""
    sections: list[tuple[str, str, go.Figure]] = []
    if race_runs:
        sections.append(("tv-race", f"The race ({NOTE})", race_figure(race_runs)))
    if run is not None and run.iterations:
        chosen = iteration or teaching_iteration(run)
        sections.append(("tv-step", f"One iteration, step by step (iteration {chosen.index} of {run.strategy})",
                         stepthrough_figure(chosen, run)))
        sections.append(("tv-replay", f"Every iteration's draft tree ({run.strategy})", tree_replay_figure(run)))
    if not sections:
        raise ValueError("nothing to export: give the race's runs, or a run with iterations")
    body = []
    for k, (div_id, heading, fig) in enumerate(sections):
        plot = pio.to_html(fig, include_plotlyjs=(k == 0), full_html=False, auto_play=False, div_id=div_id,
                           default_height=f"{fig.layout.height or 500}px", config={"displaylogo": False})
        body.append(f"<section><h2>{html.escape(heading)}</h2>{plot}</section>")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            "<style>body{font-family:system-ui,sans-serif;max-width:1200px;margin:0 auto;padding:12px}"
            "h2{font-size:18px;margin:28px 0 4px}</style></head>"
            f"<body><h1>{html.escape(title)}</h1>{''.join(body)}</body></html>")


def export_html(path: str | Path, race_runs: Sequence[tuple[str, RunResult]] | None, run: RunResult | None,
                iteration: IterationRecord | None = None) -> Path:
    """teaching_html written to `path` (the Download HTML button's file); returns the path."""
    path = Path(path)
    path.write_text(teaching_html(race_runs, run, iteration), encoding="utf-8")
    return path
