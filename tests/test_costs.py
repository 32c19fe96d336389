"""Measured costs (engine/measure/costs.py) and the auto preset (engine/measure/autosize.py): cache identity,
predictions from a table, routing installed at load, predicted vs measured cost in every record, auto sizing as the
table says."""
import json

import pytest
import torch

from engine.cpu.kernels import router_of
from engine.core.trace import IterationCost, IterationRecord, StageTimes
from engine.decoder import Decoder
from engine.measure import costs as costs_mod
from engine.measure.autosize import WINDOW, AutoSizer, auto_sizing
from engine.measure.costs import CONTEXTS, LADDER, PREFIX, ModelCosts, PairCosts, interpolate, model_costs
from engine.models import load_pair, tiny_random_pair
from engine.strategies import STRATEGIES, make_strategy


@pytest.fixture(autouse=True)
def private_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TREEVIZ_CACHE", str(tmp_path))


def table(f) -> dict[int, float]:
    return {r: f(r) for r in LADDER}


def test_interpolation_between_and_past_rungs():
    points = {1: 1.0, 2: 2.0, 4: 2.0, 8: 6.0}
    assert interpolate(points, 1) == 1.0 and interpolate(points, 3) == 2.0
    assert interpolate(points, 6) == 4.0
    assert interpolate(points, 12) == 10.0  # the last segment's slope, extended
    assert interpolate({1: 2.0, 2: 1.0}, 5) == 1.0  # never extrapolates downward


def test_predictions_from_a_synthetic_table():
    target = ModelCosts("t", {"plain": table(lambda r: 0.1 + 0.01 * r)})
    draft = ModelCosts("d", {"plain": table(lambda r: 0.02 + 0.001 * r)})
    pair = PairCosts(target, draft)
    assert pair.step == pytest.approx(0.11)
    assert pair.c == pytest.approx(0.021 / 0.11)
    assert pair.t(16) == pytest.approx(0.26 / 0.11)
    predicted = pair.predict([3, 2, 4], 9)
    assert predicted["draft_s"] == pytest.approx(0.023 + 0.022 + 0.024)
    assert predicted["verify_s"] == pytest.approx(0.19)
    assert predicted["total_s"] == pytest.approx(predicted["draft_s"] + predicted["verify_s"])
    json.dumps(pair.to_dict())  # plain data for reports


class Counter:
    """A stand-in measurement that records each call (the cache tests are about identity, not timing)."""

    def __init__(self):
        self.calls = []

    def __call__(self, model, paths, **kw):
        self.calls.append(list(paths))
        return {p: table(lambda r: 0.001 * r) for p in paths}


def test_cache_reused_and_invalidated_by_machine_model_dtype_torch(monkeypatch):
    model = tiny_random_pair(None, seed=0).target
    cpu = torch.device("cpu")
    measure = Counter()
    model_costs(model, "tiny", torch.float32, cpu, measure_fn=measure)
    model_costs(model, "tiny", torch.float32, cpu, measure_fn=measure)
    fresh = 1 + len(CONTEXTS)  # a new table: one sweep per context length
    assert len(measure.calls) == fresh  # second load read the disk cache
    model_costs(model, "tiny", torch.bfloat16, cpu, measure_fn=measure)  # another dtype
    model_costs(model, "other", torch.float32, cpu, measure_fn=measure)  # another model
    other = tiny_random_pair(None, seed=0, num_layers=3).target  # same name, another architecture
    model_costs(other, "tiny", torch.float32, cpu, measure_fn=measure)
    assert len(measure.calls) == 4 * fresh
    real = costs_mod.machine
    monkeypatch.setattr(costs_mod, "machine", lambda d: {**real(d), "cpu": "another CPU"})
    model_costs(model, "tiny", torch.float32, cpu, measure_fn=measure)
    monkeypatch.setattr(costs_mod, "machine", lambda d: {**real(d), "torch": "9.9"})
    model_costs(model, "tiny", torch.float32, cpu, measure_fn=measure)
    assert len(measure.calls) == 6 * fresh
    monkeypatch.setattr(costs_mod, "machine", real)
    model_costs(model, "tiny", torch.float32, cpu, measure_fn=measure)
    assert len(measure.calls) == 6 * fresh  # back on the first machine: its table is still there
    model_costs(model, "tiny", torch.float32, cpu, recalibrate=True, measure_fn=measure)
    assert len(measure.calls) == 7 * fresh


