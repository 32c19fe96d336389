"""The teaching panels and the data behind them: top-k p and q in the records, calibration binning, the node
inspector's reasons and figures, the cost panel from recorded costs, and trace compatibility (schema 1 and 2)."""
from __future__ import annotations

import json

import pytest
import torch

from engine.core.sampling import Sampling
from engine.core.trace import (ACCEPTED, BONUS, REJECTED, ROOT, TOP_K, UNREACHED, IterationCost, IterationRecord,
                               Comparison, NodeRecord, RunConfig, RunResult, StageTimes, TraceError, run_from_dict)
from engine.decoder import Decoder
from engine.measure.metrics import calibration, run_metrics
from engine.strategies import make_strategy
from treeviz.figures.charts import calibration_figure, cost_figure, cost_rows
from treeviz.figures.html import visible_token
from treeviz.figures.inspector import default_node, inspect, inspector_figure, reason


# -- records carry the top of p and q ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def greedy_run(related_pair):
    return Decoder(related_pair, make_strategy("dynatree")).generate("def f(n):", max_new_tokens=24)


@pytest.fixture(scope="module")
def sampled_run(related_pair):
    return Decoder(related_pair, make_strategy("delayed"), sampling=Sampling(temperature=0.8, seed=3)).generate(
        "def f(n):", max_new_tokens=24)


def check_top_lists(run: RunResult):
    for it in run.iterations:
        by_id = {n.id: n for n in it.nodes}
        for node in it.nodes:
            for entries in (node.next_p, node.next_q):
                if entries:
                    assert len(entries) == TOP_K
                    probs = [e[1] for e in entries]
                    assert probs == sorted(probs, reverse=True) and all(0 <= v <= 1 for v in probs)
                    assert all(isinstance(e[2], str) for e in entries)
            if node.status == ROOT:
                continue
            parent = by_id[node.parent]
            assert parent.next_p, "every parent was scored by the target"
            for entries, value in ((parent.next_p, node.p), (parent.next_q, node.q)):
                listed = {e[0]: e[1] for e in entries}
                if node.token in listed and value is not None:
                    assert listed[node.token] == pytest.approx(value, rel=1e-3, abs=1e-9)


def test_records_carry_the_top_of_p_and_q(greedy_run):
    check_top_lists(greedy_run)
    for it in greedy_run.iterations:
        by_id = {n.id: n for n in it.nodes}
        for node in it.nodes:
            if node.status in (ACCEPTED, BONUS):  # greedy: the target's top token is what it accepted or emitted
                assert by_id[node.parent].next_p[0][0] == node.token
            if node.status != ROOT and node.status != BONUS:  # a drafted node's parent was expanded by the draft
                assert by_id[node.parent].next_q
        leaves = [n for n in it.nodes if not any(m.parent == n.id for m in it.nodes)]
        assert all(not n.next_p for n in leaves if n.id not in it.accepted_path)  # only expanded nodes carry them


def test_sampled_records_carry_the_processed_distributions(sampled_run):
    check_top_lists(sampled_run)
    assert any(n.accept_prob is not None for it in sampled_run.iterations for n in it.nodes)


def test_compact_trace_round_trips_and_is_smaller(greedy_run):
    full, compact = greedy_run.to_json(), greedy_run.to_json(compact=True)
    assert len(compact) < len(full) / 1.5
    back = run_from_dict(json.loads(compact))
    assert back.iterations == greedy_run.iterations and back.metrics == greedy_run.metrics


def test_a_schema_1_trace_still_loads_with_empty_top_lists(greedy_run):
    old = greedy_run.to_dict()
    old["schema_version"] = 1
    for it in old["iterations"]:
        for node in it["nodes"]:
            del node["next_p"], node["next_q"]
        cost = it.pop("cost", None)  # before schema 3 the cost record sat in `extra`
        if cost is not None:
            it.setdefault("extra", {})["cost"] = cost
    run = run_from_dict(old)
    assert all(not n.next_p and not n.next_q for it in run.iterations for n in it.nodes)
    shown, summary, figure = inspect(run, 0, 1)  # the inspector says what is missing instead of failing
    assert shown == 1 and "why:" in summary
    assert any("not in this trace" in a.text for a in figure.layout.annotations)
    old["schema_version"] = 99
    with pytest.raises(TraceError, match="schema version 99"):
        run_from_dict(old)


