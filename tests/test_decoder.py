"""Exactness of tree speculative decoding (fp32): output == target-only greedy output, token for token."""
import ast
import dataclasses
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.core import kv
from engine.core.prompts import PromptError
from engine.core.trace import ACCEPTED, BONUS, REJECTED, ROOT, UNREACHED, StageTimes, load_run
import engine.decoder
from engine.decoder import Decoder
from engine.strategies.base import RunHooks
from engine.models import tiny_random_pair
from engine.strategies import STRATEGIES, StrategyError, make_strategy

PROMPTS = ["hello world", "def f(x):\n    return", "Z", "The quick brown fox jumps over"]
SPECULATIVE = [name for name in STRATEGIES if name != "ar"]
DRAFTED = [name for name in SPECULATIVE if STRATEGIES[name].uses_draft]  # lookup has no draft chain to match


def greedy(pair, prompt, n, **kw):
    return Decoder(pair, make_strategy("ar")).generate(prompt, max_new_tokens=n, stop_on_eos=False, **kw)


@lru_cache(maxsize=None)
def pair_for(kind, seed):
    return tiny_random_pair(kind, seed=seed, dtype=torch.float32)


@lru_cache(maxsize=None)
def reference_ids(seed, prompt, n):
    """Target-only greedy output; the target of a tiny pair depends on the seed only, not on the draft kind."""
    return list(greedy(pair_for("related", seed), prompt, n).output_ids)


