"""Fused sibling projections (engine/cpu/fusion.py) compute what the separate projections computed: through whole
models of each covered family, in every weight format a CPU draft may take, and with each row independent of the
rows beside it. Bounds come from what the arithmetic guarantees (tests/rounding.py), never from one machine's
numbers.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from engine.cpu.fusion import fuse_projections
from engine.cpu.kernels import PATHS, FusionError, Slice, add_format, format_unavailable, route_linears
from engine.models import load_pair
from engine.runtime import forcing
from rounding import UNIT_ROUNDOFF, assert_as_accurate, assert_caught
from test_fused import family_model

FAMILIES = ["qwen2", "qwen3", "llama"]


def logits(model: nn.Module, ids: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(ids).logits[0]]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_fused_model_is_as_accurate_as_the_unfused_one(family):
    """Whole forwards, fp32, judged against float64's answer: the stacked GEMM sums each column in another order,
    nothing more (a wrong slice or a dropped bias is off by O(1), which `assert_caught` shows the bound catches)."""
    model = family_model(family)
    fused = copy.deepcopy(model)
    assert fuse_projections(fused) == 2 * model.config.num_hidden_layers  # one attention and one MLP per layer
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    exact = logits(copy.deepcopy(model).double(), ids)
    bound = assert_as_accurate(logits(fused, ids), logits(model, ids), exact, reduction=model.config.intermediate_size)
    swapped = copy.deepcopy(fused)
    for layer in swapped.model.layers:  # k and v exchanged: the defect a wrong slice would be
        attention = layer.self_attn
        attention.k_proj.start, attention.v_proj.start = attention.v_proj.start, attention.k_proj.start
        attention.k_proj.stop, attention.v_proj.stop = attention.v_proj.stop, attention.k_proj.stop
    assert_caught(logits(swapped, ids), exact, bound)


def test_fusing_keeps_one_copy_and_happens_once():
    model = family_model("qwen2")
    before = sum(p.numel() for p in model.parameters())
    assert fuse_projections(model) == 4
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert all(isinstance(getattr(attention, n), Slice) for n in ("q_proj", "k_proj", "v_proj"))
    assert all(isinstance(getattr(mlp, n), Slice) for n in ("gate_proj", "up_proj"))
    assert attention.q_proj.stop == 64 and attention.qkv_proj.out_features == 64 + 2 * (2 * 8)  # q, then k, v
    assert attention.qkv_proj.bias is not None and mlp.gate_up_proj.bias is None
    assert sum(p.numel() for p in model.parameters()) == before  # the siblings' weights went with them
    assert fuse_projections(model) == 0


def test_a_sibling_called_on_another_input_refuses():
    model = family_model("llama")
    fuse_projections(model)
    attention = model.model.layers[0].self_attn
    with pytest.raises(FusionError, match="k_proj"):
        attention.k_proj(torch.randn(1, 3, 64))
    mlp = model.model.layers[0].mlp
    mlp(torch.randn(1, 3, 64))  # a whole call leaves nothing behind to answer a later stray call with
    with pytest.raises(FusionError, match="up_proj"):
        mlp.up_proj(torch.randn(1, 3, 64))


def column_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The most two fp32 sums of the same K products may differ, per output: 2 * K * u * sum_k |x_k| * m_j, where
    m_j bounds the magnitude of row j of the weight the format multiplies by (a quantised weight is within one step
    of the original: twice the row's largest weight covers int8, int4 and dyn8). dyn8 sums integers exactly."""
    reduction = x.shape[-1]
    largest = weight.detach().double().abs().amax(dim=1)
    return 2 * reduction * UNIT_ROUNDOFF * x.double().abs().sum(-1, keepdim=True) * (2 * largest)


def formats_here() -> list[str]:
    return [p for p in PATHS if format_unavailable(p, torch.device("cpu"), torch.float32) is None]


@pytest.mark.parametrize("path", formats_here())
def test_each_format_of_a_fused_projection_gives_each_column_what_the_separate_one_gave(path):
    model = family_model("qwen2")
    fused = copy.deepcopy(model)
    fuse_projections(fused)
    for m in (model, fused):
        route_linears(m)
        add_format(m, path)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    attention, mlp = (lambda m: m.model.layers[1].self_attn), (lambda m: m.model.layers[1].mlp)
    for parent, stacked, siblings in ((attention, "qkv_proj", ("q_proj", "k_proj", "v_proj")),
                                      (mlp, "gate_up_proj", ("gate_proj", "up_proj"))):
        with torch.no_grad(), forcing(model, path), forcing(fused, path):
            together = getattr(parent(fused), stacked)(x)
            for name in siblings:
                alone, part = getattr(parent(model), name), getattr(parent(fused), name)
                difference = (together[:, part.start:part.stop].double() - alone(x).double()).abs()
                assert (difference <= column_bound(x, alone.weight)).all(), f"{path} {name}"


@pytest.mark.parametrize("path", [p for p in formats_here() if p != "dyn8"])
def test_a_row_of_a_fused_projection_alone_equals_the_row_in_a_batch_of_16(path):
    """Each row is independent of the rows beside it: the GEMMs and the weight-only formats multiply each row by the
    same weight, and only the summation order may change with the batch's height, within a reordered sum's bound.
    dyn8 is left out, as it is for the separate projections: its activations share one quantisation range per call
    (kernels.py `_dyn8`), so a row's codes depend on its batch -- see the next test."""
    model = family_model("qwen2")
    fuse_projections(model)
    route_linears(model)
    add_format(model, path)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    stacked = model.model.layers[0].self_attn.qkv_proj
    with torch.no_grad(), forcing(model, path):
        batch = stacked(x)
        for i in (0, 7, 15):
            alone = stacked(x[i:i + 1])[0]
            assert ((alone.double() - batch[i].double()).abs() <= column_bound(x[i:i + 1], stacked.weight)[0]).all()


def test_a_cpu_pair_fuses_its_draft_and_never_its_target():
    """The production load: the draft's siblings stacked before its formats are chosen (so the probe times the
    stacked shapes), the target's output untouched (its projections stay torch's own)."""
    pair = load_pair("tiny-random", "tiny-random", dtype="fp32", device="cpu", calibrate=False)
    draft_attention, target_attention = pair.draft.model.layers[0].self_attn, pair.target.model.layers[0].self_attn
    assert isinstance(draft_attention.q_proj, Slice) and hasattr(draft_attention, "qkv_proj")
    assert not isinstance(target_attention.q_proj, Slice) and not hasattr(target_attention, "qkv_proj")
    plain = load_pair("tiny-random", "tiny-random", dtype="fp32", device="cpu", calibrate=False, fuse_draft=False)
    assert not isinstance(plain.draft.model.layers[0].self_attn.q_proj, Slice)


def test_dyn8_rows_share_their_calls_quantisation_range():
    """What the batch test leaves out, pinned down: under dyn8 a row's output depends on the rows beside it, on the
    separate projections exactly as on the fused one (the draft's probabilities are those of the call that drew
    them: the tree records them, the rules read them)."""
    if "dyn8" not in formats_here():
        pytest.skip(format_unavailable("dyn8", torch.device("cpu"), torch.float32))
    model = family_model("qwen2")
    route_linears(model)
    add_format(model, "dyn8")
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    x[1:] *= torch.linspace(-3.0, 3.0, 15)[:, None]  # batch-mates of other signs and sizes
    projection = model.model.layers[0].self_attn.k_proj
    with torch.no_grad(), forcing(model, "dyn8"):
        alone, together = projection(x[:1])[0], projection(x)[0]
    assert not torch.equal(alone, together)