# -- calibration binning (engine.measure.metrics.calibration)
# ------------------------------------------------------------
def node(i, parent, q, status, accept_prob=None):
    return NodeRecord(i, parent, 100 + i, f"t{i}", 1, q, 0, q, 0.5, status, accept_prob=accept_prob)


def iteration(nodes, index=0):
    root = NodeRecord(0, -1, 1, "r", 0, None, None, 1.0, None, ROOT)
    return IterationRecord(index=index, position=5, nodes=[root, *nodes], accepted_path=[0], bonus_token=0,
                           bonus_text="", new_tokens=[1], drafted=len(nodes), accepted=0, draft_forwards=1,
                           params={}, times=StageTimes())


def test_calibration_bins_tested_nodes_by_q():
    its = [iteration([node(1, 0, 0.95, ACCEPTED), node(2, 0, 0.05, REJECTED), node(3, 1, 0.92, REJECTED),
                      node(4, 2, 0.5, UNREACHED), node(5, 0, 1.0, ACCEPTED), node(6, 0, 0.1, ACCEPTED)]),
           iteration([node(1, 0, 0.0, REJECTED), node(2, 0, 0.999, ACCEPTED)], index=1)]
    cells = calibration(its)
    by_lo = {round(c["lo"], 1): c for c in cells}
    assert set(by_lo) == {0.0, 0.1, 0.9}  # unreached (q 0.5) never tested; empty bins left out
    assert by_lo[0.0]["nodes"] == 2 and by_lo[0.0]["accepted"] == 0.0  # q 0.05 and q 0.0
    assert by_lo[0.1]["nodes"] == 1 and by_lo[0.1]["accepted"] == 1.0  # q 0.1 starts the second bin
    assert by_lo[0.9]["nodes"] == 4 and by_lo[0.9]["accepted"] == 0.75  # q 1.0 falls in the last bin
    assert by_lo[0.9]["mean_q"] == pytest.approx((0.95 + 0.92 + 1.0 + 0.999) / 4)
    assert [c["lo"] for c in calibration(its, bins=2)] == [0.0, 0.5]


def test_calibration_leaves_out_siblings_a_sampling_rule_never_tried():
    # SpecInfer tried node 1 (rejected), then node 2 (accepted): node 3 was never tried
    sampled = iteration([node(1, 0, 0.6, REJECTED, 0.2), node(2, 0, 0.3, ACCEPTED, 1.0), node(3, 0, 0.05, REJECTED)])
    cells = calibration([sampled])
    assert sum(c["nodes"] for c in cells) == 2 and all(c["lo"] != 0.0 for c in cells)
    greedy = iteration([node(1, 0, 0.6, REJECTED), node(2, 0, 0.3, ACCEPTED), node(3, 0, 0.05, REJECTED)])
    assert sum(c["nodes"] for c in calibration([greedy])) == 3  # greedy compares every child with the argmax


def test_calibration_figure_draws_the_engines_cells_and_the_diagonal(greedy_run, sampled_run):
    fig = calibration_figure([("dynatree", greedy_run), ("delayed", sampled_run)])
    diagonal = fig.data[0]
    assert list(diagonal.x) == [0, 1] and list(diagonal.y) == [0, 1]
    for trace, run in zip(fig.data[1:], (greedy_run, sampled_run)):
        cells = calibration(run.iterations)
        assert list(trace.x) == [c["mean_q"] for c in cells] and list(trace.y) == [c["accepted"] for c in cells]
    assert not calibration_figure([]).data[1:] and calibration_figure([]).layout.annotations


# -- the node inspector ------------------------------------------------------------------------------------------
def test_greedy_reasons_name_the_targets_choice(greedy_run):
    seen = set()
    for it in greedy_run.iterations:
        by_id = {n.id: n for n in it.nodes}
        for nd in it.nodes:
            text = reason(nd, by_id.get(nd.parent), greedy=True)
            seen.add(nd.status)
            if nd.status == REJECTED:
                choice = by_id[nd.parent].next_p[0][2]
                assert text == f"rejected: the target's choice was '{visible_token(choice)}'"
            elif nd.status == ACCEPTED:
                assert "this very token" in text
            elif nd.status == UNREACHED:
                assert "never looked at" in text
    assert {ROOT, ACCEPTED, BONUS, REJECTED} <= seen


