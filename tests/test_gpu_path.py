"""The pieces a GPU run takes, checked on the CPU (and, with TREEVIZ_TEST_DEVICE=cuda, on captured CUDA graphs):
AR at its fastest (engine/bench/captured_ar.py) emits the engine's AR, token for token; the cost table measured
through the static steps; a pair's steps kept and reused across runs; the real-shape timing stand-ins
(engine/models/shapes.py) have their published sizes; every strategy on graphed steps emits what the dynamic path emits.
"""
from __future__ import annotations

import os

import pytest
import torch

from engine.bench.captured_ar import CapturedAR
from engine.bench.tables import AR_CAPTURED, bench, run_method
from engine.core.sampling import Sampling
from engine.core.steps import GRAPH_CAPACITY_STEP, StaticSteps, graph_capacity, reuse_static
from engine.measure.costs import LADDER, model_costs
from engine.measure.graphed import measure_graphed
from engine.models import load_pair, tiny_random_pair
from engine.models.shapes import SHAPES, shape_config
from engine.recipe import RunSpec, generate

DEVICE = os.environ.get("TREEVIZ_TEST_DEVICE", "cpu")
PROMPT = "def fib(n):\n    return"
cuda_only = pytest.mark.skipif(DEVICE != "cuda" or not torch.cuda.is_available(),
                               reason="CUDA graphs: run with TREEVIZ_TEST_DEVICE=cuda on a CUDA machine")


@pytest.fixture(scope="module")
def pair():
    """The tiny related pair on the test device: graphed there when it is CUDA (pair.graphs), eager on a CPU."""
    return tiny_random_pair("related", seed=0, dtype=torch.float32, device=DEVICE)


def ar_reference(pair, sampling: Sampling, n: int = 24) -> list[int]:
    spec = RunSpec(pair="tiny", prompt=PROMPT, strategy="ar", max_new_tokens=n, stop_on_eos=False,
                   capture="off", steps="dynamic", **sampling.as_dict())
    return generate(pair, spec).output_ids


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_graphed_ar_emits_the_engines_ar(pair, temperature):
    sampling = Sampling(temperature=temperature, seed=3)
    ids = pair.tokenizer(PROMPT)["input_ids"]
    out = CapturedAR(pair).generate(ids, 24, sampling)
    assert out["output_ids"] == ar_reference(pair, sampling)
    assert out["new_tokens"] == 24 and out["total_s"] >= out["ttft_s"] > 0 and out["tpot_s"] > 0
    assert isinstance(pair.static_steps["target"], StaticSteps)
    assert (pair.static_steps["target"].graphs is not None) == (DEVICE == "cuda")


def test_graphed_ar_stops_at_eos_and_keeps_it(pair):
    ids = pair.tokenizer(PROMPT)["input_ids"]
    free = CapturedAR(pair).generate(ids, 12)["output_ids"]
    stopped = CapturedAR(pair).generate(ids, 12, eos_ids=(free[4],))["output_ids"]
    assert stopped == free[: free.index(free[4]) + 1]


def test_bench_runs_ar_graph_as_a_method(pair):
    out = run_method(pair, AR_CAPTURED, PROMPT, 8)
    assert out["new_tokens"] == 8 and out["output_ids"] == ar_reference(pair, Sampling(), 8)


def test_steps_are_kept_on_the_pair_and_reused_while_they_fit(pair):
    """Graphed on CUDA (the captures are what reuse saves), eager static on a CPU."""
    kept: dict = {}
    model, graphs = pair.target, DEVICE == "cuda"
    first = reuse_static(kept, "target", model, 40, (1, 4), graphs)
    assert kept["target"] is first and first.max_len == (GRAPH_CAPACITY_STEP if graphs else 40)
    first.prefill([1, 2, 3])
    again = reuse_static(kept, "target", model, 30, (1, 4), graphs)
    assert again is first and again.length == 0  # reset for the new run, not rebuilt
    assert reuse_static(kept, "target", model, first.max_len + 1, (1, 4), graphs) is not first  # too short
    assert reuse_static(kept, "target", model, 41, (1, 8), graphs).buckets == (1, 8)  # another ladder: new steps
    assert graph_capacity(1) == graph_capacity(GRAPH_CAPACITY_STEP) == GRAPH_CAPACITY_STEP
    assert graph_capacity(GRAPH_CAPACITY_STEP + 1) == 2 * GRAPH_CAPACITY_STEP


def test_eager_static_steps_are_not_reused_when_far_too_long(pair):
    """Without graphs every forward attends over the whole cache: a run much shorter than the kept cache gets its
    own."""
    kept: dict = {}
    long = reuse_static(kept, "target", pair.target, 2000, (1, 4))
    assert reuse_static(kept, "target", pair.target, 1900, (1, 4)) is long
    assert reuse_static(kept, "target", pair.target, 100, (1, 4)).max_len == 100


