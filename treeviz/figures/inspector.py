"""The node inspector: why one node of a draft tree was accepted, rejected or never looked at, from its records alone.

For a clicked node it shows the two distributions the verification compared at its parent (the draft's q that
proposed the node and the target's p that judged it, top 10 of each as recorded in NodeRecord.next_q / next_p), the
node's own q and p, its acceptance probability under the run's rule and a one-line reason. Works on a live run, a
gallery trace and an uploaded one alike (a trace older than schema 2 has no top-10 lists: the figure says so).
"""
from __future__ import annotations

import html
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine.core.trace import ACCEPTED, BONUS, REJECTED, ROOT, UNREACHED, IterationRecord, NodeRecord, RunResult
from treeviz.figures.html import visible_token
from treeviz.figures.tree_figure import STATUS_STYLE, node_status

Q_COLOR, P_COLOR, PICKED_COLOR = "#f39c12", "#2980b9", "#c0392b"
RATIO_TOLERANCE = 2e-3  # recorded probabilities carry 4 significant digits


def default_node(iteration: IterationRecord) -> int:
    """The node shown before any click: the bonus, where the draft's proposals ran out, when the draft expanded its
    parent (so both distributions are there); else a rejected node, whose parent both models scored."""
    by_id = {n.id: n for n in iteration.nodes}
    bonus = next((n for n in iteration.nodes if n.status == BONUS), None)
    if bonus is not None and by_id[bonus.parent].next_q:
        return bonus.id
    rejected = next((n for n in iteration.nodes if n.status == REJECTED), None)
    return (rejected or bonus or iteration.nodes[0]).id


def pick(iteration: IterationRecord, node_id: Any) -> NodeRecord:
    """The node `node_id` of the iteration, or its default node for anything else (None, a stale id, junk)."""
    by_id = {n.id: n for n in iteration.nodes}
    try:
        wanted = int(node_id)
    except (TypeError, ValueError):
        wanted = None
    return by_id.get(wanted) or by_id[default_node(iteration)]


def _quote(node: NodeRecord | None, text: str | None = None) -> str:
    return f"'{visible_token(node.text if text is None else text)}'"


def reason(node: NodeRecord, parent: NodeRecord | None, greedy: bool, rule: str = "") -> str:
    """Why the verification did what it did with `node` (HTML-safe)."""
    status = node.status
    if status == ROOT:
        return "the root is the last committed token: every node of this tree continues it"
    if status == UNREACHED:
        return (f"never looked at: verification stopped above it (its parent {_quote(parent)} was not accepted)"
                if parent is not None and parent.status != ACCEPTED else "never looked at by the verification")
    target_choice = parent.next_p[0] if parent is not None and parent.next_p else None
    if greedy:
        if status == BONUS:
            return (f"the target's choice after {_quote(parent)}, which no drafted child matched: the target emits it "
                    "itself (the bonus token)")
        if target_choice is None:
            return f"{status}: the target's choice decides (its top tokens are not in this trace)"
        choice = _quote(None, target_choice[2])
        if status == ACCEPTED:
            return f"accepted: the target's choice was {choice}, this very token"
        return f"rejected: the target's choice was {choice}"
    # sampling rules
    if status == BONUS:
        if node.resampled:
            return ("every tested child was rejected, so the rule drew this token from the target's residual "
                    "distribution norm(max(p − q, 0)): what the target still owed")
        return "drawn from the target's distribution p after the accepted path (the bonus token)"
    a = node.accept_prob
    if a is None:
        return "never tried: an earlier sibling was accepted first" if status == REJECTED else status
    verdict = "accepted" if status == ACCEPTED else "rejected by the random draw"
    if node.p is not None and node.q:
        plain = min(1.0, node.p / node.q)
        if abs(plain - a) <= RATIO_TOLERANCE * max(1.0, plain):
            return f"{verdict}: tested with probability min(1, p/q) = min(1, {node.p:.3f}/{node.q:.3f}) = {a:.3f}"
        if abs(node.p - a) <= RATIO_TOLERANCE:
            return (f"{verdict}: tested with probability min(1, p/1) = p = {a:.3f} (a deterministic top-k child is a "
                    "draw from a point mass)")
    rule_name = f" ({html.escape(rule)})" if rule else ""
    return (f"{verdict}: tested with probability {a:.3f} under the rule{rule_name}: min(1, p′/q′) with p′ the "
            "target's residual after the earlier siblings were rejected and q′ the distribution this child was drawn "
            "from")


# NodeRecord.source -> where the node came from, for the inspector
SOURCES = {"root": "committed (the last token)", "model": "the draft model", "lookup": "context lookup",
           "both": "the draft model and context lookup", "target": "the target (its own next token)"}


def _row(label: str, value: str) -> str:
    return (f"<div style='display:inline-block;margin:0 14px 4px 0'><div style='font-size:11px;color:#6b7280'>"
            f"{html.escape(label)}</div><div style='font-size:15px;font-weight:600'>{value}</div></div>")


