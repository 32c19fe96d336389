"""Tree layout and figure contents, on synthetic records (no models, no downloads)."""
from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from engine.core.reports import LookupReport, SelectorChoice
from engine.core.trace import Comparison, IterationRecord, NodeRecord, RunConfig, RunResult, StageTimes, load_run
from engine.measure.metrics import run_metrics
from treeviz.figures.charts import charts_figure, throughput_figure
from treeviz.figures.html import badge_html, metrics_html, token_pieces, tokens_html
from treeviz.figures.layout import children_map, tidy_layout
from treeviz.figures.tree_figure import grow_frame, run_frame, tree_figure

ROOT = Path(__file__).resolve().parent.parent


def make_iteration(index=0, n=30, seed=0, texts=None, resampled=False) -> IterationRecord:
    """A random draft tree with an accepted path, rejected siblings, unreached subtrees and a bonus node."""
    rng = random.Random(seed)
    nodes = [NodeRecord(0, -1, 1, "root", 0, None, None, 1.0, None, "root")]
    kids: dict[int, list[int]] = {0: []}
    for i in range(1, n):
        parent = rng.choice(list(kids))
        rank = len(kids[parent])
        q = round(rng.random() * (0.9 ** rank), 4)
        text = texts[i % len(texts)] if texts else f"t{i}"
        nodes.append(NodeRecord(i, parent, 100 + i, text, nodes[parent].depth + 1, q, rank,
                                nodes[parent].path_q * q, rng.random(), "unreached"))
        kids[parent].append(i)
        kids[i] = []
    # accepted path: follow the most probable child twice
    path, node = [0], 0
    for _ in range(2):
        if not kids[node]:
            break
        node = max(kids[node], key=lambda c: nodes[c].q)
        path.append(node)
    on_path = set(path)
    for nd in nodes[1:]:
        if nd.id in on_path:
            nd.status = "accepted"
        elif nd.parent in on_path:
            nd.status = "rejected"
    bonus = NodeRecord(n, path[-1], 7, "!", nodes[path[-1]].depth + 1, None, None, None, 0.9, "bonus",
                       resampled=resampled)
    nodes.append(bonus)
    return IterationRecord(index=index, position=10, nodes=nodes, accepted_path=path, bonus_token=7, bonus_text="!",
                           new_tokens=[1] * len(path), drafted=n - 1, accepted=len(path) - 1, draft_forwards=3,
                           params={}, times=StageTimes(draft=0.01, build=0.001, verify=0.02, commit=0.001,
                                                        record=0.0, total=0.032))


@pytest.mark.parametrize("seed", range(8))
def test_layout_is_tidy(seed):
    it = make_iteration(n=60, seed=seed)
    pos = tidy_layout(it.nodes)
    by_id = {nd.id: nd for nd in it.nodes}
    assert set(pos) == set(by_id)
    assert pos[0] == (0, 0.0)  # root at depth 0, breadth 0
    for nd in it.nodes:
        assert pos[nd.id][0] == (0 if nd.parent < 0 else pos[nd.parent][0] + 1)  # depth axis = tree depth
    # crossing-free: at every depth, the breadth order of nodes follows the breadth order of their parents
    depths: dict[int, list[int]] = {}
    for nid, (d, b) in pos.items():
        depths.setdefault(d, []).append(nid)
    for d, ids in depths.items():
        ids.sort(key=lambda i: pos[i][1])
        breadths = [pos[i][1] for i in ids]
        assert all(b2 - b1 >= 1 - 1e-9 for b1, b2 in zip(breadths, breadths[1:])), "nodes overlap"
        if d > 0:
            parent_b = [pos[by_id[i].parent][1] for i in ids]
            assert parent_b == sorted(parent_b), f"edges cross at depth {d}"
    # parents centred over their children; siblings ordered by q (most probable first = smallest breadth)
    _, children = children_map(it.nodes)
    for parent, kids in children.items():
        kid_b = [pos[k.id][1] for k in kids]
        assert pos[parent][1] == pytest.approx((min(kid_b) + max(kid_b)) / 2)
        ordered = sorted(kids, key=lambda k: pos[k.id][1])
        qs = [k.q for k in ordered if k.status != "bonus"]
        assert qs == sorted(qs, reverse=True)
        assert ordered[-1].status == "bonus" or all(k.status != "bonus" for k in kids)


def node_traces(fig):
    return [t for t in fig.data if t.mode and "markers" in t.mode]


def test_colour_scale_fixed_and_symbols_per_status():
    fig = tree_figure(make_iteration(n=20, seed=3))
    ca = fig.layout.coloraxis
    assert (ca.cmin, ca.cmax) == (0.0, 1.0) and ca.showscale and ca.colorbar.title.text
    symbols = {}
    for t in node_traces(fig):
        status = t.customdata[0][1]
        symbols.setdefault(status, set()).add(t.marker.symbol)
        if t.marker.coloraxis:
            assert all(0 <= c <= 1 for c in t.marker.color)
    assert {s for v in symbols.values() for s in v} and all(len(v) == 1 for v in symbols.values())
    expected = {"root": "diamond", "accepted": "circle", "bonus": "star", "rejected": "x", "unreached": "circle-open"}
    for status, symbol in expected.items():
        assert symbols[status] == {symbol}, status
    # every outcome has its own shape, so the figure reads without colour
    assert len({next(iter(v)) for v in symbols.values()}) == len(symbols)
    resampled = tree_figure(make_iteration(n=10, seed=1, resampled=True))
    assert "star-diamond" in {t.marker.symbol for t in node_traces(resampled)}


