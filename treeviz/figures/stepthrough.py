"""One iteration, step by step: the draft tree growing, the target's verdict node by node, then the commit.

Built from one IterationRecord alone (a gallery trace plays it with no model loaded). The records do not say which
draft forward proposed which node, so the tree grows by depth: one step per level, which is one draft forward per
level for the level-by-level strategies and a regrouping for the others (the captions say so). The verdicts follow
the order the verification walks the tree: down the accepted path, at each accepted node its drafted children by
draft rank, then the bonus; every caption says why, in the node inspector's words (treeviz.figures.inspector.reason).
"""
from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from engine.core.trace import ACCEPTED, BONUS, REJECTED, ROOT, UNREACHED, IterationRecord, NodeRecord, RunResult
from treeviz.figures.html import visible_token
from treeviz.figures.inspector import reason
from treeviz.figures.tree_figure import (COLORSCALE, EDGE_STYLE, LABEL_FONT, LABEL_HALO, Q_RANGE, STATUS_STYLE,
                                         UNSCORED_FILL, fitted_label, iteration_layout, label_chars, run_frame)

GROUP_REJECTED = 4  # more rejected siblings than this under one parent: one step for all of them
CURRENT_COLOR = "#e74c3c"
FADED = 0.22


READABLE_NODES = 40  # larger trees still play, but their labels crowd


def teaching_iteration(run: RunResult) -> IterationRecord:
    """The iteration that shows the most in a step-through: one that both accepted and rejected draft tokens
    (most accepted × rejected), in a tree small enough to read; else the one that accepted the most."""
    def score(it: IterationRecord) -> tuple:
        rejected = sum(n.status == REJECTED for n in it.nodes)
        return (it.drafted <= READABLE_NODES, it.accepted * rejected, it.accepted, -it.index)
    if not run.iterations:
        raise ValueError("the run has no iterations to step through")
    return max(run.iterations, key=score)


def _quote(node: NodeRecord) -> str:
    return f"'{visible_token(node.text)}'"


def stepthrough_steps(iteration: IterationRecord, greedy: bool = True, rule: str = "") -> list[dict[str, Any]]:
    """The steps as plain data: {"label", "caption", "drafted" (node ids shown), "judged" (ids whose verdict is
    shown), "current" (ids the step is about), "commit" (the last step)}."""
    by_id = {n.id: n for n in iteration.nodes}
    root = next(n for n in iteration.nodes if n.status == ROOT)
    steps = [{"label": "root", "drafted": {root.id}, "judged": {root.id}, "current": {root.id}, "commit": False,
              "caption": f"the root {_quote(root)}: the last committed token; the draft continues it"}]
    steps += _draft_steps(iteration, root)
    steps += _verify_steps(iteration, by_id, greedy, rule, set(steps[-1]["drafted"]))
    steps.append(_commit_step(iteration, by_id, steps[-1]))
    return steps


def _draft_steps(iteration: IterationRecord, root: NodeRecord) -> list[dict[str, Any]]:
    """One step per depth level of drafted nodes (the bonus is the target's, not the draft's)."""
    drafted = [n for n in iteration.nodes if n.status not in (ROOT, BONUS)]
    depth = max((n.depth for n in drafted), default=0)
    shown, steps = {root.id}, []
    for d in range(1, depth + 1):
        level = [n for n in drafted if n.depth == d]
        shown |= {n.id for n in level}
        best = max(level, key=lambda n: n.q or 0.0)
        steps.append({"label": f"draft {d}", "drafted": set(shown), "judged": {root.id},
                      "current": {n.id for n in level}, "commit": False,
                      "caption": (f"draft, depth {d}: {len(level)} node{'s' * (len(level) != 1)} proposed, most "
                                  f"likely {_quote(best)} (q = {best.q or 0:.3f}); colour = draft q · grown by depth "
                                  f"(the records do not say which of the {iteration.draft_forwards} draft forwards "
                                  "made each node)")})
    if not drafted:
        steps.append({"label": "no draft", "drafted": {root.id}, "judged": {root.id}, "current": set(),
                      "commit": False, "caption": "nothing drafted: the target emits one token on its own"})
    return steps


def verdict_order(iteration: IterationRecord) -> list[list[NodeRecord]]:
    """The verification's walk as groups of nodes judged together: at each node of the accepted path its drafted
    children by draft rank (many rejected siblings grouped into one), then the bonus."""
    children: dict[int, list[NodeRecord]] = {}
    for node in iteration.nodes:
        if node.status in (ACCEPTED, REJECTED):
            children.setdefault(node.parent, []).append(node)
    groups: list[list[NodeRecord]] = []
    for parent in iteration.accepted_path:
        kids = sorted(children.get(parent, []), key=lambda n: (n.rank is None, n.rank or 0, n.id))
        rejected = [n for n in kids if n.status == REJECTED]
        if len(rejected) > GROUP_REJECTED:
            groups.append(rejected)
        else:
            groups += [[n] for n in rejected]
        groups += [[n] for n in kids if n.status == ACCEPTED]
    groups += [[n] for n in iteration.nodes if n.status == BONUS]
    return groups