def test_sampling_reason_shows_the_ratio():
    parent = NodeRecord(0, -1, 1, "r", 0, None, None, 1.0, None, ROOT, next_p=[[5, 0.5, "a"]], next_q=[[5, 0.8, "a"]])
    tried = NodeRecord(1, 0, 5, "a", 1, 0.8, 0, 0.8, 0.5, REJECTED, accept_prob=0.625)
    assert reason(tried, parent, greedy=False) == ("rejected by the random draw: tested with probability "
                                                   "min(1, p/q) = min(1, 0.500/0.800) = 0.625")
    point_mass = NodeRecord(2, 0, 6, "b", 1, 0.1, 1, 0.1, 0.3, ACCEPTED, accept_prob=0.3)
    assert "point mass" in reason(point_mass, parent, greedy=False)
    untried = NodeRecord(3, 0, 7, "c", 1, 0.05, 2, 0.05, 0.01, REJECTED)
    assert "never tried" in reason(untried, parent, greedy=False)
    residual = NodeRecord(4, 0, 8, "d", 1, 0.4, 3, 0.4, 0.2, ACCEPTED, accept_prob=0.9)
    assert "residual" in reason(residual, parent, greedy=False, rule="specinfer")


def test_inspector_shows_both_distributions_of_the_parent(greedy_run):
    it = greedy_run.iterations[0]
    child = next(n for n in it.nodes if n.status == REJECTED)
    parent = next(n for n in it.nodes if n.id == child.parent)
    shown, summary, fig = inspect(greedy_run, 0, child.id)
    assert shown == child.id and "rejected" in summary and f"{child.q:.4f}" in summary
    q_bars, p_bars = fig.data
    assert list(q_bars.x) == [e[1] for e in reversed(parent.next_q)]
    assert list(p_bars.x) == [e[1] for e in reversed(parent.next_p)]
    assert f"node {parent.id}" in fig.layout.title.text
    # a stale or junk id shows the iteration's default node instead: one with both distributions at its parent
    default = default_node(it)
    assert inspect(greedy_run, 0, 10_000)[0] == default and inspect(greedy_run, 0, "junk")[0] == default
    for run_it in greedy_run.iterations:
        shown = next(n for n in run_it.nodes if n.id == default_node(run_it))
        parent = next(n for n in run_it.nodes if n.id == shown.parent)
        assert shown.status in (BONUS, REJECTED) and parent.next_p and parent.next_q
    assert inspect(None, 0, 1)[0] is None and not inspector_figure(None, None).data


# -- the cost panel --------------------------------------------------------------------------------------------------
def cost_run(comparison=None) -> RunResult:
    its = []
    for i, (rows, d_rows, committed) in enumerate(((8, [2, 4], 3), (16, [2, 4, 8], 1), (4, [2], 2))):
        it = iteration([node(1, 0, 0.5, ACCEPTED)], index=i)
        it.new_tokens = [1] * committed
        it.cost = IterationCost(draft_rows=d_rows, verify_rows=rows, predicted_draft_s=0.01 * len(d_rows),
                                predicted_verify_s=0.002 * rows, predicted_s=0.01 * len(d_rows) + 0.002 * rows,
                                measured_draft_s=0.012 * len(d_rows), measured_verify_s=0.0025 * rows,
                                measured_s=0.012 * len(d_rows) + 0.0025 * rows)
        its.append(it)
    metrics = run_metrics(its, 7, 0.7, 0.05)  # 10 tokens/s
    return RunResult(prompt="p", prompt_ids=[1], output_ids=[0] * 7, output_text="", strategy="x", params={},
                     config=RunConfig(), iterations=its, metrics=metrics, comparison=comparison)


