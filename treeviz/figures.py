"""Plotly figures built from trace records (engine.trace): the draft tree, per-run charts, comparison views.

Only engine.trace records go in (NodeRecord / IterationRecord / RunResult, a partial RunResult while a run streams);
the numbers shown are the engine's own (RunResult.metrics); no tensors, no models.
"""
from __future__ import annotations

import html
import unicodedata
from typing import Any, Iterable, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine.trace import IterationRecord, NodeRecord, RunResult
from treeviz.layout import extent, tidy_layout

COLORSCALE = "Viridis"
Q_RANGE = (0.0, 1.0)
UNSCORED_FILL = "#c8c8c8"
LARGE_TREE = 60  # above this many nodes: labels only on the accepted path, smaller markers

# Outcome -> marker style. Shape and outline carry the outcome, so the figure reads without colour; the fill is q.
STATUS_STYLE: dict[str, dict[str, Any]] = {
    "root": {"symbol": "diamond", "line_color": "#111111", "line_width": 2.5, "size": 18,
             "label": "root (last committed token)"},
    "accepted": {"symbol": "circle", "line_color": "#111111", "line_width": 3.0, "size": 16,
                 "label": "accepted (draft token the target kept)"},
    "bonus": {"symbol": "star", "line_color": "#d35400", "line_width": 2.5, "size": 22,
              "label": "bonus (target's own next token)"},
    "resampled": {"symbol": "star-diamond", "line_color": "#8e44ad", "line_width": 2.5, "size": 20,
                  "label": "bonus, resampled from the residual"},
    "rejected": {"symbol": "x", "line_color": "#c0392b", "line_width": 1.5, "size": 13,
                 "label": "rejected (target chose otherwise)"},
    "unreached": {"symbol": "circle-open", "line_color": "#7f8c8d", "line_width": 1.5, "size": 10,
                  "label": "unreached (below a rejected node)"},
}
STATUS_ORDER = ("unreached", "rejected", "accepted", "root", "bonus", "resampled")
EDGE_STYLE = {"accepted": ("#111111", 4.0), "other": ("#9aa5ad", 1.2), "dead": ("#d5dadd", 1.0)}

WHITESPACE = {" ": "␣", "\n": "⏎", "\t": "⇥", "\r": "␍"}
TOKEN_KIND_STYLE = {  # generated-text provenance
    "prompt": ("#f0f0f0", "prompt"),
    "prefill": ("#d6e4f0", "first token, from the prefill pass"),
    "accepted": ("#c9ecc9", "accepted draft token"),
    "bonus": ("#fde3c4", "bonus token (target's choice)"),
}


# -- small helpers -------------------------------------------------------------------------------------------------
def visible_token(text: str | None) -> str:
    """A token's text with whitespace made visible, with <, > and & escaped (safe inside plotly text and HTML text;
    quotes stay as they are, since plotly would print the entity &quot; literally)."""
    if text is None:
        return "∅"
    if text == "":
        return "∅"
    out = []
    for ch in text:
        if ch in WHITESPACE:
            out.append(WHITESPACE[ch])
        elif unicodedata.category(ch) in ("Cc", "Cf", "Zs", "Zl", "Zp"):
            out.append(f"\\x{ord(ch):02x}" if ord(ch) < 256 else f"\\u{ord(ch):04x}")  # invisible: show its code
        else:
            out.append(ch)
    return html.escape("".join(out), quote=False)


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)


def node_status(node: NodeRecord) -> str:
    status = node.status
    if status == "bonus" and node.resampled:
        return "resampled"
    return status


