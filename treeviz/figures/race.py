"""The race: AR and one or more tree strategies on the same prompt, one lane each, the text growing at the pace each
run decoded it.

The runs were warmed up (a short untimed run each, as the bench does), then decoded unobserved (nothing drawn while
they ran, so the drawing cost no decoding time) and are REPLAYED here from their measured timestamps
(engine.measure.timeline.token_timeline): every iteration's committed tokens appear at the cumulative measured time of
that iteration, so a lane finishes at its run's measured decode time. The animation's frames sit on one uniform clock
shared by every lane; "1×" plays them in real time.
"""
from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any, Sequence

import plotly.graph_objects as go

from engine.core.trace import RunResult
from engine.measure.timeline import decode_time, speedup, token_timeline
from treeviz.figures.html import TOKEN_KIND_STYLE

AR = "ar"
NOTE = "each lane warmed up, then decoded unobserved; replayed from measured timestamps"
WRAP = 64              # characters per text line in a lane
FRAME_S = 0.05         # the finest clock step (a browser redraws a few lanes in well under 50 ms)
MAX_FRAMES = 150       # a long run gets coarser steps rather than a heavy page
# Every frame carries every lane's tokens so far: frames × tokens bounds the page's size (~100 bytes a token-frame)
TOKEN_FRAMES = 60_000
SPEEDS = (1.0, 0.5, 0.25)
WINNER_COLOR = "#b7950b"


@dataclass
class Lane:
    label: str
    run: RunResult
    events: list[dict[str, Any]]   # token_timeline(run)
    cells: list[tuple[int, int, str]]  # per token: (column, line, text as shown)
    top: float                     # y of the lane's header row
    decode_s: float
    speedup: float | None          # vs the AR lane (None for AR itself)


def race_lanes(runs: Sequence[tuple[str, RunResult]]) -> list[Lane]:
    """(label, run) pairs -> lanes, AR first; ValueError unless there are two or more runs of one prompt, one of
    them AR."""
    if len(runs) < 2:
        raise ValueError("a race needs two or more runs: AR and at least one strategy")
    ars = [run for _, run in runs if run.strategy == AR]
    if len(ars) != 1:
        raise ValueError(f"a race needs exactly one AR run to measure speedups against, got {len(ars)}")
    if len({tuple(run.prompt_ids) for _, run in runs}) != 1:
        raise ValueError("the runs of a race must decode the same prompt")
    ordered = sorted(runs, key=lambda item: item[1].strategy != AR)  # stable: AR first, the rest as given
    lanes, top = [], 0.0
    for label, run in ordered:
        events = token_timeline(run)
        cells = wrap_tokens([e["text"] for e in events])
        lines = max((line for _, line, _ in cells), default=0) + 1
        lanes.append(Lane(label, run, events, cells, top, decode_time(run),
                          None if run.strategy == AR else speedup(run, ars[0])))
        top += lines + 2.2  # header row, the text, a gap
    return lanes


def wrap_tokens(texts: list[str], width: int = WRAP) -> list[tuple[int, int, str]]:
    """A character-cell layout of token texts: (column, line, shown text) each; whitespace made visible, a newline
    ends its line."""
    cells, col, line = [], 0, 0
    for text in texts:
        shown = text.replace("\n", "⏎").replace("\t", "⇥") or "∅"
        if not shown.strip():  # a token of spaces alone would be an empty cell
            shown = "␣" * len(shown)
        if col and col + len(shown) > width:
            col, line = 0, line + 1
        cells.append((col, line, shown))
        col += len(shown)
        if "\n" in text:
            col, line = 0, line + 1
    return cells


def race_summary(runs: Sequence[tuple[str, RunResult]]) -> dict[str, Any]:
    """The race as plain data (the /race endpoint): each lane's decode time, tokens, finish time of its last token
    and speedup over AR, and the winner."""
    lanes = race_lanes(runs)
    rows = [{"label": lane.label, "strategy": lane.run.strategy, "decode_s": lane.decode_s,
             "finish_s": lane.events[-1]["time_s"] if lane.events else 0.0, "tokens": len(lane.events),
             "tokens_per_s": lane.run.metrics.tokens_per_s, "speedup_vs_ar": lane.speedup,
             "steps": lane.run.config.steps} for lane in lanes]
    return {"lanes": rows, "winner": winner(lanes).label, "note": NOTE}


