"""Captured CPU steps (engine/cpu/aoti.py, engine/cpu/packages.py) compute what the eager path computes.

Everything here runs the production path on tiny fp32 pairs: torch.export with one-element stand-ins for the weights,
AOTInductor's compile, the package on disk, its runner bound to the model's own weights inside StaticSteps, the
decoder. The draft is quantised to int4 and routed to it at 1-8 rows, plain above, so it gets a one-row package and
two packages with a dynamic row count (2-8 on int4, 9-32 plain); the target gets its one-row package and one with a
dynamic row count (2-64). Packages are compiled once per machine (the first run of this module spends a minute or
two compiling), which is itself tested.
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import pytest
import torch

from engine.bench.captured_ar import CapturedAR
from engine.bench.tables import AR_CAPTURED, AR_EAGER, bench
from engine.core.sampling import Sampling
from engine.core.steps import DynamicSteps, StaticSteps, causal_visibility
from engine.cpu import aoti
from engine.cpu.kernels import quantize_linears, route_linears, router_of, standin_tensors
from engine.cpu.packages import (PAD_GAIN, CapturedModel, Package, install, plan, prepare_capture, prepare_model,
                                 recipe_key)
from engine.measure.costs import CAPTURED, ModelCosts, describe_pads
from engine.models import tiny_random_model, tiny_random_pair
from engine.models.devices import CaptureUnavailable, capture_backend
from engine.models.loading import calibrate_pair, load_pair
from engine.recipe import RunSpec, generate
from engine.strategies import STRATEGIES

PROMPT = "captured steps, eager steps:"
TOL = dict(rtol=1e-4, atol=1e-3)  # fp32; inductor's GEMMs sum in their own order


def int4_draft(pair) -> None:
    """The draft quantised to int4 and routed there at 1-8 rows (as the default pair's draft is on a 2-core CPU)."""
    quantize_linears(pair.draft, "int4")
    router_of(pair.draft).install(["int4"] * 8 + ["plain"] * 56)


@pytest.fixture(scope="module")
def pair():
    """A captured tiny pair, its draft's projections fused as a CPU load fuses them, every package serving every row
    count it can (whether it measured faster is the machine's business; these tests are about what it computes)."""
    pair = tiny_random_pair("related", dtype=torch.float32, capture="on", fused=True)
    pair.costs = calibrate_pair(pair)
    int4_draft(pair)  # after calibration, which installs its table's routing and frees the formats it never uses
    prepare_capture(pair, measure=False)
    for captured in pair.captured.values():  # count every call, so a test knows the packages ran
        for package in captured.packages:
            package.runner = counted(package.runner)
        captured.serve_all()
    return pair


class counted:
    def __init__(self, runner):
        self.runner, self.calls = runner, 0

    def __call__(self, *args):
        self.calls += 1
        return self.runner(*args)


def calls(pair, role: str) -> int:
    return sum(p.runner.calls for p in pair.captured[role].packages)


def spec(name: str, sampling: Sampling, **kw) -> RunSpec:
    return RunSpec(pair="tiny", prompt=PROMPT, strategy=name, max_new_tokens=32, stop_on_eos=False,
                   **sampling.as_dict(), **kw)


def test_the_plan_follows_the_routing(pair):
    assert [r.describe() for r in plan(pair.draft, "draft")] == ["1 row int4", "2-8 rows int4", "9-32 rows plain"]
    assert [r.describe() for r in plan(pair.target, "target")] == ["1 row plain", "2-64 rows plain"]
    draft, target = pair.captured["draft"], pair.captured["target"]
    assert draft.route(3)[0] == 3 and draft.route(9)[0] == 9 and draft.route(33) == (33, None)  # exact; then eager
    assert target.route(1)[0] == 1 and target.route(5)[0] == 5 and target.route(64)[0] == 64  # exact rows
    assert pair.capture_ready and "target rows 1-64" in pair.describe_capture()


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_on_captured_steps_emits_what_eager_emits(pair, name, temperature):
    """The same tokens, and the same acceptance iteration by iteration (so the draft proposed the same trees)."""
    sampling = Sampling(temperature=temperature, seed=7)
    before = {role: calls(pair, role) for role in ("target", "draft")}
    captured = generate(pair, spec(name, sampling))
    assert calls(pair, "target") > before["target"] + len(captured.iterations) - 1  # every verification
    assert (calls(pair, "draft") > before["draft"]) == STRATEGIES[name].uses_draft
    before = {role: calls(pair, role) for role in ("target", "draft")}
    eager = generate(pair, spec(name, sampling, capture="off"))
    assert before == {role: calls(pair, role) for role in ("target", "draft")}
    assert isinstance(pair.static_steps["target"], StaticSteps)
    assert pair.static_steps["target"].captured is pair.captured["target"]
    assert captured.output_ids == eager.output_ids
    assert [it.accepted for it in captured.iterations] == [it.accepted for it in eager.iterations]


def test_every_cache_reads_its_own(pair):
    """One package serves caches of any length: two steps objects alternate forwards, each matching its own eager
    reference (a package bound to the cache it was compiled with would read the other's rows)."""
    model = pair.target
    streams = [[7 + i for i in range(20)], [90 + 3 * i for i in range(9)]]
    statics = [StaticSteps(model, 64, (1,), captured=pair.captured["target"]),
               StaticSteps(model, 200, (1,), captured=pair.captured["target"])]
    dynamics = [DynamicSteps(model), DynamicSteps(model)]
    with torch.inference_mode():
        for static, dynamic, ids in zip(statics, dynamics, streams):
            torch.testing.assert_close(static.prefill(ids), dynamic.prefill(ids), **TOL)
        for step in range(6):
            for static, dynamic, ids in zip(statics, dynamics, streams):
                tokens = [(ids[-1] + step + k) % 250 for k in range(1 + step % 4)]
                positions = list(range(static.length, static.length + len(tokens)))
                visible = causal_visibility(static.length, len(tokens))
                torch.testing.assert_close(static.forward(tokens, positions, visible),
                                           dynamic.forward(tokens, positions, visible), **TOL)


def test_the_hidden_rows_are_the_real_ones(pair):
    """The neural selector reads the final norm's rows from the steps (a captured forward runs no hooks): on a
    padded bucket, the last real row, never a padding row."""
    draft = pair.draft
    static = StaticSteps(draft, 64, (1,), captured=pair.captured["draft"])
    dynamic = DynamicSteps(draft)
    with torch.inference_mode():
        static.prefill(list(range(30, 50)))
        dynamic.prefill(list(range(30, 50)))
        static.forward([5, 6, 7], [20, 21, 22])  # three rows: the 4-row package, one padding row
        dynamic.forward([5, 6, 7], [20, 21, 22])
    assert static.last_hidden.shape == dynamic.last_hidden.shape == (3, draft.config.hidden_size)
    torch.testing.assert_close(static.last_hidden, dynamic.last_hidden, **TOL)


def test_captured_ar_is_the_engines_ar(pair):
    ids = pair.tokenizer(PROMPT)["input_ids"]
    for temperature in (0.0, 0.9):
        sampling = Sampling(temperature=temperature, seed=3)
        out = CapturedAR(pair).generate(ids, 24, sampling)
        assert out["output_ids"] == generate(pair, spec("ar", sampling, capture="off")).output_ids[:24]


def test_the_bench_runs_every_ar_and_divides_by_the_fastest(pair):
    report = bench(pair, ["ar", "dynatree", "dynatree/eager"], prompt_set="code", max_new_tokens=8, limit=1,
                   log=lambda s: None)
    methods = [r["method"] for r in report["rows"]]
    assert methods == ["ar", AR_EAGER, AR_CAPTURED, "dynatree", "dynatree/eager"]
    assert all(r["exact_match_rate"] == 1.0 for r in report["rows"])
    fastest = max((r for r in report["rows"] if r["method"].startswith("ar")), key=lambda r: r["tokens_per_s"])
    assert fastest["speedup"] == pytest.approx(1.0) and report["rows"][0]["baseline"] == fastest["method"]


def test_a_package_is_compiled_once_and_loaded_after(pair, monkeypatch):
    def refuse(*args):
        raise AssertionError("compiled again")
    monkeypatch.setattr("engine.cpu.packages.build", refuse)
    again = prepare_model(pair.target, pair.target_name, "target")
    assert [p.compile_s for p in again.packages] == [None, None] and not any("failed" in n for n in again.notes)


def test_loading_a_package_leaves_nothing_unpacked(pair, monkeypatch):
    """torch's loader unpacks a package under $TMPDIR and removes it only when the runner is collected (never, in a
    process that ends with it alive: 6 GB per app start for the default pair). Loading must leave nothing behind,
    keep TMPDIR as it was, and give a runner that still runs."""
    real = torch._inductor.aoti_load_package
    unpacked = []

    def loader(path):  # the C++ loader's behaviour, made visible: a folder under $TMPDIR that outlives the call
        folder = Path(os.environ.get("TMPDIR", tempfile.gettempdir())) / f"aotinductor_{len(unpacked)}"
        folder.mkdir()
        (folder / "model.so").write_bytes(b"unpacked")
        unpacked.append(folder)
        return real(path)

    monkeypatch.setattr(torch._inductor, "aoti_load_package", loader)
    before = os.environ.get("TMPDIR")
    again = prepare_model(pair.target, pair.target_name, "target")
    assert len(unpacked) == len(again.packages) and not any(folder.exists() for folder in unpacked)
    assert os.environ.get("TMPDIR") == before
    greedy = spec("dynatree", Sampling())
    expected = generate(pair, greedy).output_ids
    again.serve_all()
    monkeypatch.setitem(pair.captured, "target", again)  # the runners loaded above, their unpacked folders gone
    assert generate(pair, greedy).output_ids == expected


def test_a_package_load_waits_for_the_instruction_set_check_started_ahead(pair, monkeypatch):
    """load_pair starts inductor's check of the CPU's vector sets beside the load; a package load waits for that
    check instead of running its own beside it."""
    from torch._inductor import cpu_vec_isa
    real_check, real_loader, order = cpu_vec_isa.valid_vec_isa_list, torch._inductor.aoti_load_package, []

    def slow_check():
        time.sleep(0.5)
        order.append("check")
        return real_check()

    monkeypatch.setattr(aoti, "_ISA_CHECK", None)
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", slow_check)
    monkeypatch.setattr(torch._inductor, "aoti_load_package", lambda path: order.append("load") or real_loader(path))
    aoti.check_isa_ahead()
    again = prepare_model(pair.target, pair.target_name, "target")
    assert again.packages and order[0] == "check" and "load" in order
    monkeypatch.setattr(aoti, "_ISA_CHECK", None)
    tiny = load_pair("tiny-random", "tiny-random", device="cpu", calibrate=False, capture="auto")
    assert tiny.capture == "aoti" and aoti._ISA_CHECK is not None  # the production load starts it


def test_packages_are_keyed_by_the_weights():
    """The weights are frozen into a package: another checkpoint of the same shape and name gets its own."""
    a, b = tiny_random_model(0), tiny_random_model(1)
    recipe = aoti.Recipe(1)
    assert recipe_key(a, "tiny", recipe) == recipe_key(tiny_random_model(0), "tiny", recipe)
    assert recipe_key(a, "tiny", recipe)["weights"] != recipe_key(b, "tiny", recipe)["weights"]
    assert aoti.package_file(recipe_key(a, "tiny", recipe)) != aoti.package_file(recipe_key(b, "tiny", recipe))


def test_a_package_reads_the_models_own_weights_and_holds_no_copy(pair):
    """Built from one-element stand-ins, a package multiplies by whatever the model holds when it is called: scale
    a weight in place and the captured forward moves exactly as the eager one does (a frozen copy would not)."""
    model, captured = pair.target, pair.captured["target"]
    layer = model.model.layers[0].mlp.up_proj
    ids = [5, 17, 33, 2, 9]
    def logits(route):
        steps = StaticSteps(model, 32, (1,), captured=route)
        with torch.inference_mode():
            steps.prefill(ids[:3])
            return steps.forward(ids[3:], [3, 4])
    before = logits(captured)
    with torch.no_grad():
        layer.weight.mul_(1.5)
    try:
        after, eager = logits(captured), logits(None)
    finally:
        with torch.no_grad():
            layer.weight.div_(1.5)
    assert not torch.allclose(after, before, **TOL)
    torch.testing.assert_close(after, eager, **TOL)
    assert all(p.bytes < 4 * sum(t.numel() * t.element_size() for t in model.parameters()) + (4 << 20)
               for p in captured.packages)


def test_rows_are_served_only_where_captured_measured_faster():
    """The table decides: a package slower than the eager path at a row count does not serve it, and the table
    prices each row count the way it will run (captured and padded, or eager)."""
    packages = [Package(aoti.Recipe(r, "int4"), object(), f"f{r}", None, 0.0, 0) for r in (1, 2, 4)]
    captured = CapturedModel(packages)
    table = ModelCosts("draft", {"int4": {1: 10.0, 2: 12.0, 4: 14.0, 8: 30.0}})
    install(table, captured, {300: {1: 5.0, 2: 6.0, 4: 20.0}})
    assert sorted(captured.serves) == [1, 2] and table.serves == {1: 1, 2: 2}
    assert table.time(1) == 5.0 and table.time(3) == pytest.approx(13.0)  # 3 rows: eager (13.0) beats 4-row 20.0
    assert table.time(2, path=CAPTURED) == 6.0 and table.eager_time(2) == 12.0


def test_a_row_count_runs_padded_where_a_larger_rung_measured_cheaper():
    """oneDNN's bf16 GEMM on a CPU without AMX is faster at four rows than at one: there a row count runs padded to
    the larger rung, through the package that runs it, and the table prices it so; a gain inside PAD_GAIN is noise
    and pads nothing."""
    one = Package(aoti.Recipe(1, "packed"), object(), "f1", None, 0.0, 0)
    many = Package(aoti.Recipe(2, "packed", hi=8), object(), "f2-8", None, 0.0, 0)
    captured = CapturedModel([one, many])
    table = ModelCosts("target", {"packed": {1: 10.0, 2: 10.0, 4: 10.0, 8: 10.0}})
    install(table, captured, {300: {1: 5.0, 2: 5.0, 4: 3.0, 8: 6.0}})
    assert captured.pads == {1: 4, 2: 4, 3: 4} and captured.route(1) == (4, many.runner)
    assert captured.route(5) == (5, many.runner) and captured.route(8) == (8, many.runner)  # 8 rows: 6.0, unpadded
    assert table.serves[1] == 4 and table.time(1) == 3.0 and table.time(3) == 3.0
    assert describe_pads(captured.pads) == "1-3 as 4" and captured.info()["pads"] == "1-3 as 4"
    install(table, captured, {300: {1: 5.0, 2: 5.0, 4: 4.9, 8: 6.0}})  # 2 % cheaper: within PAD_GAIN
    assert captured.pads == {} and captured.route(1) == (1, one.runner) and table.time(1) == 5.0
    assert 4.9 > PAD_GAIN * 5.0


def test_padded_steps_emit_what_eager_emits(pair):
    """Rows 1-3 of both models run as four through their dynamic packages (the padded rows repeat the last token
    and see only themselves): every output equals the eager path's, and the packages ran four rows."""
    saved = {role: (c.serves, c.pads) for role, c in pair.captured.items()}
    shapes = []
    try:
        for captured in pair.captured.values():
            wide = captured.package_for(4)
            captured.serves = {**captured.serves, **{n: wide for n in (1, 2, 3)}}
            captured.pads = {1: 4, 2: 4, 3: 4}
            wide.runner = recording(wide.runner, shapes)
        pair.static_steps.clear()
        for name, temperature in (("ar", 0.0), ("dynatree", 0.0), ("dynatree", 0.8)):
            sampling = Sampling(temperature=temperature, seed=7)
            padded = generate(pair, spec(name, sampling))
            eager = generate(pair, spec(name, sampling, capture="off"))
            assert padded.output_ids == eager.output_ids
            assert [it.accepted for it in padded.iterations] == [it.accepted for it in eager.iterations]
        assert 4 in shapes and not {1, 2, 3} & set(shapes)  # every forward of 1-3 rows ran as four
    finally:
        for role, captured in pair.captured.items():
            captured.serves, captured.pads = saved[role]
            wide = captured.package_for(4)
            wide.runner = wide.runner.runner
        pair.static_steps.clear()


class recording:
    """A runner that notes the row count of every call (its embeddings' second dimension)."""

    def __init__(self, runner, shapes: list[int]):
        self.runner, self.shapes = runner, shapes

    def __call__(self, embeds, *args):
        self.shapes.append(embeds.shape[1])
        return self.runner(embeds, *args)


def test_the_switch():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert capture_backend("off", cpu) is None and capture_backend("auto", cpu) == "aoti"
    assert capture_backend("on", cuda) == "cuda-graphs" and capture_backend("auto", cuda) == "cuda-graphs"
    with pytest.raises(ValueError):
        capture_backend("yes", cpu)
    with pytest.raises(CaptureUnavailable):
        capture_backend("on", torch.device("meta"))


def test_an_eager_decoder_prices_the_eager_path(pair):
    from engine.decoder import Decoder
    from engine.strategies import make_strategy
    eager = Decoder(pair, make_strategy("dynatree"), capture="off")
    captured = Decoder(pair, make_strategy("dynatree"))
    assert not eager.static and eager.costs.draft.serves == {} and eager.costs.target.serves == {}
    assert captured.static and captured.costs is pair.costs


def test_real_shapes_and_a_padded_vocabulary_decode_the_same_captured():
    """The shapes real pairs have, through export and compile: 7 query heads per key/value head, head_dim 128, and a
    draft whose vocabulary is narrower than the target's (its logits padded to the target's width, as Qwen2.5-7B's
    0.5B draft needs)."""
    from engine.core.attention import use_tree_sdpa
    from engine.models import ModelPair, tiny_config, tiny_tokenizer
    from engine.models.widths import match_draft_width

    def model(vocab: int, seed: int):
        config = tiny_config(vocab_size=vocab, num_layers=1, hidden_size=896, intermediate_size=512,
                             num_attention_heads=7, num_key_value_heads=1)
        m = tiny_random_model(seed, config=config)
        use_tree_sdpa(m)
        return m

    target, draft = model(520, 0), model(512, 0)
    assert match_draft_width(draft, 520, fallback=0)
    pair = ModelPair(target, draft, tiny_tokenizer(), torch.device("cpu"), torch.float32, "real-shape target",
                     "real-shape draft", capture=capture_backend("on", torch.device("cpu")))
    prepare_capture(pair, measure=False)
    assert pair.captured["target"].max_rows == 64 and 1 in pair.captured["draft"].serves
    for temperature in (0.0, 0.8):
        sampling = Sampling(temperature=temperature, seed=11)
        captured = generate(pair, spec("dynatree", sampling))
        eager = generate(pair, spec("dynatree", sampling, capture="off"))
        assert pair.static_steps["draft"].captured is pair.captured["draft"]
        assert captured.output_ids == eager.output_ids
        assert [it.accepted for it in captured.iterations] == [it.accepted for it in eager.iterations]


def test_a_package_attends_with_each_key_value_head_read_once():
    """The exported step hands SDPA the query heads folded onto their key/value head (engine/core/attention.py
    tree_sdpa), for one row and for a dynamic row count: traced unfolded, the package's attention cost grew with the
    cache several times faster (docs/experiments/2026-12-06-zen4.md)."""
    from engine.core.attention import use_tree_sdpa
    from engine.models import tiny_config

    config = tiny_config(vocab_size=512, num_layers=1, hidden_size=112, intermediate_size=64, num_attention_heads=7,
                         num_key_value_heads=1)
    model = tiny_random_model(0, config=config)
    model.set_attn_implementation("sdpa")  # a model on plain sdpa is folded for export too, and left as it was
    route_linears(model)
    for recipe in (aoti.Recipe(1), aoti.Recipe(2, hi=8)):
        program = aoti.export_step(model, recipe, standin_tensors(model, recipe.formats()))
        queries = [node.args[0].meta["val"] for node in program.graph.nodes
                   if node.op == "call_function" and "scaled_dot_product" in str(node.target)]
        assert queries and all(q.shape[1] == 1 for q in queries), [tuple(q.shape) for q in queries]
    assert model.config._attn_implementation == "sdpa"
    use_tree_sdpa(model)


def rule_cases() -> list[tuple[str, str]]:
    """Every sampling rule on a strategy whose trees it can check (a branching one where it can, else the chain)."""
    from engine.strategies import make_strategy
    from engine.verify import VERIFIERS, compatible_verifiers
    cases = []
    for rule, cls in VERIFIERS.items():
        if cls.greedy_only:
            continue
        host = next(h for h in ("delayed", "fixed", "linear") if rule in compatible_verifiers(make_strategy(h)))
        cases.append((host, rule))
    return cases


@pytest.mark.parametrize("host,rule", rule_cases())
def test_every_sampling_rule_on_captured_steps_draws_what_eager_draws(pair, host, rule):
    """Seeded sampling: the same draws, so the same tokens and acceptance, captured or eager."""
    sampling = Sampling(temperature=0.9, seed=5)
    captured = generate(pair, spec(host, sampling, verifier=rule))
    eager = generate(pair, spec(host, sampling, verifier=rule, capture="off"))
    assert captured.config.verifier == rule and captured.config.steps == "captured (AOTInductor)"
    assert eager.config.steps == "eager"
    assert captured.output_ids == eager.output_ids
    assert [it.accepted for it in captured.iterations] == [it.accepted for it in eager.iterations]
