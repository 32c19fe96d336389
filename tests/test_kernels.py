"""Kernel paths (engine/core/kernels.py): every path computes nn.Linear's numbers, routing follows the measured table,
ties and saved state survive, decoding stays exact, refusals are clear."""
import pytest
import torch
from torch import nn

from engine.core import kernels
from engine.core.kernels import (PackingError, Router, RoutedLinear, pack_linears, quantize_linears, route_linears,
                                 router_of, should_pack)
from engine.decoder import Decoder
from engine.measure.costs import ModelCosts
from engine.models import ModelLoadError, load_pair, tiny_random_pair
from engine.strategies import STRATEGIES, make_strategy

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")
ROWS = [1, 2, 3, 4, 7, 8, 16, 33, 64]


def routed(bias=True, dtype=torch.float32, in_features=128, out_features=80) -> tuple[nn.Linear, RoutedLinear]:
    torch.manual_seed(0)
    plain = nn.Linear(in_features, out_features, bias=bias).to(dtype)
    layer = RoutedLinear(plain, Router())
    return plain, layer


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", ROWS)
def test_plain_and_packed_paths_match_linear_fp32(rows, bias):
    plain, layer = routed(bias)
    layer.add_packed()
    x = torch.randn(1, rows, 128)
    with torch.inference_mode():
        want = plain(x)
        layer.router.forced = "plain"
        assert torch.equal(layer(x), want)  # the plain path is nn.Linear's own call
        layer.router.forced = "packed"
        got = layer(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 9, 64])
@pytest.mark.parametrize("compute_dtype", [torch.bfloat16, torch.float32])
def test_packed_path_bf16(rows, compute_dtype):
    plain, layer = routed(dtype=torch.bfloat16)
    layer.add_packed(compute_dtype)
    layer.router.forced = "packed"
    x = torch.randn(2, rows, 128).to(torch.bfloat16)
    exact = torch.nn.functional.linear(x.float(), plain.weight.float(), plain.bias.float())
    with torch.inference_mode():
        got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (2, rows, 80)
    torch.testing.assert_close(got.float(), exact, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("path", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
def test_quantised_paths_match_their_dequantised_weights(path, dtype, rows):
    plain, layer = routed(dtype=dtype)
    assert layer.add_int8() if path == "int8" else layer.add_int4()
    layer.router.forced = path
    x = torch.randn(rows, 128).to(dtype)
    reference = torch.nn.functional.linear(x.float(), layer.dequantized(path), plain.bias.float())
    with torch.inference_mode():
        got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, 80)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), reference, rtol=tol, atol=tol * 4)
    # and the dequantised weight is a close copy of the original: int8 per channel, int4 per group of 64
    error = (layer.dequantized(path) - plain.weight.float()).abs().max() / plain.weight.float().abs().max()
    assert error < (0.01 if path == "int8" else 0.1)


def test_int4_declines_shapes_it_cannot_take():
    assert routed(out_features=70)[1].add_int4() is False  # the kernel packs output channels in 16s
    _, layer = routed(in_features=96)  # not a multiple of the 64-wide groups
    assert layer.add_int4() is False and "int4" not in layer.paths
    layer.router.paths = ["plain", "int4"]
    layer.router.forced = "int4"
    x = torch.randn(3, 96)
    with torch.inference_mode():
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def synthetic_costs() -> ModelCosts:
    # plain wins at 1-2 rows, packed from 4 on; int4 is fastest at 1 row only
    return ModelCosts("m", {"plain": {1: 1.0, 2: 1.1, 4: 2.0, 8: 3.0, 16: 5.0, 32: 9.0, 64: 17.0},
                            "packed": {1: 1.2, 2: 1.2, 4: 1.3, 8: 1.5, 16: 2.0, 32: 3.0, 64: 5.0},
                            "int4": {1: 0.5, 2: 1.15, 4: 2.5, 8: 5.0, 16: 10.0, 32: 20.0, 64: 40.0}})


def test_routing_follows_the_table():
    costs = synthetic_costs()
    routing = costs.routing()
    assert routing[0] == "int4" and routing[1] == "plain"  # 2 rows: plain 1.1 < int4 1.15 < packed 1.2
    assert set(routing[3:]) == {"packed"}  # from 4 rows on
    assert routing[2] == "packed"  # 3 rows: plain 1.55 and packed 1.25 by interpolation
    router = Router()
    router.paths = ["plain", "packed", "int4"]
    router.install(routing)
    assert [router.path(r) for r in (1, 2, 3, 64, 500)] == ["int4", "plain", "packed", "packed", "packed"]
    assert router.describe() == "int4 1, plain 2, packed 3+"
    router.forced = "plain"
    assert router.path(64) == "plain"
    with pytest.raises(PackingError, match="does not have"):
        Router().install(["packed"])


