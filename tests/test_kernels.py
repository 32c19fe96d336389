"""Weight formats (engine/cpu/kernels.py): every format computes nn.Linear's numbers, routing follows the measured
tables (per model and per shape group), ties and saved state survive, freed formats free memory, decoding stays
exact, and a format the CPU cannot make is refused with a reason, never assumed."""
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from engine.cpu import kernels
from engine.cpu.kernels import (PackingError, Router, RoutedLinear, add_format, drop_format, mkl_works,
                                onednn_bf16, pack_linears, quantize_linears, route_linears, router_of)
from engine.decoder import Decoder
from engine.measure.costs import ModelCosts
from engine.models import ModelLoadError, load_pair, tiny_random_pair
from engine.models.loading import candidate_formats
from engine.runtime import forcing
from engine.strategies import STRATEGIES, make_strategy

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")
ROWS = [1, 2, 3, 4, 7, 8, 16, 33, 64]
PACKED = ["packed"] + (["mkl"] if mkl_works() is None else [])


def routed(bias=True, dtype=torch.float32, in_features=128, out_features=80) -> tuple[nn.Linear, RoutedLinear]:
    torch.manual_seed(0)
    plain = nn.Linear(in_features, out_features, bias=bias).to(dtype)
    layer = RoutedLinear(plain, Router())
    return plain, layer


@pytest.mark.parametrize("path", PACKED)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", ROWS)
def test_plain_and_packed_formats_match_linear_fp32(rows, bias, path):
    plain, layer = routed(bias)
    layer.add(path)
    x = torch.randn(1, rows, 128)
    with torch.inference_mode():
        want = plain(x)
        layer.router.forced = "plain"
        assert torch.equal(layer(x), want)  # the plain path is nn.Linear's own call
        layer.router.forced = path
        got = layer(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 9, 64])
@pytest.mark.parametrize("compute_dtype", [torch.bfloat16, torch.float32])
def test_packed_format_of_a_bf16_model(rows, compute_dtype):
    if compute_dtype == torch.bfloat16 and not onednn_bf16():
        pytest.skip("oneDNN has no bf16 GEMM on this CPU: test_bf16_packing_is_refused_without_onednn_bf16 covers it")
    plain, layer = routed(dtype=torch.bfloat16)
    layer.add_packed(compute_dtype)
    layer.router.forced = "packed"
    x = torch.randn(2, rows, 128).to(torch.bfloat16)
    exact = torch.nn.functional.linear(x.float(), plain.weight.float(), plain.bias.float())
    with torch.inference_mode():
        got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (2, rows, 80)
    torch.testing.assert_close(got.float(), exact, rtol=2e-2, atol=2e-2)


AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2"}  # fbgemm reads its own variable


def test_bf16_packing_is_refused_without_onednn_bf16():
    # run as an AVX2-only CPU would (docs/cpu.md): no bf16 default, no bf16 packing, a bf16 model packs in fp32
    script = """
import torch
from engine.cpu.kernels import PackingError, RoutedLinear, Router, onednn_bf16, packed_dtype
from engine.models.devices import cpu_has_fast_bf16, resolve_dtype
assert not onednn_bf16() and not cpu_has_fast_bf16()
assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
layer = RoutedLinear(torch.nn.Linear(64, 32).to(torch.bfloat16), Router())
try:
    layer.add_packed(torch.bfloat16)
    raise SystemExit("bf16 packing was not refused")
except PackingError as err:
    assert "no bf16 GEMM" in str(err), err
layer.add_packed(packed_dtype(torch.bfloat16, cpu_has_fast_bf16()))
layer.router.forced = "packed"
x = torch.randn(3, 64).to(torch.bfloat16)
ref = torch.nn.functional.linear(x.float(), layer.weight.float(), layer.bias.float())
assert torch.allclose(layer(x).float(), ref, rtol=2e-2, atol=2e-2)
print("ok")
"""
    env = {**os.environ, **AVX2}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


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
    assert layer.add_int4() is False and "int4" not in layer.paths and not layer.takes("int4")
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