def hover_text(node: NodeRecord) -> str:
    status = node_status(node)
    outcome = STATUS_STYLE.get(status, {}).get("label", status)
    rank = node.rank
    lines = [f"<b>{visible_token(node.text)}</b>  (id {node.token})",
             f"q (draft) = {_fmt(node.q)}",
             f"cumulative q = {_fmt(node.path_q, '.3g')}",
             f"p (target) = {_fmt(node.p)}",
             f"depth {node.depth} · rank {rank if rank is not None else 'n/a'}",
             f"outcome: {html.escape(outcome)}"]
    if node.accept_prob is not None:
        lines.insert(4, f"accept prob = {_fmt(node.accept_prob)}")
    if node.draws > 1:  # identical i.i.d. draws merged into this node (the rules try each draw in its own turn)
        lines.insert(1, f"drawn {node.draws}× at its parent")
    return "<br>".join(lines)


def iteration_layout(iteration: IterationRecord) -> dict[int, tuple[int, float]]:
    return tidy_layout(iteration.nodes)


def run_frame(iterations: Iterable[IterationRecord], min_depth: int = 4, min_half_width: float = 3.0) -> dict[str, list[float]]:
    """Axis ranges covering every iteration of a run, so the tree view never jumps while scrubbing."""
    max_depth, lo, hi = extent(iteration_layout(it) for it in iterations)
    max_depth = max(max_depth, min_depth)
    lo, hi = min(lo, -min_half_width), max(hi, min_half_width)
    return {"x": [-0.6, max_depth + 0.9], "y": [-(hi + 0.8), -(lo - 0.8)]}


def grow_frame(frame: dict[str, list[float]] | None, iteration: IterationRecord) -> dict[str, list[float]]:
    """Frame for live streaming: grows to fit new trees, never shrinks."""
    new = run_frame([iteration])
    if not frame:
        return new
    return {"x": [min(frame["x"][0], new["x"][0]), max(frame["x"][1], new["x"][1])],
            "y": [min(frame["y"][0], new["y"][0]), max(frame["y"][1], new["y"][1])]}


# -- the draft tree ------------------------------------------------------------------------------------------------
def tree_traces(iteration: IterationRecord, label_all: bool | None = None, show_legend: bool = True,
                size_scale: float = 1.0) -> list[go.Scatter]:
    nodes = list(iteration.nodes)
    if not nodes:
        return []
    pos = iteration_layout(iteration)
    large = len(nodes) > LARGE_TREE
    if label_all is None:
        label_all = not large
    on_path = set(iteration.accepted_path)
    if large:
        size_scale *= 0.7

    def xy(node_id):
        depth, breadth = pos[node_id]
        return depth, -breadth

    # edges: accepted path thick; edges into unreached subtrees faint
    edges = {"accepted": ([], []), "other": ([], []), "dead": ([], [])}
    for node in nodes:
        parent = node.parent
        if parent is None or parent < 0 or parent not in pos:
            continue
        nid = node.id
        status = node.status
        if (nid in on_path and parent in on_path) or (status == "bonus" and parent in on_path):
            kind = "accepted"
        elif status == "unreached":
            kind = "dead"
        else:
            kind = "other"
        (x0, y0), (x1, y1) = xy(parent), xy(nid)
        edges[kind][0].extend([x0, x1, None])
        edges[kind][1].extend([y0, y1, None])
    traces: list[go.Scatter] = []
    for kind in ("dead", "other", "accepted"):
        xs, ys = edges[kind]
        if xs:
            color, width = EDGE_STYLE[kind]
            traces.append(go.Scatter(x=xs, y=ys, mode="lines", line={"color": color, "width": width},
                                     hoverinfo="skip", showlegend=False, name=f"edges: {kind}"))

    # nodes: one trace per outcome (legend shows shapes); q fills on the shared fixed 0-1 colour axis
    groups: dict[str, list[Any]] = {}
    for node in nodes:
        groups.setdefault(node_status(node), []).append(node)
    for status in STATUS_ORDER + tuple(s for s in groups if s not in STATUS_ORDER):
        members = groups.get(status)
        if not members:
            continue
        style = STATUS_STYLE.get(status, STATUS_STYLE["unreached"])
        legend_done = False
        for scored in (True, False):
            part = [n for n in members if (n.q is not None) == scored]
            if not part:
                continue
            xs = [xy(n.id)[0] for n in part]
            ys = [xy(n.id)[1] for n in part]
            labels = [visible_token(n.text)
                      if (label_all or n.id in on_path or n.status == "bonus") else ""
                      for n in part]
            marker: dict[str, Any] = {"symbol": style["symbol"], "size": style["size"] * size_scale,
                                      "line": {"color": style["line_color"], "width": style["line_width"]}}
            if scored:
                marker.update(color=[n.q for n in part], coloraxis="coloraxis")
            else:
                marker.update(color=UNSCORED_FILL)
            if status == "unreached":
                marker["opacity"] = 0.55
            if style["symbol"].endswith("-open"):
                marker["line"] = {"width": 2.0}  # open symbols draw their outline in the fill colour (q)
            traces.append(go.Scatter(
                x=xs, y=ys, mode="markers+text", text=labels, textposition="middle right",
                textfont={"size": 14 if not large else 11, "family": "monospace", "color": "#222"},
                hovertext=[hover_text(n) for n in part], hoverinfo="text",
                marker=marker, name=style["label"], legendgroup=status,
                showlegend=show_legend and not legend_done,
                customdata=[[n.id, status] for n in part]))
            legend_done = True
    return traces


