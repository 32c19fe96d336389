"""The run's typed records in a trace (schema 7): metrics, config, comparison, token sources and stage times load as
dataclasses; older traces (the gallery's are schema 2) convert on load; a round trip changes nothing."""
import copy
import json
from dataclasses import asdict
from pathlib import Path

import pytest

from engine.core.trace import (SCHEMA_VERSION, Comparison, RunConfig, RunMetrics, RunSampling, SourceAcceptance,
                               StageTimes, TokenSource, TraceError, load_run, run_from_dict)
from engine.decoder import Decoder
from engine.strategies import make_strategy

GALLERY = Path(__file__).resolve().parent.parent / "assets" / "traces"
OLD = GALLERY / "default_code_dynatree_cpu.json"  # schema 2: no stage_s total, no cost_drift, no acceptance_by_source


@pytest.fixture(scope="module")
def fresh(related_pair):
    return Decoder(related_pair, make_strategy("dynatree")).generate("def f(n):", max_new_tokens=12,
                                                                    stop_on_eos=False)


def test_schema_is_7_and_the_json_keeps_the_field_names(fresh):
    data = json.loads(fresh.to_json())
    assert SCHEMA_VERSION == 7 and data["schema_version"] == 7
    assert set(data["metrics"]) == {
        "new_tokens", "iterations", "total_s", "ttft_s", "tpot_s", "tokens_per_s", "mean_tokens_per_iter",
        "mean_accepted_len", "acceptance_rate", "acceptance_by_source", "per_depth_acceptance", "mean_drafted",
        "mean_draft_forwards", "stage_s", "cost_drift", "speedup_vs_ar"}
    assert set(data["metrics"]["stage_s"]) == {"draft", "build", "verify", "commit", "record", "total"}
    assert set(data["metrics"]["acceptance_by_source"]["model"]) == {"drafted", "accepted", "rate"}
    assert set(data["iterations"][0]["times"]) == {"draft", "build", "verify", "commit", "record", "total"}
    assert data["token_sources"][0] == {"iteration": -1, "kind": "prefill", "margin": fresh.token_sources[0].margin,
                                        "text": fresh.token_sources[0].text}
    assert data["config"]["sampling"] == {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0}
    assert data["metrics"]["speedup_vs_ar"] is None and data["comparison"] is None  # not compared


def test_a_round_trip_is_identical(fresh):
    for compact in (False, True):
        back = run_from_dict(json.loads(fresh.to_json(compact)))
        assert back == fresh
        assert back.to_dict() == fresh.to_dict()
    assert isinstance(fresh.metrics, RunMetrics) and isinstance(fresh.config, RunConfig)
    assert isinstance(fresh.metrics.stage_s, StageTimes) and isinstance(fresh.iterations[0].times, StageTimes)
    assert all(isinstance(s, TokenSource) for s in fresh.token_sources)
    assert fresh.metrics.stage_s.total == pytest.approx(sum(it.times.total for it in fresh.iterations))


def renamed_other(times: dict) -> dict:
    """An older trace's stage times as schema 7 names them ("other" became "record")."""
    return {("record" if k == "other" else k): v for k, v in times.items()}


def test_a_schema_2_trace_loads_into_the_typed_fields():
    data = json.loads(OLD.read_text())
    assert data["schema_version"] == 2 and "total" not in data["metrics"]["stage_s"]
    run = load_run(OLD)
    m, raw = run.metrics, data["metrics"]
    assert isinstance(m, RunMetrics)
    assert (m.new_tokens, m.iterations, m.total_s, m.ttft_s, m.tpot_s, m.tokens_per_s) == (
        raw["new_tokens"], raw["iterations"], raw["total_s"], raw["ttft_s"], raw["tpot_s"], raw["tokens_per_s"])
    assert (m.mean_tokens_per_iter, m.mean_accepted_len, m.acceptance_rate, m.per_depth_acceptance) == (
        raw["mean_tokens_per_iter"], raw["mean_accepted_len"], raw["acceptance_rate"], raw["per_depth_acceptance"])
    assert m.stage_s == StageTimes(**renamed_other(raw["stage_s"]), total=sum(raw["stage_s"].values()))  # summed
    assert m.acceptance_by_source == {} and m.cost_drift == {} and m.speedup_vs_ar is None  # absent then
    assert run.comparison == Comparison(**data["comparison"])
    assert run.config == RunConfig(**{**data["config"], "sampling": RunSampling(**data["config"]["sampling"])})
    assert run.config.steps == "eager"  # schema 2 did not record it: eager, as every reader assumed
    assert run.token_sources == [TokenSource(**s) for s in data["token_sources"]]
    assert [asdict(it.times) for it in run.iterations] == [renamed_other(it["times"]) for it in data["iterations"]]
    # converted, then written as schema 7 and read back: the same typed run
    assert run_from_dict(json.loads(run.to_json())) == run