def test_a_group_routing_overrides_the_model_routing():
    router = Router()
    router.paths = ["plain", "packed"]
    router.install(["plain"], {"64x256": ["plain", "packed"]})
    assert router.path(1, "64x256") == "plain"
    assert router.path(5, "64x256") == "packed"
    assert router.path(5, "64x260") == "plain"  # a group without a table takes the model's
    assert "64x256: plain 1, packed 2+" in router.describe()
    with pytest.raises(PackingError, match="does not have"):
        router.install([], {"64x260": ["int4"]})


def test_forcing_restores_the_routing_even_after_an_error():
    pair = tiny_random_pair("related", seed=0)
    router = route_linears(pair.target)
    router.paths = ["plain", "packed"]  # only path names are read here: no forward runs
    router.install(["packed"])
    with pytest.raises(RuntimeError, match="inside"):
        with forcing(pair.target, "plain"):
            assert router.path(7) == "plain"
            raise RuntimeError("inside")
    assert router.forced is None and router.path(7) == router.by_rows[0]
    with forcing(nn.Linear(2, 2), "plain"):  # a model without routed linears: nothing to force
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
    up, head = model.model.layers[0].mlp.up_proj, model.lm_head
    assert up.group == f"{up.in_features}x{up.out_features}" and head.group != up.group  # groups are weight shapes


def test_dropping_a_format_frees_it_and_keeps_the_shape():
    pair = tiny_random_pair("related", seed=0)
    model = pair.target
    model.lm_head.weight = model.get_input_embeddings().weight  # tie the head, as Qwen2.5's small models do
    route_linears(model)
    x = torch.randn(5, model.config.hidden_size)
    layer = model.model.layers[0].mlp.up_proj
    want = layer(x)
    add_format(model, "packed", drop_plain=True)  # every plain weight freed right after its copy is made ...
    assert layer.weight.device.type == "meta" and layer.weight.shape == (layer.out_features, layer.in_features)
    embed = model.get_input_embeddings().weight
    assert embed.device.type == "cpu" and model.lm_head.weight is embed  # ... but a tied one, which the embedding reads
    router_of(model).install(["packed"])
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    assert kernels.format_bytes(model, "plain") == kernels.tensor_bytes(embed)  # the tied one is all that is left
    drop_format(model, "packed")  # the only format left is never dropped
    assert "packed" in layer.paths


@pytest.mark.parametrize("name", [n for n in STRATEGIES if n != "ar"])
@pytest.mark.parametrize("multi", PACKED)
def test_routed_pair_decodes_exactly(name, multi):
    plain = tiny_random_pair("related", seed=1)
    routed_pair = tiny_random_pair("related", seed=1)
    for model in (routed_pair.target, routed_pair.draft):  # both paths in one run: plain at 1-2 rows, packed above
        add_format(model, multi)
        router_of(model).install(["plain", "plain"] + [multi] * 62)
    prompt = "def f(x):\n    return"
    params = {}
    if not STRATEGIES[name].uses_draft:  # context lookup: a repetitive context, matches from one token up
        prompt, params = "the cat sat on the mat. the cat sat on the mat. the cat sat on the", {"min_match": 1}
    reference = Decoder(plain, make_strategy("ar")).generate(prompt, max_new_tokens=60, stop_on_eos=False)
    result = Decoder(routed_pair, make_strategy(name, **params)).generate(prompt, max_new_tokens=60,
                                                                          stop_on_eos=False)
    assert result.output_ids == reference.output_ids
    assert any(len(it.nodes) > 4 for it in result.iterations)  # wide enough forwards to take the packed path