def _coloraxis(show_scale: bool = True) -> dict[str, Any]:
    return {"colorscale": COLORSCALE, "cmin": Q_RANGE[0], "cmax": Q_RANGE[1], "showscale": show_scale,
            "colorbar": {"title": {"text": "draft q"}, "thickness": 12, "len": 0.75, "x": 1.0,
                         "tickvals": [0, 0.25, 0.5, 0.75, 1.0]}}


def selector_caption(choice: dict | None) -> str:
    """What the delayed tree's neural selector chose for this iteration (engine/selector.py), or nothing."""
    if not choice:
        return ""
    text = f"<br>selector chose (K, L1, L2) = ({choice['k']}, {choice['l1']}, {choice['l2']})"
    if choice.get("predicted_tokens_per_s") is not None:
        text += f", predicted {choice['predicted_tokens_per_s']:.1f} tok/s"
    return text


def tree_figure(iteration: IterationRecord | None, frame: dict[str, list[float]] | None = None, title: str | None = None,
                height: int | None = None) -> go.Figure:
    """The draft tree of one iteration: root (last committed token) at the left, depth to the right."""
    fig = go.Figure()
    if iteration is None:
        fig.update_layout(coloraxis=_coloraxis(), height=height or 420, template="plotly_white",
                          xaxis={"visible": False}, yaxis={"visible": False},
                          annotations=[{"text": "Run a prompt, or pick a gallery trace, to see draft trees",
                                        "showarrow": False, "font": {"size": 15, "color": "#666"}}],
                          margin={"l": 10, "r": 10, "t": 30, "b": 10})
        return fig
    frame = frame or run_frame([iteration])
    for trace in tree_traces(iteration):
        fig.add_trace(trace)
    if title is None:
        nodes = iteration.nodes
        title = (f"iteration {iteration.index}: {iteration.drafted} drafted, "
                 f"{iteration.accepted} accepted + bonus "
                 f"'{visible_token(iteration.bonus_text)}', {iteration.times.get('total', 0) * 1000:.0f} ms")
        title += selector_caption(iteration.extra.get("selector"))
        if len(nodes) > LARGE_TREE:
            title += " (labels on the accepted path only)"
    span = frame["y"][1] - frame["y"][0]
    fig.update_layout(
        title={"text": title, "font": {"size": 14}, "x": 0.01},
        coloraxis=_coloraxis(), template="plotly_white",
        height=height or int(min(900, max(430, 28 * span + 170))),
        margin={"l": 10, "r": 10, "t": 40, "b": 90},
        xaxis={"range": frame["x"], "autorange": False, "title": {"text": "depth"}, "dtick": 1,
               "zeroline": False, "fixedrange": False},
        yaxis={"range": frame["y"], "autorange": False, "visible": False, "fixedrange": False},
        legend={"orientation": "h", "y": -0.14, "yanchor": "top", "x": 0, "font": {"size": 11},
                "itemsizing": "constant"},
        hoverlabel={"font": {"family": "monospace"}},
        uirevision="tree",  # keep the user's zoom while the figure streams
    )
    return fig


