"""The draft tree as a Plotly figure: one iteration's tree (root at the left, depth to the right, outcome as shape,
draft q as fill), the frame that keeps it still while scrubbing or streaming, and Compare's small multiples.

Only engine.core.trace records go in (NodeRecord / IterationRecord); no tensors, no models.
"""
from __future__ import annotations

import html
from typing import Any, Iterable, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine.core.reports import SelectorChoice
from engine.core.trace import IterationRecord, NodeRecord
from treeviz.figures.html import visible_token
from treeviz.figures.layout import extent, tidy_layout

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
# Who proposed a node (NodeRecord.source), as a ring around its marker; draft-model nodes ("model") have none.
SOURCE_STYLE: dict[str, dict[str, Any]] = {
    "lookup": {"symbol": "square-open", "color": "#16a085", "label": "square ring: from context lookup"},
    "both": {"symbol": "hexagon-open", "color": "#16a085", "label": "hexagon ring: draft and lookup agree"},
}
SOURCE_PAD = 12  # the ring's size beyond its node's marker
RING_BASE = STATUS_STYLE["accepted"]["size"]  # rings share one size unless the nodes are sized one by one
EDGE_STYLE = {"accepted": ("#111111", 4.0), "other": ("#9aa5ad", 1.2), "dead": ("#d5dadd", 1.0)}
# A label sits right of its node, so one longer than a depth column runs into the next column's node and label.
# Labels are cut to the column pitch of a plot this wide (the tree's plot area at the app's layout on a laptop
# screen), ending in "…"; the hover and the inspector give the whole token. A light halo keeps them readable where
# an edge passes under them.
PLOT_WIDTH_PX = 780
LABEL_FONT = 12
GLYPH_EM = 0.6         # a monospace glyph's advance, in em
NODE_CLEARANCE_PX = 14  # the node's own half-width and a gap, before its label starts
LABEL_HALO = "0 0 3px #ffffff, 0 0 3px #ffffff"  # a CSS text-shadow: white around each glyph, whatever its colour


def label_chars(frame_x: Sequence[float], plot_px: float = PLOT_WIDTH_PX, font: float = LABEL_FONT) -> int:
    """How many monospace characters fit between a node and the next depth's node on a plot `plot_px` wide showing
    depths `frame_x`."""
    pitch = plot_px / max(frame_x[1] - frame_x[0], 1e-9)
    return max(0, int((pitch - NODE_CLEARANCE_PX) / (GLYPH_EM * font)))


def fitted_label(text: str, chars: int | None) -> str:
    """The token as shown (visible_token), cut to `chars` characters ending in "…" (None: whole; under 2: none)."""
    token = visible_token(text)
    if chars is None or len(token) <= chars:
        return token
    return token[:chars - 1] + "…" if chars >= 2 else ""


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
    if node.source in SOURCE_STYLE:
        lines.append("proposed by: " + ("context lookup" if node.source == "lookup" else "the draft and lookup"))
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
                size_scale: float = 1.0, sizes: dict[int, float] | None = None,
                chars: int | None = None) -> list[go.Scatter]:
    """The edges (accepted path thick, edges into unreached subtrees faint), then one node trace per outcome.
    `sizes` (node id -> marker size, e.g. charts_teaching.entropy_sizes) replaces the outcome's marker size; labels
    are cut to `chars` characters (label_chars; None: whole)."""
    nodes = list(iteration.nodes)
    if not nodes:
        return []
    pos = iteration_layout(iteration)
    large = len(nodes) > LARGE_TREE
    if label_all is None:
        label_all = not large
    if large:
        size_scale *= 0.7
    xy = {node_id: (depth, -breadth) for node_id, (depth, breadth) in pos.items()}
    on_path = set(iteration.accepted_path)
    return (_edge_traces(nodes, xy, on_path) + _source_traces(nodes, xy, show_legend, size_scale, sizes)
            + _node_traces(nodes, xy, on_path, label_all, show_legend, size_scale, large, sizes, chars))


def _edge_kind(node: NodeRecord, on_path: set[int]) -> str:
    if (node.id in on_path and node.parent in on_path) or (node.status == "bonus" and node.parent in on_path):
        return "accepted"
    return "dead" if node.status == "unreached" else "other"