def _verify_steps(iteration: IterationRecord, by_id: dict[int, NodeRecord], greedy: bool, rule: str,
                  drafted: set[int]) -> list[dict[str, Any]]:
    judged, steps = {n.id for n in iteration.nodes if n.status == ROOT}, []
    for group in verdict_order(iteration):
        judged |= {n.id for n in group}
        drafted |= {n.id for n in group}  # the bonus enters the picture here
        steps.append({"label": f"verify {len(steps) + 1}", "drafted": set(drafted), "judged": set(judged),
                      "current": {n.id for n in group}, "commit": False,
                      "caption": _verdict_caption(group, by_id, greedy, rule)})
    unreached = {n.id for n in iteration.nodes if n.status == UNREACHED}
    if unreached:
        steps.append({"label": "unreached", "drafted": set(drafted), "judged": judged | unreached,
                      "current": unreached, "commit": False,
                      "caption": f"verify: {len(unreached)} node{'s' * (len(unreached) != 1)} below rejected ones: "
                                 "never looked at (unreached)"})
    return steps


def _verdict_caption(group: list[NodeRecord], by_id: dict[int, NodeRecord], greedy: bool, rule: str) -> str:
    node = group[0]
    parent = by_id.get(node.parent)
    why = reason(node, parent, greedy, rule)
    if len(group) > 1:
        tokens = ", ".join(_quote(n) for n in group[:6]) + (" …" if len(group) > 6 else "")
        return f"verify: {len(group)} children of {_quote(parent)} rejected ({tokens}) · {why}"
    p = "n/a" if node.p is None else f"{node.p:.3f}"
    q = "n/a" if node.q is None else f"{node.q:.3f}"
    return f"verify {_quote(node)}: q = {q}, p = {p} → {why}"


def _commit_step(iteration: IterationRecord, by_id: dict[int, NodeRecord], last: dict[str, Any]) -> dict[str, Any]:
    kept = [by_id[i] for i in iteration.accepted_path[1:]]
    bonus = [n for n in iteration.nodes if n.status == BONUS]
    text = "".join(visible_token(n.text) for n in kept + bonus)
    discarded = iteration.drafted - iteration.accepted
    return {"label": "commit", "drafted": last["drafted"], "judged": last["judged"],
            "current": {n.id for n in kept + bonus}, "commit": True,
            "caption": (f"commit: {len(kept)} accepted + 1 bonus enter the text: “{text}” · {discarded} drafted "
                        f"node{'s' * (discarded != 1)} discarded")}


# -- the figure ----------------------------------------------------------------------------------------------------
def stepthrough_figure(iteration: IterationRecord, run: RunResult | None = None) -> go.Figure:
    """The iteration's steps as animation frames: step buttons on a slider, and play. `run` (optional) tells
    greedy from sampled verification and the rule's name for the captions."""
    greedy = run.config.sampling.greedy if run is not None else True
    rule = str(run.config.verifier or "") if run is not None else ""
    steps = stepthrough_steps(iteration, greedy, rule)
    xy = {i: (d, -b) for i, (d, b) in iteration_layout(iteration).items()}
    frame = run_frame([iteration])
    chars = label_chars(frame["x"])
    frames = [go.Frame(name=f"s{k}", data=step_traces(iteration, xy, step, chars),
                       layout={"title": {"text": _title(iteration, k, len(steps), step)}})
              for k, step in enumerate(steps)]
    fig = go.Figure(data=frames[0].data, frames=frames)
    _layout(fig, iteration, steps, frame)
    return fig


def _title(iteration: IterationRecord, k: int, n: int, step: dict[str, Any]) -> str:
    return (f"iteration {iteration.index}, step {k + 1}/{n}<br><span style='font-size:13px'>{step['caption']}"
            "</span>")


def step_traces(iteration: IterationRecord, xy: dict[int, tuple[float, float]], step: dict[str, Any],
                chars: int | None = None) -> list:
    """The same nine traces in every step (frames replace them one for one): the ring around what the step is about,
    edges, the accepted path's edges, nodes awaiting a verdict, one trace per verdict; labels cut to `chars`."""
    shown = [n for n in iteration.nodes if n.id in step["drafted"] and n.id in xy]
    pending = [n for n in shown if n.id not in step["judged"]]
    judged = {status: [n for n in shown if n.id in step["judged"] and n.status == status]
              for status in (ROOT, ACCEPTED, REJECTED, UNREACHED, BONUS)}
    path = set(iteration.accepted_path) if step["commit"] else set()
    # the ring first, so it is drawn under the nodes and their labels (on top it crossed the label's first letter);
    # at the commit the thick path says what is kept, and rings there would only cover its labels
    ring = [] if step["commit"] else [n for n in shown if n.id in step["current"]]
    traces = [go.Scatter(x=[xy[n.id][0] for n in ring], y=[xy[n.id][1] for n in ring], mode="markers",
                         marker={"symbol": "circle-open", "size": 30, "color": CURRENT_COLOR, "line": {"width": 2.5}},
                         hoverinfo="skip", showlegend=False, name="this step"),
              _edges(shown, xy, lambda n: n.id not in path and not (step["commit"] and n.status == BONUS), "other"),
              _edges(shown, xy, lambda n: n.id in path or (step["commit"] and n.status == BONUS), "accepted"),
              _nodes(pending, xy, "pending", step["commit"], chars)]
    traces += [_nodes(judged[status], xy, status, step["commit"], chars) for status in judged]
    return traces