def test_candidate_formats():
    cpu = torch.device("cpu")
    assert candidate_formats("off", "none", cpu, torch.float32) == ["plain"]
    auto = candidate_formats("auto", "none", cpu, torch.float32)
    assert auto[0] == "plain" and set(auto[1:]) == set(PACKED)
    assert "plain" not in candidate_formats("on", "none", cpu, torch.float32)
    assert candidate_formats("off", "auto", cpu, torch.float32) == ["plain", "int8", "int4", "dyn8"]
    assert candidate_formats("off", "dyn8", cpu, torch.float32) == ["plain", "dyn8"]
    assert "mkl" not in candidate_formats("auto", "none", cpu, torch.bfloat16)  # MKL's packed GEMM is fp32 only
    with pytest.raises(PackingError, match="one of auto, on, off"):
        candidate_formats("sometimes", "none", cpu, torch.float32)
    with pytest.raises(PackingError, match="cannot pack"):
        candidate_formats("on", "none", cpu, torch.float16)
    assert kernels.format_unavailable("packed", torch.device("cuda"), torch.float32).startswith("the packed format")


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
    linears = list(kernels.routed_linears(model))
    group = linears[0].group  # one shape group routed to plain at one row, int8 above: its one row reads plain
    router_of(model).install(["int8"], {group: ["plain", "int8"]})
    expected = sum(kernels.tensor_bytes(t) for m in linears for t in m.tensors("plain" if m.group == group else "int8"))
    assert kernels.step_bytes(model) == expected + sum(m.weight.numel() * m.weight.element_size()
                                                      for m in model.modules() if type(m) is torch.nn.Linear)


def test_load_pair_packing_option(monkeypatch, tmp_path):
    monkeypatch.setenv("TREEVIZ_CACHE", str(tmp_path))
    pair = load_pair("tiny-random", "tiny-random", dtype="fp32", packed="on")
    assert pair.packed and "routing" in pair.describe()
    assert set(pair.routing()) == {"target", "draft"}
    assert set(pair.formats) == {"target", "draft"}
    assert not load_pair("tiny-random", "tiny-random", dtype="fp32", packed="off").packed
    with pytest.raises(ModelLoadError, match="cannot pack"):
        load_pair("tiny-random", "tiny-random", dtype="fp16", packed="on")
    with pytest.raises(ModelLoadError, match="one of none, int8, int4"):
        load_pair("tiny-random", "tiny-random", dtype="fp32", draft_quant="int3")


# -- dyn8: int8 weights times dynamically quantised int8 activations (fbgemm) ------------------------------------------

needs_dyn8 = pytest.mark.skipif(kernels.dyn8_unavailable() is not None,
                                reason=f"no dyn8 here: {kernels.dyn8_unavailable()}")