def _edge_traces(nodes: list[NodeRecord], xy: dict, on_path: set[int]) -> list[go.Scatter]:
    edges = {"accepted": ([], []), "other": ([], []), "dead": ([], [])}
    for node in nodes:
        parent = node.parent
        if parent is None or parent < 0 or parent not in xy:
            continue
        (x0, y0), (x1, y1) = xy[parent], xy[node.id]
        xs, ys = edges[_edge_kind(node, on_path)]
        xs.extend([x0, x1, None])
        ys.extend([y0, y1, None])
    traces = []
    for kind in ("dead", "other", "accepted"):
        xs, ys = edges[kind]
        if xs:
            color, width = EDGE_STYLE[kind]
            traces.append(go.Scatter(x=xs, y=ys, mode="lines", line={"color": color, "width": width},
                                     hoverinfo="skip", showlegend=False, name=f"edges: {kind}"))
    return traces


def _source_traces(nodes: list[NodeRecord], xy: dict, show_legend: bool, size_scale: float,
                   sizes: dict[int, float] | None = None) -> list[go.Scatter]:
    """A ring under every node that context lookup proposed (alone, or agreeing with the draft): one trace per
    source, drawn before the nodes; clicks on a ring pick its node."""
    traces = []
    for source, style in SOURCE_STYLE.items():
        part = [n for n in nodes if n.source == source]
        if not part:
            continue
        # one ring size (an accepted node's, padded), or per node where `sizes` sets the nodes' sizes
        size = ([(sizes.get(n.id, RING_BASE) + SOURCE_PAD) * size_scale for n in part] if sizes
                else (RING_BASE + SOURCE_PAD) * size_scale)
        traces.append(go.Scatter(
            x=[xy[n.id][0] for n in part], y=[xy[n.id][1] for n in part], mode="markers",
            marker={"symbol": style["symbol"], "size": size,
                    "color": style["color"], "line": {"width": 2.5, "color": style["color"]}},
            hovertext=[hover_text(n) for n in part], hoverinfo="text", name=style["label"],
            legendgroup=f"source-{source}", showlegend=show_legend,
            customdata=[[n.id, node_status(n)] for n in part]))
    return traces


def _node_marker(status: str, style: dict[str, Any], part: list[NodeRecord], scored: bool,
                 size_scale: float, sizes: dict[int, float] | None = None) -> dict[str, Any]:
    """Shape and outline by outcome; q fills on the shared fixed 0-1 colour axis (grey when the node has no q);
    size by outcome, or per node from `sizes` where given."""
    size = ([sizes.get(n.id, style["size"]) * size_scale for n in part] if sizes
            else style["size"] * size_scale)
    marker: dict[str, Any] = {"symbol": style["symbol"], "size": size,
                              "line": {"color": style["line_color"], "width": style["line_width"]}}
    if scored:
        marker.update(color=[n.q for n in part], coloraxis="coloraxis")
    else:
        marker.update(color=UNSCORED_FILL)
    if status == "unreached":
        marker["opacity"] = 0.55
    if style["symbol"].endswith("-open"):
        marker["line"] = {"width": 2.0}  # open symbols draw their outline in the fill colour (q)
    return marker


def _node_traces(nodes: list[NodeRecord], xy: dict, on_path: set[int], label_all: bool, show_legend: bool,
                 size_scale: float, large: bool, sizes: dict[int, float] | None = None,
                 chars: int | None = None) -> list[go.Scatter]:
    """One trace per outcome (the legend shows the shapes), split into nodes with and without a draft q."""
    groups: dict[str, list[NodeRecord]] = {}
    for node in nodes:
        groups.setdefault(node_status(node), []).append(node)
    traces = []
    for status in STATUS_ORDER + tuple(s for s in groups if s not in STATUS_ORDER):
        style = STATUS_STYLE.get(status, STATUS_STYLE["unreached"])
        parts = [[n for n in groups.get(status, []) if (n.q is not None) == scored] for scored in (True, False)]
        for scored, part in zip((True, False), parts):
            if not part:
                continue
            labels = [fitted_label(n.text, chars) if (label_all or n.id in on_path or n.status == "bonus") else ""
                      for n in part]
            traces.append(go.Scatter(
                x=[xy[n.id][0] for n in part], y=[xy[n.id][1] for n in part], mode="markers+text", text=labels,
                textposition="middle right",
                textfont={"size": LABEL_FONT if not large else 11, "family": "monospace", "color": "#222",
                          "shadow": LABEL_HALO},
                hovertext=[hover_text(n) for n in part], hoverinfo="text",
                marker=_node_marker(status, style, part, scored, size_scale, sizes), name=style["label"],
                legendgroup=status, showlegend=show_legend and (scored or not parts[0]),  # once per outcome
                customdata=[[n.id, status] for n in part]))
    return traces