class Ranked(Counter):
    """Plain 1 ms per row, packed 1.5 (loses at every rung), int8 0.5 (wins at every rung)."""
    SPEED = {"plain": 1.0, "packed": 1.5, "int8": 0.5}

    def __call__(self, model, paths, **kw):
        self.calls.append(list(paths))
        return {p: table(lambda r, p=p: 0.001 * r * self.SPEED[p]) for p in paths}


def test_a_new_path_is_measured_alone_and_merged_and_other_contexts_only_for_winners():
    pair = tiny_random_pair("related", seed=0, packed=True)
    measure = Ranked()
    first = model_costs(pair.draft, "d", torch.float32, pair.device, measure_fn=measure)
    assert measure.calls == [["plain", "packed"]] + [["plain"]] * len(CONTEXTS) and first.measured
    assert all(t["packed"] == {r: float("inf") for r in LADDER} for t in first.contexts.values())  # priced, not guessed
    from engine.cpu.kernels import quantize_linears
    quantize_linears(pair.draft, "int8")
    second = model_costs(pair.draft, "d", torch.float32, pair.device, measure_fn=measure)
    assert measure.calls[2:] == [["int8"]] * (1 + len(CONTEXTS))  # int8 wins somewhere: both context lengths
    assert set(second.seconds) == {"plain", "packed", "int8"}
    assert all(set(t) == {"plain", "packed", "int8"} for t in second.contexts.values())


def test_a_losing_path_is_not_climbed(related_pair):
    # measure itself: a path twice the best at a rung gets infinity above it, and never wins a row count there
    from engine.cpu.kernels import KERNELS, add_format
    import time as time_mod
    model = tiny_random_pair("related", seed=0).target
    add_format(model, "int8")
    slow = KERNELS["int8"]
    try:
        KERNELS["int8"] = lambda *a: (time_mod.sleep(0.004), slow(*a))[1]  # a kernel far slower than plain
        seconds = costs_mod.measure(model, ["plain", "int8"], ladder=(1, 2, 4), repeats=1)
    finally:
        KERNELS["int8"] = slow
    assert seconds["int8"][1] > 2 * seconds["plain"][1]
    assert seconds["int8"][2] == seconds["int8"][4] == float("inf")
    assert ModelCosts("m", seconds).routing(4) == ["plain"] * 4


def test_a_table_cached_before_context_lengths_loads_and_gains_them():
    """A file in the one-context format (no "contexts") keeps its PREFIX table; only the other lengths are measured."""
    model = tiny_random_pair(None, seed=0).target
    cpu = torch.device("cpu")
    key = costs_mod.table_key(model, "tiny", torch.float32, cpu)
    old = {p: {str(r): 0.5 for r in LADDER} for p in ("plain",)}
    costs_mod.write_json(costs_mod.table_file(key), {"key": key, "seconds": old, "measured_at": 0, "busy": None})
    measure = Counter()
    table_ = model_costs(model, "tiny", torch.float32, cpu, measure_fn=measure)
    assert table_.seconds == {"plain": {r: 0.5 for r in LADDER}}
    assert len(measure.calls) == len(CONTEXTS) and set(table_.contexts) == set(CONTEXTS)