def test_cost_panel_draws_the_recorded_costs():
    run = cost_run(comparison=Comparison(speedup_vs_ar=2.0))  # AR: 5 tokens/s = 200 ms per token
    rows = cost_rows(run)
    assert [r["verify_rows"] for r in rows] == [8, 16, 4]
    fig = cost_figure(run)
    by_name = {t.name: t for t in fig.data}
    assert list(by_name["verify, measured"].x) == [8, 16, 4]
    assert list(by_name["verify, measured"].y) == pytest.approx([20.0, 40.0, 10.0])
    assert list(by_name["verify, predicted (cost table)"].x) == [4, 8, 16]  # a line, sorted by n
    assert list(by_name["draft, measured"].x) == [6, 14, 2]  # rows drafted in all
    assert list(by_name["iteration, measured"].y) == pytest.approx([44.0, 76.0, 22.0])
    assert list(by_name["iteration, predicted"].y) == pytest.approx([36.0, 62.0, 18.0])
    # break-even: AR's time for the tokens each iteration committed (200 ms per token)
    assert list(by_name["break-even: AR for the same tokens"].y) == pytest.approx([600.0, 200.0, 400.0])
    assert any("AR: one token 200 ms" in (a.text or "") for a in fig.layout.annotations)


def test_cost_panel_without_ar_or_records_says_so():
    fig = cost_figure(cost_run())
    assert "break-even: AR for the same tokens" not in {t.name for t in fig.data}
    assert any("once AR is measured" in (a.text or "") for a in fig.layout.annotations)
    empty = cost_figure(iteration_run_without_costs())
    assert not empty.data and "no cost records" in empty.layout.annotations[-1].text


def iteration_run_without_costs() -> RunResult:
    run = cost_run()
    for it in run.iterations:
        it.cost = None
    return run


def test_top_k_lists_each_rows_most_probable_tokens(related_pair):
    from engine.records import top_k
    tok = related_pair.tokenizer
    probs = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), dim=-1)
    out = top_k(tok, probs)
    for row, entries in zip(probs, out):
        values, ids = torch.topk(row, TOP_K)
        assert [e[0] for e in entries] == ids.tolist()
        assert [e[1] for e in entries] == pytest.approx(values.tolist(), rel=1e-3)
        assert [e[2] for e in entries] == [tok.decode([i]) for i in ids.tolist()]
    assert top_k(tok, probs[:0]) == []


def test_cost_panel_title_says_how_far_the_run_is_from_the_table():
    run = cost_run()  # measured: draft 1.2×, verify 1.25× the prediction (the first iteration left out)
    title = cost_figure(run).layout.title.text
    assert "draft 1.20×, verify 1.25×" in title and "beyond" not in title  # 2 iterations: too few to warn
    run.metrics.cost_drift = {"draft": 1.6, "verify": 1.0, "iterations": 10}
    title = cost_figure(run).layout.title.text
    assert "draft 1.60×, verify 1.00×" in title and "beyond ×1.3" in title


def test_the_metrics_row_says_when_auto_takes_ar_steps_and_why(related_pair, monkeypatch):
    """The auto preset's verdict reaches the page: 'no tree pays here', with the predicted speeds, c and t(n)."""
    from engine.measure.autosize import AutoSizer, auto_sizing
    from engine.measure.costs import LADDER, ModelCosts, PairCosts
    from treeviz.figures.html import metrics_html
    monkeypatch.setattr(AutoSizer, "scale", lambda self: (1.0, 1.0))  # the synthetic table as given
    costs = PairCosts(ModelCosts("t", {"plain": {r: 0.01 + 0.001 * r for r in LADDER}}),
                      ModelCosts("d", {"plain": {r: 0.1 for r in LADDER}}))  # a draft step of ten target steps
    monkeypatch.setattr(related_pair, "costs", costs)
    run = Decoder(related_pair, make_strategy("dynatree", preset="auto"), plugins=(auto_sizing,)).generate(
        "hi", max_new_tokens=16, stop_on_eos=False)
    text = metrics_html(run)
    assert "auto: AR steps" in text and "no tree pays here" in text and "c = " in text and "t(" in text
    assert "iterations were AR steps" in text
    plain = Decoder(related_pair, make_strategy("dynatree")).generate("hi", max_new_tokens=16, stop_on_eos=False)
    assert "auto:" not in metrics_html(plain)  # a fixed preset: nothing to explain