def inspector_html(run: RunResult | None, iteration: IterationRecord | None, node: NodeRecord | None) -> str:
    if run is None or iteration is None or node is None:
        return "<div class='tv-inspector tv-empty'>Click a node of the tree (or type its id) to inspect it.</div>"
    by_id = {n.id: n for n in iteration.nodes}
    parent = by_id.get(node.parent)
    greedy = run.config.sampling.greedy
    status = node_status(node)
    outcome = html.escape(STATUS_STYLE.get(status, {}).get("label", status))
    cells = [("node", f"{node.id} · {_quote(node)}"), ("depth", str(node.depth)),
             ("draft q", "n/a" if node.q is None else f"{node.q:.4f}"),
             ("target p", "n/a" if node.p is None else f"{node.p:.4f}"),
             ("acceptance probability", _acceptance(node, greedy)),
             ("outcome", outcome), ("proposed by", SOURCES.get(node.source, html.escape(node.source)))]
    body = "".join(_row(k, v) for k, v in cells)
    why = reason(node, parent, greedy, str(run.config.verifier or ""))
    return (f"<div class='tv-inspector'>{body}<div style='font-size:14px;margin-top:2px'><b>why:</b> {why}</div>"
            "</div>")


def _acceptance(node: NodeRecord, greedy: bool) -> str:
    if greedy:  # argmax matching: a tested child is accepted exactly when it is the target's choice
        return {ACCEPTED: "1 (greedy)", REJECTED: "0 (greedy)"}.get(node.status, "n/a")
    return "n/a" if node.accept_prob is None else f"{node.accept_prob:.4f}"


def _bars(entries: list[list], picked: int, siblings: set[int], color: str) -> dict[str, list]:
    """Bar data for one top-k list, most probable at the top; the inspected token and its drafted siblings marked."""
    rows = list(reversed(entries))
    colors = [PICKED_COLOR if e[0] == picked else (color if e[0] in siblings else _fade(color)) for e in rows]
    return {"x": [e[1] for e in rows], "y": [f"{visible_token(e[2])} ·{e[0]}" for e in rows], "colors": colors,
            "hover": [f"{visible_token(e[2])} (id {e[0]}): {e[1]:.4f}" + _role(e[0], picked, siblings) for e in rows]}


def _role(token: int, picked: int | None, siblings: set[int]) -> str:
    return " — this node" if token == picked else " — drafted" if token in siblings else ""


def _fade(color: str) -> str:
    return {Q_COLOR: "#f8c471", P_COLOR: "#85c1e9"}.get(color, color)


def inspector_figure(iteration: IterationRecord | None, node: NodeRecord | None) -> go.Figure:
    """The parent's draft q and target p over their top-10 tokens, side by side (the root: its own)."""
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.22,
                        subplot_titles=("draft q (proposed the children)", "target p (judged them)"))
    fig.update_layout(template="plotly_white", height=330, margin={"l": 10, "r": 10, "t": 50, "b": 30},
                      showlegend=False)
    if iteration is None or node is None:
        fig.update_xaxes(visible=False)
        fig.update_yaxes(visible=False)
        return fig
    by_id = {n.id: n for n in iteration.nodes}
    source = by_id.get(node.parent) if node.status != ROOT else node
    if source is None:
        return fig
    siblings = {n.token for n in iteration.nodes if n.parent == source.id and n.status != BONUS}
    picked = node.token if node.status != ROOT else None
    for col, entries, color in ((1, source.next_q, Q_COLOR), (2, source.next_p, P_COLOR)):
        if not entries:
            missing = ("the draft did not expand this node" if col == 1 and source.next_p
                       else "not in this trace (recorded from schema 2 on)")
            fig.add_annotation(text=missing, xref="paper", yref="paper", x=0.2 if col == 1 else 0.8, y=0.5,
                               showarrow=False, font={"color": "#888"})
            fig.update_xaxes(visible=False, row=1, col=col)
            fig.update_yaxes(visible=False, row=1, col=col)
            continue
        bars = _bars(entries, picked, siblings, color)
        fig.add_trace(go.Bar(x=bars["x"], y=bars["y"], orientation="h", marker_color=bars["colors"],
                             hovertext=bars["hover"], hoverinfo="text",
                             text=[f"{v:.3f}" for v in bars["x"]], textposition="auto"), row=1, col=col)
        fig.update_xaxes(range=[0, max(bars["x"]) * 1.15 or 1], row=1, col=col)
    where = ("after the root; darker: its drafted children" if node.status == ROOT else
             f"at the parent {_quote(source)} (node {source.id}); red: {_quote(node)}; darker: drafted")
    fig.update_layout(title={"text": f"next-token distributions {where}",
                             "font": {"size": 13}, "x": 0.01},
                      yaxis={"tickfont": {"family": "monospace"}}, yaxis2={"tickfont": {"family": "monospace"}})
    return fig


def inspect(run: RunResult | None, index: Any, node_id: Any) -> tuple[int | None, str, go.Figure]:
    """(node id shown, summary HTML, distributions figure) for node `node_id` of iteration `index` of `run`."""
    its = run.iterations if run is not None else []
    if not its:
        return None, inspector_html(None, None, None), inspector_figure(None, None)
    try:
        i = max(0, min(int(index), len(its) - 1))
    except (TypeError, ValueError):
        i = len(its) - 1
    node = pick(its[i], node_id)
    return node.id, inspector_html(run, its[i], node), inspector_figure(its[i], node)