def test_costs_interpolate_between_context_lengths():
    long = 4 * PREFIX
    costs = ModelCosts("t", {"plain": table(lambda r: 1.0 + r)}, contexts={long: {"plain": table(lambda r: 2.0 + r)}})
    assert costs.time(4) == 5.0 and costs.time(4, context=PREFIX) == 5.0 and costs.time(4, context=long) == 6.0
    assert costs.time(4, context=(PREFIX + long) // 2) == pytest.approx(5.5)
    assert costs.time(4, context=10) == 5.0  # flat below the shortest context measured
    assert costs.time(4, context=7 * PREFIX) == pytest.approx(7.0)  # the last slope beyond the longest
    pair = PairCosts(costs, costs)
    assert pair.predict([1], 4, context=long) == {"draft_s": 3.0, "verify_s": 6.0, "total_s": 9.0}


def test_calibration_measures_the_routed_models_and_keeps_the_probes_routing():
    pair = load_pair("tiny-random", "tiny-random", dtype="fp32", packed="on", draft_quant="int8")
    assert pair.costs is not None and set(pair.formats) == {"target", "draft"}
    for role, model, table_ in (("target", pair.target, pair.costs.target), ("draft", pair.draft, pair.costs.draft)):
        assert set(table_.seconds) == {costs_mod.ROUTED}  # timed as routed: a routing per shape group
        points = table_.seconds[costs_mod.ROUTED]
        assert set(points) == set(LADDER) and min(points.values()) > 0
        router = router_of(model)
        assert router.by_group == pair.formats[role].routing()  # the probe's routing stays installed
        assert "plain" not in router.paths or "lm_head" in router.describe()  # packed="on": plain freed
    assert pair.costs.bandwidth > 0 and pair.costs.target.step_bytes > 0


def synthetic_pair(verify, draft=lambda r: 1e-4) -> PairCosts:
    return PairCosts(ModelCosts("t", {"plain": table(verify)}), ModelCosts("d", {"plain": table(draft)}))


def test_records_carry_predicted_and_measured_cost():
    pair = tiny_random_pair("related", seed=0)
    pair.costs = synthetic_pair(lambda r: 0.01 * r)
    result = Decoder(pair, make_strategy("dynatree")).generate("abc", max_new_tokens=12, stop_on_eos=False)
    for it in result.iterations:
        cost = it.cost
        assert cost.verify_rows == len([n for n in it.nodes if n.status != "bonus"])
        assert len(cost.draft_rows) == it.draft_forwards
        assert cost.predicted_verify_s == pytest.approx(0.01 * cost.verify_rows)
        assert cost.measured_s == pytest.approx(it.times.draft + it.times.verify)
    json.dumps(result.to_dict())


def run_auto(name, costs, tokens=60, monkeypatch=None):
    """With `monkeypatch`, the sizer trusts the table as given: the synthetic tables are 10-500× the tiny models' real
    times, and these tests check the sizing against the table alone (the run-time scale has its own tests)."""
    if monkeypatch is not None:
        monkeypatch.setattr(AutoSizer, "scale", lambda self: (1.0, 1.0))
    pair = tiny_random_pair("identical", seed=0)  # every drafted token is accepted: size pays until cost says no
    pair.costs = costs
    strategy = make_strategy(name, "auto", stop_below=0.0)  # chains as long as k: only the sizer decides
    result = Decoder(pair, strategy, plugins=(auto_sizing,)).generate("hello", max_new_tokens=tokens,
                                                                    stop_on_eos=False)
    return strategy, result


def test_auto_grows_the_tree_when_verification_is_flat(monkeypatch):
    strategy, result = run_auto("linear", synthetic_pair(lambda r: 0.05), monkeypatch=monkeypatch)
    ks = [it.params["k"] for it in result.iterations]
    assert ks[0] == STRATEGIES["linear"].presets["cpu"]["k"]
    assert ks == sorted(ks) and ks[-1] > ks[0]  # each chain longer than the last


def test_auto_stops_where_verification_gets_expensive(monkeypatch):
    # verifying up to 4 rows costs one step, 8 rows ten (5 rows 3.25 by interpolation): the best chain has 3
    # drafted tokens (+ the root)
    strategy, result = run_auto("linear", synthetic_pair(lambda r: 0.05 if r <= 4 else 0.5), monkeypatch=monkeypatch)
    last = result.iterations[-1].cost.auto
    assert last["best_size"] == 3 and result.params["k"] == 4  # 25 % headroom above the best
    assert result.iterations[-1].params["k"] == 4


def test_auto_preset_exists_for_every_strategy():
    for name, cls in STRATEGIES.items():
        strategy = make_strategy(name, "auto")
        assert strategy.auto == (cls.auto_param is not None)
        if cls.auto_param is not None:
            assert cls.auto_param in strategy.current_params()
    # without a cost table the auto preset runs its starting values unchanged
    pair = tiny_random_pair("related", seed=0)
    result = Decoder(pair, make_strategy("dynatree", "auto"), plugins=(auto_sizing,)).generate(
        "abc", max_new_tokens=10, stop_on_eos=False)
    assert {it.params["budget"] for it in result.iterations} == {STRATEGIES["dynatree"].presets["cpu"]["budget"]}


def test_a_level_builder_prices_its_first_nodes_level_by_level():
    from engine.measure.autosize import Sample, predicted
    # root 0 -> 1, 2; 1 -> 3, 4; 3 -> 5. Accepted path 1, 3, 5. Forwards made: root (3 rows with 2 pending), [1, 2],
    # [3, 4], [5].
    sample = Sample(parents=[-1, 0, 0, 1, 1, 3], depths=[0, 1, 1, 2, 2, 3], accepted=[1, 3, 5], first_rows=3,
                    draft_rows=[3, 2, 2, 1], overhead_s=0.6)
    costs = synthetic_pair(lambda r: float(r), draft=lambda r: 0.1 * r)
    fixed = make_strategy("fixed")
    at = lambda m, scale=(1.0, 1.0): predicted(sample, fixed.cost_at(sample, m), costs, scale)  # noqa: E731
    assert at(5) == (4, pytest.approx(0.3 + 0.2 + 0.2 + 0.1 + 6 + 0.6))  # as made
    # first 3 nodes: 1, 2 (children of the root) and 3 (child of 1): levels root (3 rows) and [1] (1 row); the
    # overhead pro rata to the rows kept
    assert at(3) == (3, pytest.approx(0.3 + 0.1 + 4 + 0.4))
    assert at(1) == (2, pytest.approx(0.3 + 2 + 0.2))
    assert at(5, (2.0, 0.5)) == (4, pytest.approx(2.0 * 0.8 + 0.5 * 6 + 0.6))  # scales apply to draft and verify apart


@pytest.mark.parametrize("verify", [lambda r: 0.05, lambda r: 0.05 if r == 1 else 5.0], ids=["trees", "rests"])
def test_sizer_scales_the_table_by_the_windows_measured_times(verify):
    # the real path: the tiny models' measured seconds against a table 10-500× off, as after a large drift; with
    # verification dear, no tree pays and the sizer asks for AR steps, which teach it nothing about trees
    strategy, result = run_auto("linear", synthetic_pair(verify, draft=lambda r: 1e-4), tokens=40)
    window = [it.cost for it in result.iterations if it.index > 0 and it.drafted > 0][-WINDOW:]
    draft = sum(c.measured_draft_s for c in window) / sum(c.predicted_draft_s for c in window)
    verify = sum(c.measured_verify_s for c in window) / sum(c.predicted_verify_s for c in window)
    assert result.iterations[-1].cost.auto["table_scale"] == pytest.approx([draft, verify])
    assert result.metrics.cost_drift["iterations"] == len(result.iterations) - 1


def cost_record(index, draft, verify):
    it = IterationRecord(index=index, position=0, nodes=[], accepted_path=[0], bonus_token=0, bonus_text="",
                         new_tokens=[0], drafted=0, accepted=0, draft_forwards=0, params={}, times=StageTimes())
    it.cost = IterationCost(draft_rows=[], verify_rows=0, predicted_draft_s=1.0, predicted_verify_s=2.0,
                            predicted_s=3.0, measured_draft_s=draft, measured_verify_s=2.0 * verify,
                            measured_s=draft + 2.0 * verify)
    return it


def test_drift_leaves_out_the_prompt_iteration_and_warns_beyond_tolerance():
    from engine.measure.metrics import DRIFT_MIN_ITERATIONS, cost_drift, drift_warning
    steady = [cost_record(0, 9.0, 9.0)] + [cost_record(i, 1.1, 0.9) for i in range(1, 6)]
    drift = cost_drift(steady)
    assert drift == {"draft": pytest.approx(1.1), "verify": pytest.approx(0.9), "iterations": 5}
    assert drift_warning(drift) is None
    slow = [cost_record(i, 1.5, 1.0) for i in range(1, 6)]
    text = drift_warning(cost_drift(slow))
    assert "draft 1.50×" in text and "verify" not in text.split("the cost table")[0] and "--recalibrate" in text
    fast = [cost_record(i, 1.0, 0.7) for i in range(1, 6)]
    assert "verify 0.70×" in drift_warning(cost_drift(fast))
    few = [cost_record(i, 3.0, 3.0) for i in range(1, DRIFT_MIN_ITERATIONS)]
    assert drift_warning(cost_drift(few)) is None  # too little evidence
    assert cost_drift([]) == {} and drift_warning({}) is None


def test_the_timing_cache_is_filled_without_a_prefill_and_times_like_one(related_pair):
    """A table's forwards read a cache of random keys and values (no prefill to pay): its length is the prefix's,
    and a forward over it reads as many positions as over a prefilled one (same logits shape, same cache growth)."""
    model = related_pair.target
    ids = costs_mod.probe_ids(model, 40)
    with torch.inference_mode():
        cache = costs_mod.filled_cache(model, ids, 32)
        assert cache.get_seq_length() == 32
        seconds = costs_mod.timed_forward(model, ids, 32, 4, cache)
    assert seconds > 0 and cache.get_seq_length() == 32  # rolled back after the timed forward
