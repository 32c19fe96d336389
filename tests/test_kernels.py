"""Pre-packed CPU weights (engine/kernels.py): same numbers as nn.Linear, same decoded tokens, clear refusals."""
import pytest
import torch
from torch import nn

from engine import kernels
from engine.decoder import Decoder
from engine.kernels import PackedLinear, PackingError, pack_linears, should_pack
from engine.models import ModelLoadError, load_pair, tiny_random_pair
from engine.strategies import STRATEGIES, make_strategy

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")


def linear(bias=True, dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Linear(48, 80, bias=bias).to(dtype)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 16, 33])
def test_packed_linear_matches_linear_fp32(rows, bias):
    plain = linear(bias)
    packed = PackedLinear(plain)
    x = torch.randn(1, rows, 48)
    with torch.inference_mode():
        want, got = plain(x), packed(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    if rows <= packed.max_plain_rows:
        assert torch.equal(got, want)  # few rows take the very same plain path
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 9])
def test_packed_linear_bf16_with_fp32_packing(rows):
    plain = linear(dtype=torch.bfloat16)
    packed = PackedLinear(plain, compute_dtype=torch.float32)
    x = torch.randn(2, rows, 48).to(torch.bfloat16)
    exact = torch.nn.functional.linear(x.float(), plain.weight.float(), plain.bias.float())
    with torch.inference_mode():
        got = packed(x)
    assert got.dtype == torch.bfloat16 and got.shape == (2, rows, 80)
    # Products of bf16 values are exact in fp32: only the final rounding to bf16 remains.
    torch.testing.assert_close(got.float(), exact, rtol=1e-2, atol=1e-2)


def test_pack_linears_swaps_every_linear_and_keeps_ties():
    pair = tiny_random_pair("related", seed=0)
    model = pair.target
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    embed = model.get_input_embeddings().weight
    tied = model.lm_head.weight is embed
    assert pack_linears(model) == n_linear
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert (model.lm_head.weight is embed) == tied
    assert not any("packed" in key for key in model.state_dict())  # packed copies are never saved


@pytest.mark.parametrize("name", [n for n in STRATEGIES if n != "ar"])
def test_packed_pair_decodes_exactly(name):
    plain = tiny_random_pair("related", seed=1)
    packed = tiny_random_pair("related", seed=1, packed=True)
    prompt = "def f(x):\n    return"
    reference = Decoder(plain, make_strategy("ar")).generate(prompt, max_new_tokens=60, stop_on_eos=False)
    result = Decoder(packed, make_strategy(name)).generate(prompt, max_new_tokens=60, stop_on_eos=False)
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


def test_load_pair_packing_option():
    pair = load_pair("tiny-random", "tiny-random", dtype="fp32", packed="on")
    assert pair.packed and "packed weights" in pair.describe()
    assert not load_pair("tiny-random", "tiny-random", dtype="fp32", packed="off").packed
    with pytest.raises(ModelLoadError, match="fp32 and bf16"):
        load_pair("tiny-random", "tiny-random", dtype="fp16", packed="on")