def dyn8_reference(layer: RoutedLinear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the dyn8 kernel computes, in fp32: several rows each scaled to max |x| = 1, then quantised together to
    7-bit codes (0..127, reduce_range) with torch's own choice of scale and zero point, times the layer's dequantised
    int8 weight, each row scaled back, plus the bias. And per row, what one code more or less in one input moves an
    output by: a row's largest input can land exactly between two codes (with rows scaled to 1 it often does), and
    fbgemm rounds that tie in float arithmetic of its own."""
    x = x.float()
    rows = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-30) if x.shape[0] > 1 else torch.ones(1, 1)
    x = x / rows
    scale, zero = torch._choose_qparams_per_tensor(x, True)
    codes = (torch.round(x / scale) + zero).clamp(0, 127)
    weight = layer.dequantized("dyn8")
    out = torch.nn.functional.linear((codes - zero) * scale, weight) * rows
    return (out if layer.bias is None else out + layer.bias.float()), rows * scale * weight.abs().max()


@needs_dyn8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", ROWS)
def test_dyn8_matches_its_own_quantisation(rows, bias, dtype):
    plain, layer = routed(bias, dtype)
    assert layer.add("dyn8") and "dyn8" in layer.paths
    layer.router.forced = "dyn8"
    x = torch.randn(rows, 128).to(dtype)
    with torch.inference_mode():
        got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, 80)
    # int32 sums of int8 products, scaled in fp32: the reference's own rounding is all that differs, and at most one
    # tie rounded the other way per row
    reference, one_code = dyn8_reference(layer, x)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert ((got.float() - reference).abs() <= one_code + tol * (1 + reference.abs())).all()
    # and both quantisations together stay within a few percent of nn.Linear (7-bit activations, int8 weights)
    want = plain(x.float() if dtype == torch.float32 else x).float().detach()
    assert (got.float() - want).abs().max() < 0.05 * want.abs().max()


@needs_dyn8
def test_dyn8_does_not_saturate_without_vnni():
    """On a CPU without VNNI (AVX2 only: Zen 3), fbgemm adds pairs of u8 x s8 products in int16; 8-bit activations
    overflow it, silently. dyn8 quantises activations to 7 bits, so even all-maximal codes stay exact there."""
    script = """
import torch
from engine.cpu.kernels import RoutedLinear, Router
layer = RoutedLinear(torch.nn.Linear(64, 16, bias=False), Router())
with torch.no_grad():
    layer.weight.fill_(0.5)  # every weight code 127
layer.add("dyn8")
layer.router.forced = "dyn8"
x = torch.rand(3, 64) + 1.0  # positive: zero point 0, every code near the top of the range
x[:, 0] = 0.0
rows = x.abs().amax(dim=1, keepdim=True)  # the reference, as dyn8_reference computes it
scale, zero = torch._choose_qparams_per_tensor(x / rows, True)
codes = (torch.round(x / rows / scale) + zero).clamp(0, 127)
reference = torch.nn.functional.linear((codes - zero) * scale, layer.dequantized("dyn8")) * rows
with torch.inference_mode():
    error = (layer(x) - reference).abs().max().item()
assert error < 1e-3 * reference.abs().max().item(), error
print("ok")
"""
    env = {**os.environ, **AVX2}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


@needs_dyn8
def test_dyn8_rows_keep_their_own_precision():
    """One row of massive activations (Qwen's first token in a prefill) must not coarsen the other rows' codes: each
    row comes out as it would alone. Quantised with one scale for all rows, the quiet rows would lose most of their
    bits."""
    _, layer = routed()
    layer.add("dyn8")
    layer.router.forced = "dyn8"
    x = torch.randn(6, 128)
    x[0] *= 1000.0
    with torch.inference_mode():
        together = layer(x)
        alone = torch.cat([layer(row[None]) for row in x])
    quiet = alone[1:].abs().max()
    assert (together[1:] - alone[1:]).abs().max() < 0.03 * quiet
    assert (together[0] - alone[0]).abs().max() < 0.03 * alone[0].abs().max()


@needs_dyn8
def test_dyn8_lives_in_the_registry_until_dropped():
    _, layer = routed()
    layer.add("dyn8")
    handle = layer.dyn8_handle
    key = int(handle)
    assert key in kernels._DYN8 and handle.dtype == torch.int64 and handle.numel() == 1
    # its bytes are the int8 weight's (plus per-channel extras), not the handle's 8
    assert 128 * 80 <= kernels.tensor_bytes(handle) < 128 * 80 * 1.2
    assert kernels.tensor_bytes(torch.tensor([key])) == 8  # the same number in another tensor is no handle
    layer.add("dyn8")  # packing again frees the earlier packing
    assert key not in kernels._DYN8 and int(layer.dyn8_handle) in kernels._DYN8
    key = int(layer.dyn8_handle)
    layer.drop("dyn8")
    assert key not in kernels._DYN8 and "dyn8" not in layer.paths and not hasattr(layer, "dyn8_handle")
    with pytest.raises(PackingError, match="names no packed weight"):
        kernels.dyn8_params(torch.tensor([key]))
    layer.add("dyn8")
    key = int(layer.dyn8_handle)
    del layer  # a layer collected without dropping it frees its packing too
    assert key not in kernels._DYN8
    with pytest.raises(PackingError, match="stand-in"):
        kernels.dyn8_params(torch.zeros(1, dtype=torch.int64))  # a package's stand-in names nothing


@needs_dyn8
def test_dyn8_bytes_in_the_memory_plan_and_the_step():
    model = tiny_random_pair("related", seed=0).target
    fp32 = kernels.step_bytes(model)
    quantize_linears(model, "dyn8")
    router_of(model).install(["dyn8"])
    # one byte per weight plus 12 per output channel, against four bytes per fp32 weight
    assert fp32 / 4 < kernels.step_bytes(model) < fp32 / 3.3
    assert kernels.format_bytes(model, "dyn8") == kernels.step_bytes(model)


def test_dyn8_is_refused_where_fbgemm_cannot_run(monkeypatch):
    kernels.dyn8_unavailable.cache_clear()
    monkeypatch.setattr(kernels.platform, "machine", lambda: "aarch64")
    try:
        reason = kernels.format_unavailable("dyn8", torch.device("cpu"), torch.float32)
        assert reason is not None and "x86" in reason
        model = tiny_random_pair("related", seed=0).draft
        assert quantize_linears(model, "auto") > 0  # int8 and int4 ...
        assert "dyn8" not in router_of(model).paths  # ... but not dyn8
        with pytest.raises(PackingError, match="x86"):
            quantize_linears(model, "dyn8")
    finally:
        kernels.dyn8_unavailable.cache_clear()
    assert kernels.format_unavailable("dyn8", torch.device("cuda"), torch.float32).startswith("the dyn8 format")


@needs_dyn8
@pytest.mark.parametrize("name", [n for n in STRATEGIES if STRATEGIES[n].uses_draft])
def test_a_dyn8_draft_decodes_exactly(name):
    """The draft's proposals change with its arithmetic; the output never does (the target decides)."""
    plain = tiny_random_pair("related", seed=1)
    pair = tiny_random_pair("related", seed=1)
    add_format(pair.draft, "dyn8", drop_plain=True)  # a draft that can only run dyn8 (its tied head stays too)
    router_of(pair.draft).install(["dyn8"] * 64)
    prompt = "def f(x):\n    return"
    reference = Decoder(plain, make_strategy("ar")).generate(prompt, max_new_tokens=60, stop_on_eos=False)
    result = Decoder(pair, make_strategy(name)).generate(prompt, max_new_tokens=60, stop_on_eos=False)
    assert result.output_ids == reference.output_ids
    assert any(len(it.nodes) > 4 for it in result.iterations)  # trees of several rows, not only single rows
    assert sum(it.accepted for it in result.iterations) > 0  # the dyn8 draft's proposals are accepted


@needs_dyn8
def test_a_captured_dyn8_draft_computes_what_the_eager_one_does(tmp_path):
    """Packages traced with stand-in handles and called with the draft's own compute the eager dyn8 draft's logits,
    at one row and at a dynamic row count -- after the draft was packed again under new handles, so a handle is the
    package's input, never its constant (a package built in one process runs in another). Compiles two tiny
    packages (about 20 s each)."""
    from engine.cpu import aoti
    from engine.cpu.packages import CapturedModel, Package
    from engine.core.steps import DynamicSteps, StaticSteps, causal_visibility
    reason = aoti.compiler_missing()
    if reason:
        pytest.skip(reason)
    draft = tiny_random_pair("related", seed=0).draft
    add_format(draft, "dyn8")
    router_of(draft).install(["dyn8"] * 64)
    recipes = [aoti.Recipe(1, "dyn8"), aoti.Recipe(2, "dyn8", hi=8)]
    files = [tmp_path / f"dyn8-{i}.pt2" for i in range(len(recipes))]
    for recipe, file in zip(recipes, files):
        aoti.build(draft, recipe, file, kernels.standin_tensors(draft, recipe.formats()))
    add_format(draft, "dyn8")  # packed again: new handles, the earlier packings freed
    drop_format(draft, "plain")  # and the eager draft can only run dyn8
    calls = []

    def counted(runner):
        return lambda *args: calls.append(1) or runner(*args)

    packages = [Package(recipe, counted(aoti.load(file, kernels.format_tensors(draft, recipe.formats()))),
                        str(file), None, 0.0, file.stat().st_size) for recipe, file in zip(recipes, files)]
    captured = CapturedModel(packages)
    captured.serve_all()
    static, eager = StaticSteps(draft, 64, (1,), captured=captured), DynamicSteps(draft)
    tol = dict(rtol=1e-4, atol=1e-3)  # fp32; inductor sums the norms in its own order
    with torch.inference_mode():
        ids = list(range(40, 52))  # 12 rows: eager in both
        torch.testing.assert_close(static.prefill(ids), eager.prefill(ids), **tol)
        for tokens in ([5], [6, 7, 8], [9], list(range(60, 68))):
            positions = list(range(static.length, static.length + len(tokens)))
            visible = causal_visibility(static.length, len(tokens))
            torch.testing.assert_close(static.forward(tokens, positions, visible),
                                       eager.forward(tokens, positions, visible), **tol)
    assert len(calls) == 4  # every forward after the prefill ran a package


def cached_fraction(file) -> float:
    """The fraction of `file`'s pages in the page cache (mincore over a fresh private mapping of it)."""
    import ctypes
    import mmap
    page, size = mmap.PAGESIZE, file.stat().st_size
    with open(file, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        pages = (size + page - 1) // page
        vec = (ctypes.c_ubyte * pages)()
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        assert ctypes.CDLL(None).mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vec) == 0
        return sum(v & 1 for v in vec) / pages


def test_page_out_keeps_a_mapped_weight_readable_and_frees_its_pages(tmp_path):
    """A loaded checkpoint's weights are views into its memory map: paging one out before it is dropped frees its
    resident pages, a tied view still reads the same values (they are read back from the file), and the file stays
    in the page cache for the next start."""
    from safetensors.torch import load_file, save_file
    file = tmp_path / "w.safetensors"
    save_file({"w": torch.arange(4_000_000, dtype=torch.float32)}, str(file))
    with open(file, "rb+") as written:
        os.fsync(written.fileno())  # clean pages, as a checkpoint saved on an earlier start has: reclaimable
    weight = load_file(str(file))["w"]
    total = float(weight.sum())

    def file_rss_kib() -> int:
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssFile"))

    before = file_rss_kib() if os.path.exists("/proc/self/status") else None
    kernels.page_out(weight)
    if before is not None and tuple(map(int, os.uname().release.split(".")[:2])) >= (5, 4):
        assert file_rss_kib() < before - 8_000  # ~15 MiB of pages gone (MADV_PAGEOUT, Linux 5.4+)
    if os.path.exists("/proc/self/maps"):
        assert cached_fraction(file) > 0.9  # unmapped, not evicted: MADV_PAGEOUT would have dropped it
    assert float(weight.sum()) == total


# -- quantised formats kept on disk between starts (engine/cpu/formats.py stored_file) ----------------------------

def keeping(model, path: str):
    """A FormatChoice that keeps `path` alone for every shape group of `model` (each group's table says it is best)."""
    from engine.cpu.formats import FormatChoice, GroupChoice
    groups = {}
    for layer in kernels.routed_linears(model):
        groups.setdefault(layer.group, GroupChoice({path: {1: 1.0}}, [path], 0))
    return FormatChoice(groups, {})


def made_whole(path: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    from engine.cpu.packages import remember_fingerprint
    from engine.cpu.formats import make_whole
    model = tiny_random_pair("related", seed=seed, num_layers=2).draft.to(dtype)
    route_linears(model)
    remember_fingerprint(model)
    make_whole(model, keeping(model, path))
    return model


@pytest.mark.parametrize("path", ["int8", "int4", "dyn8"])
def test_a_quantised_format_read_back_from_disk_computes_exactly_what_was_made(path, monkeypatch, tmp_path):
    """A warm start reads a draft's quantised formats instead of quantising its float weights again: the layers then
    hold the same codes and compute the same numbers, bit for bit, for one row and for 16; other weights get a file
    of their own, and a damaged file costs a remake, never a start."""
    if path == "dyn8" and kernels.dyn8_unavailable() is not None:
        pytest.skip(kernels.dyn8_unavailable())
    monkeypatch.setenv("TREEVIZ_CACHE", str(tmp_path))
    made = made_whole(path)
    files = list((tmp_path / "formats").iterdir())
    assert len(files) == 1
    making = RoutedLinear.add

    def only_unquantised(self, format_path, *args):
        assert format_path not in kernels.QUANTISED, f"{format_path} was made again, not read back"
        return making(self, format_path, *args)
    monkeypatch.setattr(RoutedLinear, "add", only_unquantised)
    read = made_whole(path)
    pairs = list(zip(kernels.routed_linears(made), kernels.routed_linears(read)))
    assert sum(path in a.paths for a, _ in pairs) >= 4  # the format is there to compare
    torch.manual_seed(1)
    for a, b in pairs:
        assert a.paths == b.paths
        for rows in (1, 16):
            x = torch.randn(rows, a.in_features)
            assert torch.equal(a(x), b(x))
    monkeypatch.setattr(RoutedLinear, "add", making)
    made_whole(path, seed=1)  # other weights: another file
    assert len(list((tmp_path / "formats").iterdir())) == 2
    def refused(*args):
        raise OSError("no space left on device")
    monkeypatch.setattr("engine.cpu.formats.save_file", refused)
    made_whole(path, seed=2)  # a disk that refuses the write costs the next start a remake, never this one
    assert len(list((tmp_path / "formats").iterdir())) == 2
    monkeypatch.undo()
    monkeypatch.setenv("TREEVIZ_CACHE", str(tmp_path))
    files[0].write_bytes(b"not a safetensors file")
    again = made_whole(path)
    x = torch.randn(3, pairs[0][0].in_features)
    assert torch.equal(kernels.routed_linears(again)[0](x), pairs[0][0](x))
    assert files[0].stat().st_size > 100  # rewritten whole


@pytest.mark.parametrize("path", ["int8", "int4"])
def test_formats_read_back_from_disk_are_aligned_copies(path, monkeypatch, tmp_path):
    """safetensors maps each kept tensor at its offset in the file, 8-byte aligned; torch's int8 kernel reads its
    weight with aligned loads on bf16 rows and crashed the process at 4 rows on an AVX-512-bf16 CPU (a Zen 4). Read
    back, every format tensor is the process's own memory at torch's 64-byte alignment, and a bf16 model runs 4 rows
    through each read-back layer in a fresh process that ends cleanly."""
    monkeypatch.setenv("TREEVIZ_CACHE", str(tmp_path))
    made_whole(path)
    read = made_whole(path)
    tensors = [getattr(layer, name) for layer in kernels.routed_linears(read) if path in layer.paths
               for name in kernels.FORMAT_TENSORS[path]]
    assert len(tensors) >= 4 and all(t.data_ptr() % 64 == 0 for t in tensors)
    code = ("import torch\nfrom engine.cpu import kernels\nfrom test_kernels import made_whole\n"
            f"made_whole({path!r}, dtype=torch.bfloat16)\nmodel = made_whole({path!r}, dtype=torch.bfloat16)\n"
            "for layer in kernels.routed_linears(model):\n"
            "    assert torch.isfinite(layer(torch.randn(4, layer.in_features, dtype=torch.bfloat16))).all()\n"
            "print('clean')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(__file__), capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TREEVIZ_CACHE": str(tmp_path / "bf16")})
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert done.stdout.split()[-1:] == ["clean"], done.stdout[-2000:]