def test_forcing_restores_the_routing_even_after_an_error():
    pair = tiny_random_pair("related", seed=0)
    router = route_linears(pair.target)
    router.paths = ["plain", "packed"]  # only path names are read here: no forward runs
    router.install(["packed"])
    with pytest.raises(RuntimeError, match="inside"):
        with kernels.forcing(pair.target, "plain"):
            assert router.path(7) == "plain"
            raise RuntimeError("inside")
    assert router.forced is None and router.path(7) == router.by_rows[0]
    with kernels.forcing(nn.Linear(2, 2), "plain"):  # a model without routed linears: nothing to force
        pass


def test_routed_model_keeps_ties_and_state_dict():
    pair = tiny_random_pair("related", seed=0)
    model = pair.target
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    embed = model.get_input_embeddings().weight
    tied = model.lm_head.weight is embed
    keys = set(model.state_dict())
    assert pack_linears(model) == n_linear
    assert quantize_linears(model, "int8") == n_linear
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert all(m.router is router_of(model) for m in kernels.routed_linears(model))  # one router per model
    assert (model.lm_head.weight is embed) == tied
    assert set(model.state_dict()) == keys  # packed / quantised copies are never saved
    assert route_linears(model) is router_of(model)  # idempotent


@pytest.mark.parametrize("name", [n for n in STRATEGIES if n != "ar"])
def test_routed_pair_decodes_exactly(name):
    plain = tiny_random_pair("related", seed=1)
    packed = tiny_random_pair("related", seed=1, packed=True)
    for model in (packed.target, packed.draft):  # both paths in one run: plain at 1-2 rows, packed above
        router = router_of(model)
        router.install(["plain", "plain"] + ["packed"] * 62)
    prompt = "def f(x):\n    return"
    params = {}
    if not STRATEGIES[name].uses_draft:  # context lookup: a repetitive context, matches from one token up
        prompt, params = "the cat sat on the mat. the cat sat on the mat. the cat sat on the", {"min_match": 1}
    reference = Decoder(plain, make_strategy("ar")).generate(prompt, max_new_tokens=60, stop_on_eos=False)
    result = Decoder(packed, make_strategy(name, **params)).generate(prompt, max_new_tokens=60, stop_on_eos=False)
    assert result.output_ids == reference.output_ids
    assert any(len(it.nodes) > 4 for it in result.iterations)  # wide enough forwards to take the packed path


def test_should_pack_modes(monkeypatch):
    model = tiny_random_pair("related", seed=0).target
    cpu = torch.device("cpu")
    assert should_pack("off", [model], cpu, torch.float32)[0] is False
    assert should_pack("on", [model], cpu, torch.float32)[0] is True
    with pytest.raises(PackingError, match="one of auto, on, off"):
        should_pack("sometimes", [model], cpu, torch.float32)
    with pytest.raises(PackingError, match="fp32 and bf16"):
        should_pack("on", [model], cpu, torch.float16)
    with pytest.raises(PackingError, match="CPU optimisation"):
        should_pack("on", [model], torch.device("cuda"), torch.float32)
    # "auto" never refuses; it declines with a reason.
    assert should_pack("auto", [model], torch.device("cuda"), torch.float32)[0] is False
    monkeypatch.setattr(kernels, "available_memory", lambda: 1 << 20)
    pack, why = should_pack("auto", [model], cpu, torch.float32)
    assert pack is False and "more memory" in why
    monkeypatch.setattr(kernels, "available_memory", lambda: 64 << 30)
    assert should_pack("auto", [model], cpu, torch.float32)[0] is True


def test_bf16_packs_in_fp32_without_native_bf16():
    assert kernels.packed_dtype(torch.bfloat16, native_bf16=False) == torch.float32
    assert kernels.packed_dtype(torch.bfloat16, native_bf16=True) == torch.bfloat16
    assert kernels.packed_dtype(torch.float32, native_bf16=False) == torch.float32
    model = tiny_random_pair("related", seed=0).target
    fp32_bytes = kernels.linear_bytes(model)
    assert kernels.linear_bytes(model, torch.bfloat16) * 2 == fp32_bytes


def test_step_bytes_follow_the_single_row_path():
    model = tiny_random_pair("related", seed=0).target
    full = kernels.step_bytes(model)
    assert full == kernels.linear_bytes(model)
    quantize_linears(model, "int8")
    router_of(model).install(["int8"])
    # one byte per weight plus a scale per output channel, against four bytes per fp32 weight
    assert full / 4 < kernels.step_bytes(model) < full / 3.5


def test_load_pair_packing_option(monkeypatch, tmp_path):
    monkeypatch.setenv("TREEVIZ_CACHE", str(tmp_path))
    pair = load_pair("tiny-random", "tiny-random", dtype="fp32", packed="on")
    assert pair.packed and "packed weights" in pair.describe() and "routing" in pair.describe()
    assert set(pair.routing()) == {"target", "draft"}
    assert not load_pair("tiny-random", "tiny-random", dtype="fp32", packed="off").packed
    with pytest.raises(ModelLoadError, match="fp32 and bf16"):
        load_pair("tiny-random", "tiny-random", dtype="fp16", packed="on")
    with pytest.raises(ModelLoadError, match="one of none, int8, int4"):
        load_pair("tiny-random", "tiny-random", dtype="fp32", draft_quant="int3")