def hf_greedy(pair, prompt, n):
    ids = torch.tensor([pair.tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    out = pair.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, temperature=None, top_p=None, top_k=None,
                               pad_token_id=pair.eos_token_ids[0])
    return out[0, ids.shape[1]:].tolist()


def test_ar_matches_transformers_generate(related_pair):
    for prompt in PROMPTS[:2]:
        assert greedy(related_pair, prompt, 80).output_ids == hf_greedy(related_pair, prompt, 80)


@pytest.mark.parametrize("name", SPECULATIVE)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_on_related_pair(name, seed):
    pair = pair_for("related", seed)
    for prompt in PROMPTS[seed:seed + 2]:
        reference = reference_ids(seed, prompt, 100)
        result = Decoder(pair, make_strategy(name)).generate(prompt, max_new_tokens=100, stop_on_eos=False)
        assert result.output_ids == reference, f"{name} diverged at seed {seed} on {prompt!r}"
        assert len(result.iterations) > 10  # crossed many iterations
        assert sum(it.committed for it in result.iterations) + 1 == 100


@pytest.mark.parametrize("name", SPECULATIVE)
def test_exact_with_unrelated_draft(name, unrelated_pair):
    reference = reference_ids(0, PROMPTS[0], 60)
    result = Decoder(unrelated_pair, make_strategy(name)).generate(PROMPTS[0], max_new_tokens=60, stop_on_eos=False)
    assert result.output_ids == reference


@pytest.mark.parametrize("name", DRAFTED)
def test_identical_draft_accepts_whole_greedy_path(name, identical_pair):
    result = Decoder(identical_pair, make_strategy(name)).generate(PROMPTS[1], max_new_tokens=80,
                                                                   stop_on_eos=False)
    assert result.output_ids == reference_ids(0, PROMPTS[1], 80)
    for it in result.iterations[:-1]:  # the last one may be cut by max_new_tokens
        nodes = {n.id: n for n in it.nodes}
        # The draft's top-1 chain is the target's greedy chain: the walk only stops at a leaf of that chain.
        chain, node = [0], 0
        while True:
            top = [n for n in it.nodes if n.parent == node and n.status != BONUS and n.rank == 0]
            if not top:
                break
            node = top[0].id
            chain.append(node)
        assert it.accepted_path == chain
        assert all(nodes[i].status in (ROOT, ACCEPTED) for i in chain)


@pytest.mark.parametrize("name,params", [
    ("dynatree", {"budget": 1}), ("fixed", {"budget": 1}), ("fixed", {"depth": 1}),
    ("dynatree", {"d0": 1, "d_max": 2}), ("linear", {"k": 1}), ("dynatree", {"dynamic_breadth": False,
                                                                              "dynamic_depth": False,
                                                                              "pruning": False, "history": False}),
])
def test_exact_edge_parameters(name, params, related_pair):
    for prompt in PROMPTS[:2]:
        reference = reference_ids(0, prompt, 60)
        result = Decoder(related_pair, make_strategy(name, **params)).generate(prompt, max_new_tokens=60,
                                                                              stop_on_eos=False)
        assert result.output_ids == reference
        assert all(it.drafted <= params.get("budget", 10**9) for it in result.iterations)


def test_linear_confidence_stop_shortens_chains_and_stays_exact(related_pair):
    for prompt in PROMPTS[:2]:
        result = Decoder(related_pair, make_strategy("linear", k=8, stop_below=0.9)).generate(
            prompt, max_new_tokens=60, stop_on_eos=False)
        assert result.output_ids == reference_ids(0, prompt, 60)
        lengths = []
        for it in result.iterations:
            drafted = [n for n in it.nodes if n.status not in (ROOT, BONUS)]
            # every chain token but the last is confident; the chain ends at K or at the first unsure token
            assert all(n.q >= 0.9 for n in drafted[:-1])
            assert len(drafted) == 8 or drafted[-1].q < 0.9
            lengths.append(len(drafted))
        assert min(lengths) < 8


@pytest.mark.parametrize("name", SPECULATIVE)
def test_one_token_prompt_and_max_tokens_mid_path(name, identical_pair):
    reference = reference_ids(0, "Q", 40)
    for n in (1, 2, 7, 13):  # with an identical draft, paths are long: the limit falls inside one
        result = Decoder(identical_pair, make_strategy(name)).generate("Q", max_new_tokens=n, stop_on_eos=False)
        assert result.output_ids == reference[:n]
        assert result.stop_reason == "max_new_tokens"


@pytest.mark.parametrize("name", ["ar"] + SPECULATIVE)
def test_eos_inside_a_tree_stops_exactly(name):
    pair = tiny_random_pair("identical", seed=3, dtype=torch.float32)
    reference = greedy(pair, PROMPTS[3], 60).output_ids
    eos = reference[17]  # pretend a token in the middle of an accepted path is EOS
    cut = reference.index(eos) + 1
    result = Decoder(pair, make_strategy(name)).generate(PROMPTS[3], max_new_tokens=60, eos_token_ids=[eos])
    assert result.output_ids == reference[:cut]
    assert result.stop_reason == "eos"


def test_stop_string(related_pair):
    reference = greedy(related_pair, PROMPTS[0], 60)
    text = related_pair.tokenizer.decode(reference.output_ids[20:23])
    result = Decoder(related_pair, make_strategy("dynatree")).generate(
        PROMPTS[0], max_new_tokens=60, stop_on_eos=False, stop_strings=(text,))
    assert result.stop_reason == "stop_string"
    assert text in result.output_text
    assert result.output_ids == reference.output_ids[: len(result.output_ids)]
    assert len(result.output_ids) <= 23


def assert_same_cache(mine, ref):
    """Equal up to fp32 kernel noise: 1e-5 relative to the tensor's scale. (A prefill and a token-by-token decode of
    the same sequence already differ by ~3e-6 of scale on these deliberately peaky random models.)"""
    assert len(mine.layers) == len(ref.layers)
    for a, b in zip(mine.layers, ref.layers):
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            assert x.shape == y.shape
            assert (x - y).abs().max() <= 1e-5 * y.abs().max()


def _fresh_prefill(model, ids):
    cache = kv.new_cache(model)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    return cache


@pytest.mark.parametrize("name", SPECULATIVE)
def test_caches_equal_fresh_prefill(name, related_pair):
    run = Decoder(related_pair, make_strategy(name)).run(PROMPTS[1], max_new_tokens=200, stop_on_eos=False)
    for count, record in enumerate(run):
        if count == 25:
            break
    prompt_ids = related_pair.tokenizer(PROMPTS[1], add_special_tokens=False)["input_ids"]
    committed = prompt_ids + run.generated
    # The root (last committed token) is in neither cache yet.
    target_ref = _fresh_prefill(related_pair.target, committed[:-1])
    assert kv.cache_length(run.target.cache) == len(committed) - 1
    assert_same_cache(run.target.cache, target_ref)
    drafter = run.drafter
    if drafter is None:
        return  # a strategy that drafts without the draft model (lookup) has no draft cache
    assert 0 < drafter.cached <= len(committed) - 1
    draft_ref = _fresh_prefill(related_pair.draft, committed[: drafter.cached])
    assert kv.cache_length(drafter.cache) == drafter.cached
    assert_same_cache(drafter.cache, draft_ref)


def test_records_are_consistent(related_pair, tmp_path):
    result = Decoder(related_pair, make_strategy("dynatree")).generate(PROMPTS[0], max_new_tokens=50,
                                                                      stop_on_eos=False)
    for it in result.iterations:
        statuses = [n.status for n in it.nodes]
        assert statuses[0] == ROOT and statuses.count(BONUS) == 1
        assert statuses.count(ACCEPTED) == len(it.accepted_path) - 1
        # Only the last iteration may commit fewer tokens than verification accepted (max_new_tokens cut).
        assert it.accepted == len(it.accepted_path) - 1 or it is result.iterations[-1]
        assert it.drafted == len(it.nodes) - 2
        for n in it.nodes[1:]:
            assert n.p is not None and 0.0 <= n.p <= 1.0
            if n.status == REJECTED:
                assert it.nodes[n.parent].status in (ROOT, ACCEPTED)
            if n.status == UNREACHED:
                assert it.nodes[n.parent].status in (REJECTED, UNREACHED)
        assert isinstance(it.times, StageTimes)
        times = dataclasses.asdict(it.times)
        assert list(times) == ["draft", "build", "verify", "commit", "record", "total"]
        stages = it.times.draft + it.times.build + it.times.verify + it.times.commit + it.times.record
        assert it.times.total == pytest.approx(stages) and min(times.values()) >= 0.0
    assert len(result.token_sources) == len(result.output_ids)
    m = result.metrics
    assert m.mean_tokens_per_iter == pytest.approx((len(result.output_ids) - 1) / m.iterations)
    path = tmp_path / "trace.json"
    result.save(path)
    replay = load_run(path)
    assert replay.output_ids == result.output_ids
    assert [n.status for n in replay.iterations[3].nodes] == [n.status for n in result.iterations[3].nodes]


def test_bad_input_is_refused_clearly(related_pair):
    with pytest.raises(PromptError, match="empty"):
        Decoder(related_pair, make_strategy("dynatree")).generate("   ", max_new_tokens=5)
    with pytest.raises(PromptError, match="empty"):
        Decoder(related_pair, make_strategy("dynatree")).generate([{"role": "user", "content": ""}])
    with pytest.raises(StrategyError, match="unknown strategy"):
        make_strategy("nope")
    with pytest.raises(StrategyError, match="above its maximum"):
        make_strategy("dynatree", budget=10**9)
    with pytest.raises(StrategyError, match="must be a int"):
        make_strategy("linear", k="many")
    with pytest.raises(StrategyError, match="D0"):
        make_strategy("dynatree", d0=8, d_max=8)
    with pytest.raises(StrategyError, match="no parameter"):
        make_strategy("linear", budget=3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        Decoder(related_pair, make_strategy("ar")).run("hi", max_new_tokens=0)


# -- the run and its hooks -----------------------------------------------------------------------------------------
def test_two_runs_of_one_decoder_decode_alike_each_with_its_own_strategy(related_pair):
    """The decoder is a recipe: each run decodes with a fresh copy of its strategy, so what one run's strategy
    learns (DynaTree's history adaptation moves its thresholds) neither reaches the recipe nor the next run."""
    decoder = Decoder(related_pair, make_strategy("dynatree"))
    before = decoder.strategy.current_params()
    runs = [decoder.run(PROMPTS[0], max_new_tokens=40, stop_on_eos=False) for _ in range(2)]
    for run in runs:
        for _ in run:
            pass
    first, second = (run.result for run in runs)
    assert runs[0].strategy is not runs[1].strategy and decoder.strategy not in (runs[0].strategy, runs[1].strategy)
    assert first.output_ids == second.output_ids
    assert [it.params for it in first.iterations] == [it.params for it in second.iterations]
    assert [len(it.nodes) for it in first.iterations] == [len(it.nodes) for it in second.iterations]
    assert runs[0].strategy.current_params() != before  # the run's strategy adapted ...
    assert decoder.strategy.current_params() == before  # ... the recipe's did not


class Log(RunHooks):
    """A plug-in that records every hook call, and rests (asks for an AR step) at the iterations in `rest_at`."""

    def __init__(self, rest_at=()):
        self.calls, self.rest_at, self.done = [], set(rest_at), 0

    def begin(self, run):
        self.calls.append(("begin",))
        self.run = run

    def before_build(self, committed, width):
        self.calls.append(("before_build", len(committed), width))

    def rests(self):
        return self.done in self.rest_at

    def after_target(self, logits, row):
        self.calls.append(("after_target", row))

    def observe(self, accepted, drafted):
        self.calls.append(("observe", accepted, drafted))

    def recorded(self, record):
        self.calls.append(("recorded", record.index))
        self.done += 1


def test_a_plug_in_hears_every_hook_in_order_and_its_rest_is_an_ar_step(related_pair):
    log = Log(rest_at={1, 2})
    decoder = Decoder(related_pair, make_strategy("dynatree"), plugins=(lambda run: log, lambda run: None))
    run = decoder.run(PROMPTS[3], max_new_tokens=30, stop_on_eos=False)
    records = list(run)
    assert run.result.output_ids == reference_ids(0, PROMPTS[3], 30)
    assert log.run.strategy is run.strategy and log.run.drafter is run.drafter and log.run.target is run.target
    assert run.hooks == [run.strategy, log]  # a factory's None adds no hooks
    prompt_len = len(run.prompt_ids)
    expected = [("begin",), ("after_target", -1)]
    generated = 1
    for it in records:
        expected += [("before_build", prompt_len + generated, run.width), ("after_target", it.accepted_path[-1])]
        if it.index not in log.rest_at:
            expected.append(("observe", len(it.accepted_path) - 1, it.drafted))
        expected.append(("recorded", it.index))
        generated += len(it.new_tokens)
    assert log.calls == expected
    for it in records[1:3]:  # the rested iterations: the root alone, no draft forward, one token
        assert [n.status for n in it.nodes] == [ROOT, BONUS] and it.draft_forwards == 0 and it.times.draft == 0.0
    assert records[3].draft_forwards > 0


def test_the_decoder_reaches_its_plug_ins_only_through_hooks():
    """engine/decoder.py imports neither the neural selector nor the auto sizer: they plug in through RunHooks."""
    tree = ast.parse(Path(engine.decoder.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            imported |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    assert "engine.strategies.base.RunHooks" in imported  # the parse sees the imports
    assert not imported & {"engine.strategies.selector", "engine.measure.autosize"}


def test_the_stage_clock_times_back_to_back_stages_and_carves_out_the_draft(monkeypatch):
    from engine.measure import clock as clock_module
    ticks = iter([10.0, 11.0, 13.5, 14.0, 14.25])
    monkeypatch.setattr(clock_module, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    clock = clock_module.StageClock(torch.device("cpu"))
    for stage in ("build", "verify", "commit", "record"):
        with clock(stage):
            pass
    assert clock.times(draft=0.25, within="build") == StageTimes(draft=0.25, build=0.75, verify=2.5, commit=0.5,
                                                                 record=0.25, total=4.25)