def winner(lanes: list[Lane]) -> Lane:
    """The fastest lane by tokens/s (engine.measure.metrics's): the shortest decode time when the runs wrote the same
    number of tokens, and still fair when sampling made them write different numbers."""
    return max(lanes, key=lambda lane: lane.run.metrics.tokens_per_s or 0.0)


def seconds(t: float) -> str:
    """A time as the race prints it: ms below a second (tiny models race in milliseconds), else seconds."""
    return f"{t * 1000:.0f} ms" if t < 1 else f"{t:.2f} s"


def headline(lanes: list[Lane]) -> str:
    """e.g. "dynatree 1.52× AR's speed (AR 6.54 s ÷ dynatree 4.31 s)"; one clause per strategy."""
    ar = lanes[0]
    parts = [f"<b>{html.escape(lane.label)} {lane.speedup:.2f}×</b> AR's speed "
             f"(AR {seconds(ar.decode_s)} ÷ {html.escape(lane.label)} {seconds(lane.decode_s)})"
             for lane in lanes[1:] if lane.speedup is not None]
    return " · ".join(parts) or "no speedup: the runs have no tokens/s"


def clock(lanes: list[Lane]) -> list[float]:
    """Frame times from 0 to the slowest lane's finish, evenly spaced; fewer for long texts (TOKEN_FRAMES)."""
    end = max(max((e["time_s"] for e in lane.events), default=0.0) for lane in lanes)
    tokens = sum(len(lane.events) for lane in lanes)
    steps = max(10, min(MAX_FRAMES, TOKEN_FRAMES // max(tokens, 1), int(end / FRAME_S) + 1))
    return [end * k / steps for k in range(steps + 1)]


# -- the figure ----------------------------------------------------------------------------------------------------
def race_figure(runs: Sequence[tuple[str, RunResult]]) -> go.Figure:
    """One lane per run (AR on top), its text growing at the pace the run decoded it, tokens coloured by where they
    came from (prefill / accepted draft token / bonus), the winner marked when it finishes; play at 1×, 0.5× or
    0.25× of real time, or drag the time slider."""
    lanes = race_lanes(runs)
    best = winner(lanes)
    times = clock(lanes)
    static = _static_traces(lanes) + _legend_traces()
    fig = go.Figure(data=static + _frame_traces(lanes, best, 0.0))
    dynamic = list(range(len(static), len(fig.data)))  # frames replace only these
    fig.frames = [go.Frame(name=_frame_name(k), traces=dynamic, data=_frame_traces(lanes, best, t))
                  for k, t in enumerate(times)]
    step_ms = 1000 * (times[1] - times[0]) if len(times) > 1 else 100
    _race_layout(fig, lanes, times, step_ms)
    return fig


def _frame_name(k: int) -> str:
    return f"t{k}"


def _static_traces(lanes: list[Lane]) -> list[go.Scatter]:
    """Each lane's name at its header row (what does not change while the race plays)."""
    return [go.Scatter(x=[0], y=[lane.top], mode="text", text=[f"<b>{html.escape(lane.label)}</b>"],
                       textposition="middle right", textfont={"size": 15}, hoverinfo="skip", showlegend=False)
            for lane in lanes]


def _legend_traces() -> list[go.Bar]:
    """Empty bars that only put the token colours in the legend."""
    return [go.Bar(x=[None], y=[None], orientation="h", marker_color=color, name=label, hoverinfo="skip")
            for kind, (color, label) in TOKEN_KIND_STYLE.items() if kind != "prompt"]


def _frame_traces(lanes: list[Lane], best: Lane, t: float) -> list:
    """At time t: every lane's tokens so far (one bar per token, coloured by kind), its status, and the clock."""
    traces: list = []
    for lane in lanes:
        shown = [i for i, e in enumerate(lane.events) if e["time_s"] <= t + 1e-9]
        traces.append(_token_bars(lane, shown))
    for lane in lanes:
        traces.append(_status(lane, best, t))
    traces.append(go.Scatter(x=[WRAP], y=[-1.4], mode="text", text=[f"t = {seconds(t)}"], textposition="middle left",
                             textfont={"size": 15, "family": "monospace"}, hoverinfo="skip", showlegend=False))
    return traces


def _token_bars(lane: Lane, shown: list[int]) -> go.Bar:
    cells = [lane.cells[i] for i in shown]
    kinds = [lane.events[i]["kind"] for i in shown]
    return go.Bar(
        orientation="h", base=[c[0] for c in cells], x=[len(c[2]) for c in cells],
        y=[lane.top + 1 + c[1] for c in cells], width=0.86, text=[html.escape(c[2]) for c in cells],
        marker={"color": [TOKEN_KIND_STYLE.get(k, ("#eeeeee", k))[0] for k in kinds],
                "line": {"color": "#ffffff", "width": 1}},
        textposition="inside", insidetextanchor="middle", textangle=0, constraintext="none",
        textfont={"family": "monospace", "size": 13, "color": "#111"},
        hovertext=[f"{TOKEN_KIND_STYLE.get(k, ('', k))[1]} · iteration {lane.events[i]['iteration']} · "
                   f"at {lane.events[i]['time_s']:.3f} s" for k, i in zip(kinds, shown)],
        hoverinfo="text", showlegend=False, name=lane.label)


def _status(lane: Lane, best: Lane, t: float) -> go.Scatter:
    """The lane's progress at time t: tokens so far, then its finish (and the winner's mark) once its last token is
    in."""
    done = sum(e["time_s"] <= t + 1e-9 for e in lane.events)
    finished = done == len(lane.events)
    text = f"{done} tokens"
    color = "#555"
    if finished:
        text = f"✓ done in {seconds(lane.decode_s)}"
        if lane.speedup is not None:
            text += f" · {lane.speedup:.2f}× AR"
        if lane is best:
            text, color = "★ winner · " + text, WINNER_COLOR
    return go.Scatter(x=[WRAP], y=[lane.top], mode="text", text=[f"<b>{text}</b>" if finished else text],
                      textposition="middle left", textfont={"size": 14, "color": color}, hoverinfo="skip",
                      showlegend=False)


def _race_layout(fig: go.Figure, lanes: list[Lane], times: list[float], step_ms: float) -> None:
    """Title (the speedups), the note, play buttons per speed, the time slider, a fixed frame around the lanes."""
    bottom = lanes[-1].top + 1 + max((c[1] for c in lanes[-1].cells), default=0) + 0.8
    buttons = [{"label": f"▶ {speed:g}×", "method": "animate",
                "args": [None, {"frame": {"duration": step_ms / speed, "redraw": True}, "fromcurrent": True,
                                "transition": {"duration": 0}, "mode": "immediate"}]} for speed in SPEEDS]
    buttons.append({"label": "❚❚ pause", "method": "animate",
                    "args": [[None], {"frame": {"duration": 0, "redraw": False}, "mode": "immediate"}]})
    every = max(1, len(times) // 10)  # label every tenth step: a label per step would overprint
    steps = [{"label": seconds(t) if k % every == 0 else "", "method": "animate",
              "args": [[_frame_name(k)], {"frame": {"duration": 0, "redraw": True}, "mode": "immediate",
                                          "transition": {"duration": 0}}]} for k, t in enumerate(times)]
    fig.update_layout(
        title={"text": f"the race · {headline(lanes)}", "font": {"size": 15}, "x": 0.01},
        template="plotly_white", barmode="overlay", height=int(170 + 26 * (bottom + 2.5)),
        margin={"l": 10, "r": 10, "t": 50, "b": 120}, hoverlabel={"font": {"family": "monospace"}},
        xaxis={"range": [-0.5, WRAP + 0.5], "visible": False, "fixedrange": True},
        yaxis={"range": [bottom, -2.4], "visible": False, "fixedrange": True},
        legend={"orientation": "h", "x": 0, "y": 1.0, "yanchor": "bottom", "font": {"size": 11}},
        annotations=[{"text": f"<i>{NOTE}</i>: each iteration's tokens appear at its measured cumulative time",
                      "xref": "paper", "yref": "paper", "x": 0, "y": -0.02, "yanchor": "top", "showarrow": False,
                      "font": {"size": 12, "color": "#555"}, "xanchor": "left"}],
        updatemenus=[{"type": "buttons", "direction": "left", "buttons": buttons, "showactive": False,
                      "x": 0, "xanchor": "left", "y": -0.08, "yanchor": "top", "pad": {"t": 0, "r": 6}}],
        sliders=[{"steps": steps, "active": 0, "x": 0.42, "len": 0.58, "y": -0.06, "yanchor": "top",
                  "currentvalue": {"visible": False}, "pad": {"t": 0}, "ticklen": 3, "font": {"size": 10}}])