def _coloraxis(show_scale: bool = True) -> dict[str, Any]:
    return {"colorscale": COLORSCALE, "cmin": Q_RANGE[0], "cmax": Q_RANGE[1], "showscale": show_scale,
            "colorbar": {"title": {"text": "draft q"}, "thickness": 12, "len": 0.75, "x": 1.0,
                         "tickvals": [0, 0.25, 0.5, 0.75, 1.0]}}


def selector_caption(choice: SelectorChoice | None) -> str:
    """What the delayed tree's neural selector chose for this iteration (engine/strategies/selector.py), or nothing."""
    if choice is None:
        return ""
    text = f"<br>selector chose (K, L1, L2) = ({choice.k}, {choice.l1}, {choice.l2})"
    if choice.predicted_tokens_per_s is not None:
        text += f", predicted {choice.predicted_tokens_per_s:.1f} tok/s"
    return text


def tree_figure(iteration: IterationRecord | None, frame: dict[str, list[float]] | None = None, title: str | None = None,
                height: int | None = None, sizes: dict[int, float] | None = None) -> go.Figure:
    """The draft tree of one iteration: root (last committed token) at the left, depth to the right; `sizes` gives
    per-node marker sizes (node id -> size) instead of the outcome's."""
    fig = go.Figure()
    if iteration is None:
        fig.update_layout(coloraxis=_coloraxis(), height=height or 420, template="plotly_white",
                          xaxis={"visible": False}, yaxis={"visible": False},
                          annotations=[{"text": "Run a prompt, or pick a gallery trace, to see draft trees",
                                        "showarrow": False, "font": {"size": 15, "color": "#666"}}],
                          margin={"l": 10, "r": 10, "t": 30, "b": 10})
        return fig
    frame = frame or run_frame([iteration])
    for trace in tree_traces(iteration, sizes=sizes, chars=label_chars(frame["x"])):
        fig.add_trace(trace)
    if title is None:
        nodes = iteration.nodes
        title = (f"iteration {iteration.index}: {iteration.drafted} drafted, "
                 f"{iteration.accepted} accepted + bonus "
                 f"'{visible_token(iteration.bonus_text)}', {iteration.times.total * 1000:.0f} ms")
        title += selector_caption(iteration.selector)
        if iteration.lookup is not None and iteration.lookup.alone:
            title += " · lookup alone (the draft model was skipped: lookup measured faster here)"
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
    spacing = 0.04  # between columns, as a share of the width
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=[html.escape(t) for t, _ in items],
                        horizontal_spacing=spacing, vertical_spacing=0.12)
    frame = run_frame([it for _, it in items])
    for i, (_, it) in enumerate(items):
        r, c = i // cols + 1, i % cols + 1
        for trace in tree_traces(it, label_all=len(it.nodes) <= 25, show_legend=(i == 0), size_scale=0.75,
                                 chars=label_chars(frame["x"], PLOT_WIDTH_PX * (1 - spacing * (cols - 1)) / cols)):
            fig.add_trace(trace, row=r, col=c)
        fig.update_xaxes(range=frame["x"], autorange=False, dtick=1, row=r, col=c)
        fig.update_yaxes(range=frame["y"], autorange=False, visible=False, row=r, col=c)
    fig.update_layout(coloraxis=_coloraxis(), template="plotly_white", height=340 * rows,
                      margin={"l": 10, "r": 10, "t": 40, "b": 20},
                      legend={"orientation": "h", "y": -0.08, "font": {"size": 10}})
    return fig