def test_cost_table_measured_through_the_static_steps(pair):
    table = measure_graphed(pair.target, ["plain"], ladder=(1, 4, 16), prefix=20, repeats=1)
    assert set(table) == {"plain"} and set(table["plain"]) == {1, 4, 16}
    assert all(s > 0 for s in table["plain"].values())


def test_graphed_tables_are_cached_apart_from_eager_ones(pair, tmp_path, monkeypatch):
    monkeypatch.setenv("TREEVIZ_CACHE", str(tmp_path))
    calls = []

    def fake(model, paths, prefix=300):
        calls.append(prefix)
        return {"plain": {r: 1e-3 * r for r in LADDER}}

    eager = model_costs(pair.target, "t", torch.float32, pair.target.device, measure_fn=fake)
    graphed = model_costs(pair.target, "t", torch.float32, pair.target.device, measure_fn=fake, graphs=True)
    assert eager.measured and graphed.measured  # a graphed table is not read from the eager one's file
    assert len(list((tmp_path / "costs").iterdir())) == 2
    assert not model_costs(pair.target, "t", torch.float32, pair.target.device, measure_fn=fake, graphs=True).measured


# ---- the real-shape stand-ins -----------------------------------------------------------------------------------

PUBLISHED_PARAMETERS = {  # model cards / safetensors metadata of the published checkpoints
    "qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304, "qwen2.5-7b": 7_615_616_512,
    "pythia-70m": 70_426_624, "pythia-2.8b": 2_775_208_960, "smollm2-135m": 134_515_008,
    "smollm2-1.7b": 1_711_376_384, "qwen3-0.6b": 596_049_920, "qwen3-8b": 8_190_735_360,
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_shapes_have_the_published_sizes(name):
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):  # shapes only: no memory, no time
        model = AutoModelForCausalLM.from_config(shape_config(name))
    count = sum(p.numel() for p in model.parameters())
    assert count == pytest.approx(PUBLISHED_PARAMETERS[name], rel=0.005)


def test_a_shape_pair_loads_and_decodes_printable_bytes():
    pair = load_pair("shape:pythia-70m", "shape:pythia-70m", dtype="fp32", device="cpu", calibrate=False,
                     packed="off")
    assert "random weights" in pair.target_name and pair.target.config.vocab_size == 50304
    assert not torch.equal(pair.target.get_output_embeddings().weight[:8], pair.draft.get_output_embeddings().weight[:8])
    spec = RunSpec(pair="shape", prompt="hello", strategy="fixed", preset="cpu", max_new_tokens=6,
                   params={"tau": 0.0, "budget": 16, "depth": 4, "branch": 2})
    result = generate(pair, spec)
    assert all(t < 256 for t in result.output_ids)  # byte tokens only: the head rows past them are zero
    assert all(it.drafted == 16 for it in result.iterations)  # tau 0: the fixed shape whatever the draft's q


def test_an_unknown_shape_is_refused_with_the_known_ones():
    from engine.models import ModelLoadError
    with pytest.raises(ModelLoadError, match="qwen2.5-1.5b"):
        load_pair("shape:gpt-5", None, device="cpu", calibrate=False)


# ---- CUDA graphs ----------------------------------------------------------------------------------------------------

def strategy_names():
    from engine.strategies import STRATEGIES
    return list(STRATEGIES)


@cuda_only
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("name", strategy_names())
def test_every_strategy_on_graphs_emits_what_dynamic_emits(pair, name, temperature):
    """fp32 on the GPU: graphed static steps and the dynamic path, the same tokens and acceptance per iteration."""
    sampling = Sampling(temperature=temperature, seed=7)
    spec = RunSpec(pair="tiny", prompt=PROMPT, strategy=name, max_new_tokens=32, stop_on_eos=False,
                   **sampling.as_dict())
    graphed = generate(pair, spec)
    dynamic = generate(pair, RunSpec(**{**spec.__dict__, "capture": "off", "steps": "dynamic"}))
    assert pair.static_steps["target"].graphs is not None
    assert graphed.output_ids == dynamic.output_ids
    assert [it.accepted for it in graphed.iterations] == [it.accepted for it in dynamic.iterations]


@cuda_only
def test_bench_divides_by_ar_captured_on_a_graphed_pair(pair):
    report = bench(pair, ["ar", "fixed"], prompt_set="code", max_new_tokens=8, limit=1, log=lambda s: None)
    methods = [r["method"] for r in report["rows"]]
    assert methods[:3] == ["ar", "ar-eager", AR_CAPTURED] and all(r["exact_match_rate"] == 1.0 for r in report["rows"])
