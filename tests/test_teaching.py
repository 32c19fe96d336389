"""The teaching pieces (docs/teaching.md): the race's timeline, one iteration step by step, the size sweep, the acceptance
histogram, entropy sizing and the standalone HTML export. Tiny random pair, a few tokens; gallery traces with no
model loaded."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from engine.bench.sweep import MAX_POINTS, predicted_tokens_per_s, run_sweep, size_values
from engine.core.trace import IterationCost, IterationRecord, NodeRecord, StageTimes, load_run
from engine.measure.timeline import accepted_length_counts, parent_entropies, speedup, token_timeline, top_k_entropy
from engine.recipe import RunSpec, start_run
from treeviz.figures.charts_teaching import acceptance_histogram_figure, entropy_sizes
from treeviz.figures.export import export_html, tree_replay_figure
from treeviz.figures.html import TOKEN_KIND_STYLE
from treeviz.figures.race import NOTE, SPEEDS, race_figure, race_lanes, race_summary, wrap_tokens
from treeviz.figures.stepthrough import (GROUP_REJECTED, stepthrough_figure, stepthrough_steps, teaching_iteration,
                                         verdict_order)
from treeviz.figures.sweep_figure import sweep_figure

GALLERY = Path(__file__).resolve().parent.parent / "assets" / "traces"
PROMPT = "The quick brown fox"


def decode(pair, strategy: str, tokens: int = 24, **params):
    run = start_run(pair, RunSpec(pair="tiny-random", prompt=PROMPT, strategy=strategy, max_new_tokens=tokens,
                                  params=params))
    for _ in run:
        pass
    return run.result


@pytest.fixture(scope="module")
def race_runs(related_pair):
    return [("AR", decode(related_pair, "ar")), ("DynaTree", decode(related_pair, "dynatree"))]


@pytest.fixture(scope="module")
def gallery_run():
    return load_run(GALLERY / "default_chat_dynatree_paper.json")


# -- the timeline and the race -----------------------------------------------------------------------------------
def test_timeline_follows_the_records_and_finishes_at_the_measured_decode_time(race_runs, gallery_run):
    for run in [r for _, r in race_runs] + [gallery_run]:
        events = token_timeline(run)
        assert [e["token"] for e in events] == run.output_ids
        assert [e["kind"] for e in events] == [s.kind for s in run.token_sources]
        assert events[0]["time_s"] == pytest.approx(run.metrics.ttft_s)
        times = [e["time_s"] for e in events]
        assert times == sorted(times)
        # the lane's finish is the run's measured decode time, within 5 %
        assert abs(times[-1] - run.metrics.total_s) <= 0.05 * run.metrics.total_s
        # each iteration's tokens share one timestamp: the cumulative measured time of that iteration
        for it in run.iterations:
            mine = {e["time_s"] for e in events if e["iteration"] == it.index}
            assert len(mine) <= 1


def test_timeline_refuses_sources_that_disagree_with_the_records(race_runs):
    run = load_run_copy(race_runs[1][1])
    run.token_sources = run.token_sources[:-2]
    with pytest.raises(ValueError, match="token sources"):
        token_timeline(run)


def load_run_copy(run):
    from engine.core.trace import run_from_dict
    return run_from_dict(json.loads(run.to_json()))


def test_speedup_is_ar_decode_time_over_the_run_s(race_runs):
    ar, tree = race_runs[0][1], race_runs[1][1]
    assert len(ar.output_ids) == len(tree.output_ids)  # greedy: same tokens, so the ratio of times
    assert speedup(tree, ar) == pytest.approx(ar.metrics.total_s / tree.metrics.total_s, rel=1e-9)


def test_race_figure_replays_every_token_at_three_speeds(race_runs):
    fig = race_figure(race_runs)
    menu = fig.layout.updatemenus[0].buttons
    durations = {b.label: b.args[1]["frame"]["duration"] for b in menu if b.args[0] is None}
    assert [f"▶ {s:g}×" for s in SPEEDS] == list(durations)
    assert durations["▶ 0.25×"] == pytest.approx(4 * durations["▶ 1×"])
    assert NOTE in fig.layout.annotations[0].text
    assert len(fig.layout.sliders[0].steps) == len(fig.frames) >= 10
    lanes = race_lanes(race_runs)
    first, last = fig.frames[0], fig.frames[-1]
    bars = [t for t in last.data if t.type == "bar"]
    assert [len(b.x) for b in bars] == [len(lane.events) for lane in lanes]  # everything in by the end
    assert all(len(b.x) == 0 for b in first.data if b.type == "bar")         # nothing before the prefill ends
    kinds = [e["kind"] for e in lanes[1].events]
    assert list(bars[1].marker.color) == [TOKEN_KIND_STYLE[k][0] for k in kinds]
    statuses = [t.text[0] for t in last.data if t.type == "scatter" and "done in" in t.text[0]]
    winner = race_summary(race_runs)["winner"]
    assert len(statuses) == 2 and sum("winner" in s for s in statuses) == 1
    assert ("winner" in statuses[0]) == (winner == "AR")


def test_race_needs_ar_and_one_prompt(race_runs, related_pair):
    with pytest.raises(ValueError, match="two or more"):
        race_figure(race_runs[:1])
    with pytest.raises(ValueError, match="exactly one AR"):
        race_figure([race_runs[1], ("again", race_runs[1][1])])
    other = start_run(related_pair, RunSpec(pair="tiny-random", prompt="Another prompt", strategy="linear",
                                            max_new_tokens=4))
    for _ in other:
        pass
    with pytest.raises(ValueError, match="same prompt"):
        race_figure([race_runs[0], ("linear", other.result)])


def test_wrap_tokens_breaks_at_the_width_and_at_newlines():
    cells = wrap_tokens(["abc", "de\n", "fgh", "ijklm"], width=6)
    assert cells == [(0, 0, "abc"), (3, 0, "de⏎"), (0, 1, "fgh"), (0, 2, "ijklm")]


# -- one iteration, step by step -----------------------------------------------------------------------------------
def test_stepthrough_walks_draft_verdicts_and_commit_from_a_gallery_trace(gallery_run):
    it = teaching_iteration(gallery_run)
    assert it.accepted >= 1 and any(n.status == "rejected" for n in it.nodes)
    steps = stepthrough_steps(it)
    labels = [s["label"] for s in steps]
    depth = max(n.depth for n in it.nodes if n.status not in ("root", "bonus"))
    assert labels[0] == "root" and labels[1:depth + 1] == [f"draft {d}" for d in range(1, depth + 1)]
    assert labels[-1] == "commit"
    judged = [n for s in steps if s["label"].startswith("verify") for n in s["current"]]
    tested = [n.id for n in it.nodes if n.status in ("accepted", "rejected", "bonus")]
    assert sorted(judged) == sorted(tested)  # every verdict shown exactly once
    by_id = {n.id: n for n in it.nodes}
    for s in steps:
        if s["label"].startswith("verify") and len(s["current"]) == 1:
            node = by_id[next(iter(s["current"]))]
            assert node.status.split()[0] in s["caption"] or node.status == "bonus"
    bonus = next(n.id for n in it.nodes if n.status == "bonus")
    assert steps[-1]["current"] == set(it.accepted_path[1:]) | {bonus}
    fig = stepthrough_figure(it, gallery_run)
    assert len(fig.frames) == len(steps) == len(fig.layout.sliders[0].steps)
    assert len({len(f.data) for f in fig.frames}) == 1  # frames replace traces one for one
    assert "grown by depth" in fig.frames[1].layout.title.text


def test_verdict_order_groups_many_rejected_siblings():
    n = GROUP_REJECTED + 2
    nodes = [NodeRecord(0, -1, 1, "r", 0, None, None, 1.0, None, "root")]
    nodes += [NodeRecord(i, 0, 10 + i, f"t{i}", 1, 0.1, i - 1, 0.1, 0.05, "rejected") for i in range(1, n + 1)]
    nodes.append(NodeRecord(n + 1, 0, 99, "b", 1, None, None, None, 0.5, "bonus"))
    it = IterationRecord(0, 5, nodes, [0], 99, "b", [99], n, 0, 1, {}, StageTimes(total=0.01))
    groups = verdict_order(it)
    assert [len(g) for g in groups] == [n, 1]
    assert [g.rank for g in groups[0]] == list(range(n))


# -- sweep -----------------------------------------------------------------------------------------------------------
def test_size_values_errors_and_default_ranges():
    assert size_values("dyspec") == [1, 2, 4, 8, 16, 32]
    assert size_values("salf")[0] == 8  # below its batch B = 8, SALF refuses N: the range starts where it is valid
    for kwargs, message in (({"strategy": "nope"}, "unknown strategy"), ({"strategy": "ar"}, "no size knob"),
                            ({"strategy": "delayed"}, "no size knob"),
                            ({"strategy": "linear", "lo": 8, "hi": 8}, "empty range"),
                            ({"strategy": "linear", "lo": 1, "hi": 500}, "within"),
                            ({"strategy": "linear", "points": MAX_POINTS + 1}, "2 to"),
                            ({"strategy": "linear", "points": 1}, "2 to")):
        with pytest.raises(ValueError, match=message):
            size_values(**kwargs)


def test_sweep_yields_progress_caches_and_stops(related_pair):
    spec = RunSpec(pair="tiny-random", prompt=PROMPT, strategy="linear", max_new_tokens=6)
    events = list(run_sweep(related_pair, spec, values=[1, 3]))
    assert [e["done"] for e in events] == [1, 2, 3, 3] and events[-1]["complete"]
    sweep = events[-1]["sweep"]
    assert [p["size"] for p in sweep["points"]] == [1, 3] and sweep["ar"]["tokens_per_s"] > 0
    assert sweep["peak"] in (1, 3) and not sweep["has_costs"]
    assert all(p["predicted_tokens_per_s"] is None for p in sweep["points"])
    again = list(run_sweep(related_pair, spec, values=[1, 3]))
    assert len(again) == 1 and again[0]["cached"] and again[0]["sweep"] == sweep
    calls = []
    stopped = list(run_sweep(related_pair, spec, values=[2, 4], cancel=lambda: calls.append(1) or len(calls) > 2))
    assert stopped[-1].get("cancelled") and not stopped[-1].get("complete")
    assert not list(run_sweep(related_pair, spec, values=[2, 4], cancel=lambda: True))[-1].get("cached")


def test_predicted_tokens_per_s_reads_the_records_costs(race_runs):
    run = load_run_copy(race_runs[1][1])
    assert predicted_tokens_per_s(run) is None  # the tiny pair has no cost table
    for it in run.iterations:
        it.cost = IterationCost([1], 2, 0.001, 0.002, 0.003, 0.0, 0.0, 0.0)
    expected = run.metrics.new_tokens / (run.metrics.ttft_s + 0.003 * len(run.iterations))
    assert predicted_tokens_per_s(run) == pytest.approx(expected)


def test_sweep_figure_marks_the_peak_and_says_when_there_is_no_prediction():
    points = [{"size": s, "mean_tokens_per_iter": 1 + s / 8, "acceptance_rate": 0.5, "tokens_per_s": tps,
               "predicted_tokens_per_s": None} for s, tps in ((1, 10.0), (4, 14.0), (16, 9.0))]
    sweep = {"strategy": "dynatree", "param": "budget", "param_label": "budget", "points": points, "peak": 4,
             "ar": {"tokens_per_s": 8.0}, "max_new_tokens": 8, "target": "tiny"}
    fig = sweep_figure(sweep)
    assert any("no cost table" in a.text for a in fig.layout.annotations)
    peak = next(t for t in fig.data if t.name == "peak")
    assert list(peak.x) == [4] and "1.75× AR" in peak.text[0]
    for p in points:
        p["predicted_tokens_per_s"] = 12.0
    fig = sweep_figure(sweep)
    assert any(t.name.startswith("predicted") for t in fig.data)
    assert not any("no cost table" in a.text for a in fig.layout.annotations)


def test_make_sweep_script_writes_json(tmp_path):
    from scripts.make_sweep import make_sweep, parse_args
    path = make_sweep(parse_args(["--pair", "tiny-random", "--strategy", "linear", "--tokens", "4", "--points", "2",
                                  "--out", str(tmp_path), "--no-calibrate"]))
    data = json.loads(path.read_text())
    assert path.name == "sweep_code_linear.json" and len(data["points"]) == 2 and data["ar"]["tokens_per_s"] > 0
    assert sweep_figure(data).data  # the app can draw what the script wrote


# -- histogram and entropy -------------------------------------------------------------------------------------------
def test_acceptance_histogram_counts_and_groups(race_runs, gallery_run):
    its = [IterationRecord(i, 0, [], [0], 0, "", [0] * (a + 1), 3, a, 1, {}, StageTimes())
           for i, a in enumerate([0, 2, 2, 1])]
    assert accepted_length_counts(its) == [1, 1, 2]
    assert accepted_length_counts([]) == []
    fig = acceptance_histogram_figure([race_runs[1], ("gallery", gallery_run)])
    assert [t.type for t in fig.data] == ["bar", "bar"] and fig.layout.barmode == "group"
    for trace, run in zip(fig.data, (race_runs[1][1], gallery_run)):
        assert sum(trace.y) == pytest.approx(1.0)
        assert sum(trace.customdata) == len(run.iterations)


def test_entropy_is_top10_truncated_and_sizes_grow_with_it(gallery_run):
    assert top_k_entropy([[i, 0.1, ""] for i in range(10)]) == pytest.approx(math.log(10))
    assert top_k_entropy([[0, 0.5, ""]]) == pytest.approx(math.log(2))  # the missing half lumped as one outcome
    assert top_k_entropy([]) is None
    it = teaching_iteration(gallery_run)
    entropies, sizes = parent_entropies(it), entropy_sizes(it)
    root = next(n.id for n in it.nodes if n.status == "root")
    assert entropies[root] is None and sizes[root] == pytest.approx((9 + 26) / 2)
    known = sorted((h, sizes[i]) for i, h in entropies.items() if h is not None)
    assert len({h for h, _ in known}) > 1
    assert [s for _, s in known] == sorted(s for _, s in known)


# -- export ----------------------------------------------------------------------------------------------------------
def test_export_writes_one_standalone_page(tmp_path, race_runs, gallery_run):
    path = export_html(tmp_path / "class.html", race_runs, gallery_run)
    page = path.read_text()
    assert "<script src=" not in page and page.count("plotly.js v") == 1  # plotly.js inline, once
    for div in ("tv-race", "tv-step", "tv-replay"):  # three figures, each with its animation frames
        assert f'id="{div}"' in page and f"Plotly.addFrames('{div}'" in page
    replay = tree_replay_figure(gallery_run)
    assert [f.name for f in replay.frames] == [f"i{it.index}" for it in gallery_run.iterations]
    assert len({len(f.data) for f in replay.frames} | {len(replay.data)}) == 1