def test_accepted_edges_thicker_and_outlined():
    fig = tree_figure(make_iteration(n=25, seed=5))
    edges = {t.name: t.line.width for t in fig.data if t.mode == "lines"}
    assert edges["edges: accepted"] > max(w for n, w in edges.items() if n != "edges: accepted")
    acc = next(t for t in node_traces(fig) if t.customdata[0][1] == "accepted")
    rej = next(t for t in node_traces(fig) if t.customdata[0][1] == "rejected")
    assert acc.marker.line.width > rej.marker.line.width


def test_hover_escapes_html_and_shows_whitespace():
    it = make_iteration(n=8, seed=2, texts=["<b>", " \n\t", "a&b", 'say "hi"'])
    fig = tree_figure(it)
    hovers = [h for t in node_traces(fig) for h in t.hovertext]
    labels = [x for t in node_traces(fig) for x in t.text]
    assert any("&lt;b&gt;" in h for h in hovers)
    assert not any("<b><b>" in h or "<b></b>" in h for h in hovers)  # the token is never live markup
    assert any("␣⏎⇥" in h for h in hovers)
    assert any("a&amp;b" in h for h in hovers)
    assert "&lt;b&gt;" in labels and "<b>" not in labels
    assert 'say␣"hi"' in labels  # plotly prints entities such as &quot; literally: quotes stay quotes
    h = next(h for h in hovers if "&lt;b&gt;" in h)
    for field in ("q (draft)", "cumulative q", "p (target)", "depth", "rank", "outcome"):
        assert field in h


def test_axis_ranges_fixed_across_iterations():
    its = [make_iteration(index=i, n=5 + 12 * i, seed=i) for i in range(5)]
    frame = run_frame(its)
    ranges = set()
    for it in its:
        fig = tree_figure(it, frame=frame)
        assert fig.layout.xaxis.autorange is False and fig.layout.yaxis.autorange is False
        ranges.add((tuple(fig.layout.xaxis.range), tuple(fig.layout.yaxis.range), fig.layout.height))
        for t in node_traces(fig):  # every node inside the frame
            assert all(frame["x"][0] <= x <= frame["x"][1] for x in t.x)
            assert all(frame["y"][0] <= y <= frame["y"][1] for y in t.y)
    assert len(ranges) == 1
    # live streaming: the frame only grows
    grown = None
    for it in its:
        new = grow_frame(grown, it)
        if grown:
            assert new["x"][0] <= grown["x"][0] and new["x"][1] >= grown["x"][1]
            assert new["y"][0] <= grown["y"][0] and new["y"][1] >= grown["y"][1]
        grown = new


def test_large_tree_labels_accepted_path_only():
    it = make_iteration(n=300, seed=9)
    fig = tree_figure(it)
    on_path = set(it.accepted_path)
    for t in node_traces(fig):
        for (nid, status), label in zip(t.customdata, t.text):
            if label:
                assert nid in on_path or status == "bonus"
    assert sum(len(t.x) for t in node_traces(fig)) == len(it.nodes)
    assert len(fig.layout.annotations) == 0  # no per-node annotations


def test_tokens_html_escapes_and_marks_provenance():
    trace = ROOT / "assets" / "traces"
    run = load_run(sorted(trace.glob("*.json"))[0])
    html = tokens_html(run, selected=1)
    assert html.count("class='tv-tok") == len(run.output_ids)
    assert "tv-sel" in html and "iteration 1" in html
    pieces = token_pieces(run)
    assert [p["kind"] for p in pieces] == [s.kind for s in run.token_sources]
    assert [p["text"] for p in pieces] == [s.text for s in run.token_sources]  # the engine's text, per token
    run.prompt = "<script>alert(1)</script>"
    assert "<script>" not in tokens_html(run)


def make_run(its, tokens_per_s=10.0, comparison=None) -> RunResult:
    """A RunResult over synthetic iterations, its metrics from engine.measure.metrics (as the decoder computes them)."""
    new_tokens = 1 + sum(it.committed for it in its)
    return RunResult(prompt="p", prompt_ids=[1], output_ids=[0] * new_tokens, output_text="", strategy="x",
                     params={}, config=RunConfig(), iterations=its, comparison=comparison,
                     metrics=run_metrics(its, new_tokens, new_tokens / tokens_per_s, 0.01))


