"""Sibling projections of one input made one linear, once at load: q|k|v of each attention, gate|up of each MLP.

    fuse_projections(model)      # before the weight formats: the stacked linears get formats like any other linear

transformers' attention calls q_proj, k_proj and v_proj one after another on the same hidden states, and its MLP
calls gate_proj and up_proj on the same input: three (two) small GEMMs where one would do, each paying a CPU kernel's
fixed cost per call, and under dyn8 quantising the same activations again. Here the siblings' weights are stacked
into one `nn.Linear` on their parent (`qkv_proj`, `gate_up_proj`); a forward pre-hook on the parent runs it once per
call, and each sibling becomes a `Slice` that hands back its columns of that output (both live in kernels.py, with
everything else a forward runs: this module only rebuilds the model at load). The parent's forward stays
transformers' own, so every family whose modules call their siblings on the input they were given takes it; a
sibling called on another input raises FusionError rather than answer wrongly.

The stacked weight replaces the siblings' (no second copy). Each output column is the same dot product as before: a
GEMM of another width may sum it in another order, so fp32 results agree to rounding (tests/test_fusion.py bounds
it); the quantised formats scale each output channel on its own, and dyn8 quantises the one input once where the
siblings each quantised it to the same codes. Lab note: docs/experiments/2026-11-28-fused-projections-cpu.md.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from engine.cpu.kernels import Slice, StackedCall
from engine.runtime import fused_projections

SIBLINGS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def fuse_projections(model: nn.Module) -> int:
    """Stack every parent's sibling projections (SIBLINGS) into one linear; returns how many parents were fused now.
    Idempotent; a parent whose siblings differ in input width, dtype or having a bias is left as it is. The model
    keeps the count (engine/runtime.py `fused_projections`), which its cache keys include (engine/measure/costs.py
    `model_identity`)."""
    fused = 0
    for parent in list(model.modules()):
        for stacked, names in SIBLINGS.items():
            linears = [getattr(parent, name, None) for name in names]
            if all(type(m) is nn.Linear for m in linears) and _stackable(linears):
                _fuse(parent, stacked, names, linears)
                fused += 1
    if fused:
        model.fused_projections = fused_projections(model) + fused
    return fused


def _stackable(linears: list[nn.Linear]) -> bool:
    first = linears[0]
    return all(m.in_features == first.in_features and m.weight.dtype == first.weight.dtype
               and m.weight.device == first.weight.device and (m.bias is None) == (first.bias is None)
               for m in linears)


@torch.no_grad()
def _fuse(parent: nn.Module, stacked: str, names: tuple[str, ...], linears: list[nn.Linear]) -> None:
    first = linears[0]
    out = sum(m.out_features for m in linears)
    linear = nn.Linear(first.in_features, out, bias=first.bias is not None, device="meta", dtype=first.weight.dtype)
    linear.weight = nn.Parameter(torch.cat([m.weight for m in linears]), requires_grad=False)
    if first.bias is not None:
        linear.bias = nn.Parameter(torch.cat([m.bias for m in linears]), requires_grad=False)
    start = 0
    for name, m in zip(names, linears):
        setattr(parent, name, Slice(name, start, start + m.out_features))  # the sibling's own weight goes with it
        start += m.out_features
    setattr(parent, stacked, linear)
    hooks = StackedCall(stacked, names, next(iter(inspect.signature(parent.forward).parameters)))
    parent.register_forward_pre_hook(hooks.run, with_kwargs=True)
    parent.register_forward_hook(hooks.forget, with_kwargs=True, always_call=True)