def test_old_metrics_with_unknown_or_missing_keys_load():
    data = json.loads(OLD.read_text())
    data["schema_version"] = 5
    data["metrics"]["retired_metric"] = 1.5  # a key no field holds: dropped
    del data["metrics"]["tpot_s"], data["metrics"]["stage_s"]  # missing: defaults
    data["comparison"]["ar_cache_note"] = "gone"
    data["config"]["retired_option"] = True
    del data["config"]["machine"], data["config"]["sampling"]
    data["token_sources"][0] = {"iteration": -1, "kind": "prefill"}  # before sources carried text and margins
    run = run_from_dict(copy.deepcopy(data))  # run_from_dict takes the dict apart
    assert run.metrics.tpot_s is None and run.metrics.stage_s == StageTimes()
    assert run.metrics.new_tokens == data["metrics"]["new_tokens"] and not hasattr(run.metrics, "retired_metric")
    assert run.comparison.speedup_vs_ar == data["comparison"]["speedup_vs_ar"]
    assert run.config.machine is None and run.config.sampling == RunSampling() and run.config.sampling.greedy
    assert run.token_sources[0] == TokenSource(iteration=-1, kind="prefill", margin=None, text=None)
    data["metrics"]["acceptance_by_source"] = {"model": {"drafted": 4, "accepted": 2, "rate": 0.5}}
    assert run_from_dict(data).metrics.acceptance_by_source == {"model": SourceAcceptance(4, 2, 0.5)}


def test_a_trace_whose_metrics_are_not_an_object_is_refused():
    data = json.loads(OLD.read_text())
    data["metrics"] = [1, 2]
    with pytest.raises(TraceError, match="not a treeviz trace"):
        run_from_dict(data)


def test_a_schema_5_trace_written_by_the_previous_code_loads_typed():
    """tests/data/trace_schema5_dynatree_tiny.json was saved (compact) by the last schema-5 code: DynaTree on the tiny
    related pair, compared with AR. Every dict of that era becomes its dataclass, with the same values."""
    path = Path(__file__).resolve().parent / "data" / "trace_schema5_dynatree_tiny.json"
    raw = json.loads(path.read_text())
    assert raw["schema_version"] == 5
    run = load_run(path)
    assert isinstance(run.metrics, RunMetrics) and isinstance(run.config, RunConfig)
    assert isinstance(run.comparison, Comparison) and run.comparison.exact_match is True
    assert run.comparison.speedup_vs_ar == raw["comparison"]["speedup_vs_ar"] == run.metrics.speedup_vs_ar
    assert run.metrics.tokens_per_s == raw["metrics"]["tokens_per_s"]
    assert run.metrics.stage_s.total == pytest.approx(sum(raw["metrics"]["stage_s"].values()))  # 5 had no total
    assert run.config.sampling == RunSampling(**raw["config"]["sampling"])
    assert [asdict(s) for s in run.token_sources] == raw["token_sources"]
    assert all(isinstance(it.times, StageTimes) for it in run.iterations)
    old = raw["iterations"][0]["times"]  # schema < 7 named the record stage "other"
    assert asdict(run.iterations[0].times) == renamed_other(old)
    assert run.iterations[0].times.record == old["other"]
    assert run.metrics.stage_s.record == raw["metrics"]["stage_s"]["other"]
    assert run_from_dict(run.to_dict()).to_dict() == run.to_dict()  # and it saves as schema 7 without loss