def test_charts_read_the_runs_metrics():
    its = [make_iteration(index=i, n=10, seed=i) for i in range(4)]
    run = make_run(its, comparison=Comparison(exact_match=False, first_divergence=5, reference_margin=0.01))
    fig = charts_figure(run, selected=2)
    by_name = {t.name: t for t in fig.data}
    lbar = next(t for name, t in by_name.items() if name.startswith("L̄ ="))
    assert list(lbar.y) == [run.metrics.mean_tokens_per_iter] * 2
    assert list(by_name["P(ℓ ≥ d)"].y) == run.metrics.per_depth_acceptance
    assert {"acceptance rate", "draft", "verify"} <= set(by_name)
    total = charts_figure(run, stage_mode="total")
    verify = next(t for t in total.data if t.name == "verify")
    assert list(verify.y) == [run.metrics.stage_s.verify * 1000]
    html = metrics_html(run)
    assert f"{run.metrics.mean_tokens_per_iter:.2f}" in html and f"{run.metrics.acceptance_rate:.2f}" in html


def test_badge_and_throughput():
    run = make_run([make_iteration(index=i, n=10, seed=i) for i in range(4)],
                   comparison=Comparison(exact_match=False, first_divergence=5, reference_margin=0.01))
    assert "differs from AR from token 5" in badge_html(run.comparison)
    assert "matches AR" in badge_html(Comparison(exact_match=True, compared_tokens=9))
    tp = throughput_figure(run, make_run([make_iteration()], tokens_per_s=5.0))
    assert "speedup" in tp.layout.title.text and f"{run.metrics.tokens_per_s / 5.0:.2f}×" in tp.layout.title.text
    assert "over AR (eager)" in tp.layout.title.text  # the app's AR is eager; bench also times a compiled one


def test_text_of_a_trace_without_token_texts_is_shown_whole():
    run = make_run([make_iteration()])
    run.output_text = "old <trace>"
    pieces = token_pieces(run)
    assert pieces == [{"text": "old <trace>", "kind": "prefill", "iteration": -1, "margin": None}]
    assert "old &lt;trace&gt;" in tokens_html(run)


def test_figures_do_not_import_torch():
    code = ("import sys, treeviz.figures.tree_figure, treeviz.figures.charts, treeviz.figures.html, "
            "treeviz.figures.layout; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_hover_says_how_many_draws_a_merged_node_stands_for():
    it = make_iteration(n=8, seed=2)
    it.nodes[1].draws = 3
    fig = tree_figure(it)
    hovers = [h for t in node_traces(fig) for h in t.hovertext]
    assert sum("drawn 3× at its parent" in h for h in hovers) == 1
    assert not any("drawn 1×" in h for h in hovers)


def test_tree_title_says_what_the_neural_selector_chose():
    it = make_iteration()
    assert "selector" not in tree_figure(it).layout.title.text
    it.selector = SelectorChoice(3, 0, 2, predicted_tokens_per_s=11.04)
    assert "selector chose (K, L1, L2) = (3, 0, 2), predicted 11.0 tok/s" in tree_figure(it).layout.title.text
    it.selector.predicted_tokens_per_s = None  # a pair without a cost table
    assert tree_figure(it).layout.title.text.endswith("(3, 0, 2)")


def test_tree_title_says_when_lookup_drafted_alone():
    it = make_iteration()
    assert "lookup alone" not in tree_figure(it).layout.title.text
    it.lookup = LookupReport(0.001, alone=False)
    assert "lookup alone" not in tree_figure(it).layout.title.text
    it.lookup.alone = True
    assert "lookup alone (the draft model was skipped" in tree_figure(it).layout.title.text


def test_labels_fit_their_depth_column_and_the_hover_keeps_the_whole_token():
    """A label longer than a depth column ran into the next column's node: labels are cut to the column pitch
    (ending in "…"), and only the ones that do not fit; the hover still shows the whole token."""
    from treeviz.figures.stepthrough import stepthrough_figure
    from treeviz.figures.tree_figure import PLOT_WIDTH_PX, fitted_label, label_chars
    long, short = " a_very_long_identifier_name", " x"
    it = make_iteration(n=12, seed=3, texts=[long, short])
    fig = tree_figure(it)
    chars = label_chars(fig.layout.xaxis.range)
    assert 2 <= chars < len(long)  # the long token cannot fit at this depth range
    labels = [label for t in node_traces(fig) for label in t.text if label]
    assert f"␣{long[1:chars - 1]}…" in labels and "␣x" in labels
    assert all(len(label) <= chars for label in labels)
    assert any("a_very_long_identifier_name" in h for t in node_traces(fig) for h in t.hovertext)
    step_labels = [label for t in stepthrough_figure(it).data if t.mode and "text" in t.mode for label in t.text]
    assert step_labels and all(len(label) <= chars for label in step_labels)
    # the cut follows the pitch: twice the width fits more, a column too narrow for two characters shows none
    assert label_chars([0, 10], 2 * PLOT_WIDTH_PX) > label_chars([0, 10])
    assert fitted_label(long, label_chars([0, 100])) == "" and fitted_label(long, None) == "␣" + long[1:]