def _edges(nodes: list[NodeRecord], xy: dict, keep, kind: str) -> go.Scatter:
    xs: list = []
    ys: list = []
    for node in nodes:
        if node.parent in xy and node.id in xy and keep(node):
            xs += [xy[node.parent][0], xy[node.id][0], None]
            ys += [xy[node.parent][1], xy[node.id][1], None]
    color, width = EDGE_STYLE[kind]
    return go.Scatter(x=xs, y=ys, mode="lines", line={"color": color, "width": width}, hoverinfo="skip",
                      showlegend=False, name=f"edges: {kind}")


PENDING_STYLE = {"symbol": "circle", "line_color": "#555555", "line_width": 1.0, "size": 15,
                 "label": "drafted, awaiting the target's verdict"}


def _nodes(nodes: list[NodeRecord], xy: dict, status: str, commit: bool, chars: int | None = None) -> go.Scatter:
    """Nodes of one kind, filled by draft q (grey without one); at the commit what is discarded fades; labels cut
    to `chars` characters (tree_figure.label_chars)."""
    style = PENDING_STYLE if status == "pending" else STATUS_STYLE[status]
    discarded = commit and status in (REJECTED, UNREACHED, "pending")
    return go.Scatter(
        x=[xy[n.id][0] for n in nodes], y=[xy[n.id][1] for n in nodes], mode="markers+text",
        text=[fitted_label(n.text, chars) for n in nodes], textposition="middle right",
        textfont={"family": "monospace", "size": LABEL_FONT, "color": "#bbb" if discarded else "#222",
                  "shadow": LABEL_HALO},
        marker={"symbol": style["symbol"], "size": style["size"], **_fill(nodes),
                "line": {"color": style["line_color"], "width": style["line_width"]},
                "opacity": FADED if discarded else 1.0},
        hovertext=[_hover(n, status) for n in nodes], hoverinfo="text", name=style["label"], legendgroup=status,
        showlegend=True)


def _fill(nodes: list[NodeRecord]) -> dict[str, Any]:
    """Draft q on the shared 0-1 colour axis; grey where no node of the group has a q (the root)."""
    if all(n.q is None for n in nodes):
        return {"color": UNSCORED_FILL}
    return {"color": [n.q for n in nodes], "coloraxis": "coloraxis"}


def _hover(node: NodeRecord, status: str) -> str:
    q = "n/a" if node.q is None else f"{node.q:.3f}"
    p = "n/a" if node.p is None or status == "pending" else f"{node.p:.3f}"  # p is the verdict's: not yet known
    return f"<b>{visible_token(node.text)}</b> (node {node.id}, depth {node.depth})<br>q = {q}<br>p = {p}"


def _layout(fig: go.Figure, iteration: IterationRecord, steps: list[dict[str, Any]], frame: dict) -> None:
    span = frame["y"][1] - frame["y"][0]
    step_args = {"frame": {"duration": 0, "redraw": True}, "mode": "immediate", "transition": {"duration": 0}}
    fig.update_layout(
        title={"text": _title(iteration, 0, len(steps), steps[0]), "font": {"size": 15}, "x": 0.01},
        template="plotly_white", height=int(min(900, max(480, 28 * span + 260))),
        margin={"l": 10, "r": 10, "t": 80, "b": 130}, hoverlabel={"font": {"family": "monospace"}},
        coloraxis={"colorscale": COLORSCALE, "cmin": Q_RANGE[0], "cmax": Q_RANGE[1],
                   "colorbar": {"title": {"text": "draft q"}, "thickness": 12, "len": 0.7}},
        xaxis={"range": frame["x"], "autorange": False, "title": {"text": "depth"}, "dtick": 1, "zeroline": False},
        yaxis={"range": frame["y"], "autorange": False, "visible": False},
        legend={"orientation": "h", "y": -0.17, "yanchor": "top", "x": 0, "font": {"size": 11},
                "itemsizing": "constant"},
        updatemenus=[{"type": "buttons", "direction": "left", "showactive": False, "x": 0, "xanchor": "left",
                      "y": -0.3, "yanchor": "top", "buttons": [
                          {"label": "▶ play", "method": "animate",
                           "args": [None, {**step_args, "frame": {"duration": 1400, "redraw": True},
                                           "fromcurrent": True}]},
                          {"label": "❚❚ pause", "method": "animate",
                           "args": [[None], {**step_args, "frame": {"duration": 0, "redraw": False}}]}]}],
        sliders=[{"active": 0, "x": 0.2, "len": 0.8, "y": -0.28, "yanchor": "top", "pad": {"t": 0},
                  "currentvalue": {"prefix": "step: ", "font": {"size": 12}},
                  "steps": [{"label": step["label"], "method": "animate", "args": [[f"s{k}"], step_args]}
                            for k, step in enumerate(steps)]}])