def small_multiples(items: Sequence[tuple[str, IterationRecord]], cols: int = 3) -> go.Figure:
    """One tree per (title, iteration) in a grid, on shared frame and colour scale (the Compare view)."""
    items = [(t, it) for t, it in items if it is not None]
    if not items:
        return tree_figure(None)
    cols = max(1, min(cols, len(items)))
    rows = (len(items) + cols - 1) // cols
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=[html.escape(t) for t, _ in items],
                        horizontal_spacing=0.04, vertical_spacing=0.12)
    frame = run_frame([it for _, it in items])
    for i, (_, it) in enumerate(items):
        r, c = i // cols + 1, i % cols + 1
        for trace in tree_traces(it, label_all=len(it.nodes) <= 25, show_legend=(i == 0),
                                 size_scale=0.75):
            fig.add_trace(trace, row=r, col=c)
        fig.update_xaxes(range=frame["x"], autorange=False, dtick=1, row=r, col=c)
        fig.update_yaxes(range=frame["y"], autorange=False, visible=False, row=r, col=c)
    fig.update_layout(coloraxis=_coloraxis(), template="plotly_white", height=340 * rows,
                      margin={"l": 10, "r": 10, "t": 40, "b": 20},
                      legend={"orientation": "h", "y": -0.08, "font": {"size": 10}})
    return fig


# -- per-run charts ------------------------------------------------------------------------------------------------
STAGE_COLORS = {"draft": "#f39c12", "build": "#9b59b6", "verify": "#2980b9", "commit": "#7f8c8d", "other": "#bdc3c7"}


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
    fig.add_trace(go.Scatter(x=[idx[0], idx[-1]], y=[m["mean_tokens_per_iter"]] * 2, mode="lines",
                             name=f"L̄ = {m['mean_tokens_per_iter']:.2f} (run)", line={"color": "#1f4e79", "width": 2.5},
                             hovertemplate="L̄ = %{y:.2f}<extra></extra>"), row=1, col=1)
    fig.add_trace(go.Scatter(x=idx, y=[it.accepted / it.drafted if it.drafted else None for it in its],
                             mode="lines+markers", name="acceptance rate", line={"color": "#27ae60"},
                             connectgaps=False, hovertemplate="iteration %{x}: %{y:.2f}<extra></extra>"), row=1, col=2)
    depth = m["per_depth_acceptance"]
    if depth:
        fig.add_trace(go.Bar(x=list(range(1, len(depth) + 1)), y=depth, name="P(ℓ ≥ d)", marker_color="#16a085",
                             hovertemplate="depth %{x}: %{y:.2f}<extra></extra>"), row=2, col=1)
    for stage, color in STAGE_COLORS.items():
        if stage_mode == "total":
            x, y = ["run"], [m["stage_s"][stage] * 1000]
        else:
            x, y = idx, [it.times.get(stage, 0.0) * 1000 for it in its]
        fig.add_trace(go.Bar(x=x, y=y, name=stage, marker_color=color, legendgroup="stage",
                             hovertemplate=f"{stage}: %{{y:.1f}} ms<extra></extra>"), row=2, col=2)


def throughput_figure(run: RunResult | None, ar_run: RunResult | None) -> go.Figure:
    """Tokens/s of the run beside AR on the same prompt in the same session, with the speedup."""
    fig = go.Figure()
    names, values, colors = [], [], []
    tps = run.metrics.get("tokens_per_s") if run is not None else None
    speedup = (run.comparison or {}).get("speedup_vs_ar") if run is not None else None
    if ar_run is not None and ar_run.metrics.get("tokens_per_s"):
        names.append("AR")
        values.append(ar_run.metrics["tokens_per_s"])
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
        title += f": speedup {values[1] / values[0]:.2f}× over AR (eager)"  # bench also times compiled AR
    elif run is not None and ar_run is None and run.strategy != "ar":
        title += " (AR not measured yet)"
    fig.update_layout(title={"text": title, "font": {"size": 13}, "x": 0.01}, template="plotly_white",
                      height=170, margin={"l": 10, "r": 10, "t": 36, "b": 24}, showlegend=False,
                      xaxis={"rangemode": "tozero"})
    return fig


# -- text with provenance ------------------------------------------------------------------------------------------
def token_pieces(run: RunResult) -> list[dict[str, Any]]:
    """Output tokens with their text and provenance, as the engine recorded them (RunResult.token_sources).
    A trace written before sources carried text shows its output text as one piece."""
    sources = run.token_sources
    if not sources or any("text" not in src for src in sources):
        return [{"text": run.output_text, "kind": "prefill", "iteration": -1, "margin": None}]
    return [{"text": src["text"], "kind": src["kind"], "iteration": src["iteration"], "margin": src["margin"]}
            for src in sources]


def tokens_html(run: RunResult | None, selected: int | None = None, show_prompt: bool = True,
                divergence: int | None = None) -> str:
    """Generated text as HTML spans coloured by provenance, with a tooltip per token; the selected iteration's
    tokens are outlined; the first divergence from AR (if any) is marked."""
    if run is None:
        return "<div class='tv-text tv-empty'>No run yet.</div>"
    parts = ["<div class='tv-text'>"]
    if show_prompt and run.prompt:
        prompt = str(run.prompt)
        if len(prompt) > 160:
            prompt = "…" + prompt[-160:]
        parts.append(f"<span class='tv-prompt' title='prompt'>{html.escape(prompt)}</span>")
    for i, piece in enumerate(token_pieces(run)):
        kind = piece["kind"]
        color, label = TOKEN_KIND_STYLE.get(kind, ("#eeeeee", kind))
        it = piece["iteration"]
        tip = f"token {i} · {label}"
        if it is not None and it >= 0:
            tip += f" · iteration {it}"
        if piece["margin"] is not None:
            tip += f" · target top-2 margin {piece['margin']:.2f}"
        tip += f" · {piece['text']!r}"
        style = f"background:{color};"
        cls = "tv-tok"
        if selected is not None and it == selected:
            cls += " tv-sel"
        if divergence is not None and i == divergence:
            cls += " tv-div"
            tip += " · FIRST DIVERGENCE FROM AR"
        text = piece["text"]
        shown = html.escape(text).replace("\n", "⏎\n") if text.strip() or "\n" in text else (
            html.escape(text) if text else "∅")
        parts.append(f"<span class='{cls}' style='{style}' title='{html.escape(tip, quote=True)}'>{shown}</span>")
    parts.append("</div>")
    return "".join(parts)


TEXT_CSS = """
.tv-text {font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 13px; line-height: 1.7;
          white-space: pre-wrap; word-break: break-word; max-height: 320px; overflow-y: auto;
          padding: 8px; border: 1px solid #e5e7eb; border-radius: 6px; background: #fff; color: #111;}
.tv-prompt {color: #6b7280;}
.tv-tok {border-radius: 3px; padding: 0 1px; margin: 0 0.5px;}
.tv-sel {outline: 2px solid #e74c3c; outline-offset: 0px;}
.tv-div {text-decoration: underline wavy #c0392b; text-decoration-thickness: 2px;}
.tv-legend span {display: inline-block; padding: 0 6px; margin-right: 6px; border-radius: 3px; font-size: 12px;}
.tv-badge {display: inline-block; padding: 4px 10px; border-radius: 12px; font-weight: 600; font-size: 13px;}
.tv-ok {background: #d4efdf; color: #145a32;}
.tv-bad {background: #fadbd8; color: #7b241c;}
.tv-na {background: #eaecee; color: #424949;}
"""


def token_legend_html() -> str:
    spans = "".join(f"<span style='background:{c}'>{html.escape(label)}</span>"
                    for kind, (c, label) in TOKEN_KIND_STYLE.items() if kind != "prompt")
    return f"<div class='tv-legend'>{spans}<span style='outline:2px solid #e74c3c'>selected iteration</span></div>"


def badge_html(comparison: dict[str, Any] | None, sampled: bool = False) -> str:
    if not comparison:
        return "<span class='tv-badge tv-na'>output vs AR: not compared</span>"
    if sampled:
        first = comparison.get("first_divergence")
        where = "identical to AR's sample" if comparison.get("exact_match") else f"differs from AR from token {first}"
        return ("<span class='tv-badge tv-na'>sampling: lossless in distribution, not token for token "
                f"({html.escape(where)})</span>")
    if comparison.get("exact_match"):
        n = comparison.get("compared_tokens")
        return f"<span class='tv-badge tv-ok'>✓ output matches AR token for token ({n} tokens)</span>"
    first = comparison.get("first_divergence")
    extra = ""
    margin = comparison.get("reference_margin")
    if margin is not None:
        extra = f"; AR's top-2 logit margin there: {margin:.3f}" + (" (a near-tie)" if margin < 0.5 else "")
    return (f"<span class='tv-badge tv-bad'>✗ output differs from AR from token {first}{html.escape(extra)}"
            "</span>")


def metrics_rows(run: RunResult, ar_run: RunResult | None = None) -> dict[str, Any]:
    m = run.metrics
    row = {"strategy": run.strategy,
           "tokens/s": m.get("tokens_per_s"),
           "speedup": None,
           "L̄": m.get("mean_tokens_per_iter"),
           "ℓ̄": m.get("mean_accepted_len"),
           "acceptance": m.get("acceptance_rate"),
           "#iterations": m.get("iterations"),
           "new tokens": m.get("new_tokens")}
    ar_tps = ar_run.metrics.get("tokens_per_s") if ar_run is not None else None
    if ar_tps and row["tokens/s"]:
        row["speedup"] = row["tokens/s"] / ar_tps
    elif (run.comparison or {}).get("speedup_vs_ar"):
        row["speedup"] = run.comparison["speedup_vs_ar"]  # recorded with a replayed trace
    return row


def metrics_html(run: RunResult | None, ar_run: RunResult | None = None) -> str:
    """The run-level metrics row (the selected iteration's numbers are in the tree's title)."""
    if run is None:
        return ""
    row = metrics_rows(run, ar_run)

    def f(v, spec=".2f"):
        return "–" if v is None else (format(v, spec) if isinstance(v, float) else str(v))
    speedup = f(row["speedup"], ".2f") + "×" if row["speedup"] else "–"
    cells = [("run", str(run.strategy)), ("tokens/s", f(row["tokens/s"], ".1f")), ("speedup vs AR", speedup),
             ("L̄", f(row["L̄"])), ("ℓ̄", f(row["ℓ̄"])), ("acceptance", f(row["acceptance"])),
             ("iterations", f(row["#iterations"])), ("new tokens", f(row["new tokens"]))]
    body = "".join(f"<div style='display:inline-block;margin:0 14px 4px 0'><div style='font-size:11px;"
                   f"color:#6b7280'>{html.escape(k)}</div><div style='font-size:16px;font-weight:600'>"
                   f"{html.escape(v)}</div></div>" for k, v in cells)
    return f"<div class='tv-metrics'>{body}</div>"
