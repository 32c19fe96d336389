"""The fused layer compiled ahead of time (AOTInductor packages): the compiled step where torch.compile may not run.

    files = build(step, folder)      # once per model shape, dtype, torch and device (a ZeroGPU start-up GPU call)
    load(step, files)                # every later process (a ZeroGPU worker): the step's layer is the package

A ZeroGPU Space may not run torch.compile in a request, but it may run packages that AOTInductor compiled before.
What is packaged is `fused.layer_forward`, the one function every decoder layer runs, with every weight and the cache
as inputs: so one package serves all layers of a model, holds no weight (the worker's weights are the model's own,
never copied or drained from the module, which `spaces.aoti_apply` does to a module it replaces), and two packages
per model cover every forward: one row (AR and a chain's step; dynamo would specialise it anyway) and 2..MAX_ROWS rows
(trees, prefills), the cache length dynamic in both. The eager layer is the reference both are tested against.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

from engine.cuda.fused import FusedStep, layer_forward
from engine.runtime import load_package

FORMAT = 1  # bump when a package's inputs or outputs change meaning
MAX_ROWS = 4096  # the largest forward the many-row package takes (a longer prefill runs the eager layer)
MIN_CACHE, MAX_CACHE = 16, 1 << 17


class Layer(nn.Module):
    """`layer_forward` with the step's sizes fixed, as a module torch.export can trace."""

    def __init__(self, sizes: dict):
        super().__init__()
        self.sizes = sizes

    def forward(self, x, cos, sin, mask, rows, keys, values, qkv, qkv_bias, o, gate_up, down, norm1, norm2, q_norm,
                k_norm):
        return layer_forward(x, cos, sin, mask, rows, keys, values, qkv, qkv_bias, o, gate_up, down, norm1, norm2,
                             q_norm, k_norm, **self.sizes)


def example_args(step: FusedStep, rows: int, length: int = 64) -> tuple:
    """Arguments of layer 0's shapes and kinds: `rows` rows over a zero cache of `length` positions."""
    layer = step.layers[0]
    sizes = step.sizes
    x = layer.qkv.new_zeros(rows, layer.qkv.shape[1])
    cos = x.new_ones(rows, sizes["head_dim"])
    mask = torch.zeros(rows, length, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
    cache = x.new_zeros(1, sizes["kv_heads"], length, sizes["head_dim"])
    index = torch.arange(rows, device=x.device)
    return (x, cos, cos.clone(), mask, index, cache, cache.clone(), *layer.tensors())


def export(step: FusedStep, many: bool):
    """torch.export of the layer: the cache length dynamic; the row count too when `many` (2..MAX_ROWS), else 1."""
    rows_hint = 8 if many else 1
    args = example_args(step, rows_hint)
    length = torch.export.Dim("length", min=MIN_CACHE, max=MAX_CACHE)
    rows = torch.export.Dim("rows", min=2, max=MAX_ROWS) if many else None
    by_rows = {0: rows} if many else {}
    shapes = [by_rows, by_rows, by_rows, {**by_rows, 1: length}, by_rows, {2: length}, {2: length}]
    shapes += [None if t is None else {} for t in args[7:]]
    with torch.inference_mode():
        return torch.export.export(Layer(step.sizes).eval(), args, dynamic_shapes=tuple(shapes), strict=False)


def package_key(step: FusedStep, many: bool) -> dict:
    layer = step.layers[0]
    device = layer.qkv.device
    return {"format": FORMAT, "sizes": step.sizes, "many": many, "dtype": str(layer.qkv.dtype),
            "shapes": [None if t is None else list(t.shape) for t in layer.tensors()], "torch": torch.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}


def package_files(step: FusedStep, folder: Path) -> list[Path]:
    """Where the one-row and the many-row packages of `step` live in `folder` (named by their key's digest)."""
    out = []
    for many in (False, True):
        digest = hashlib.sha256(json.dumps(package_key(step, many), sort_keys=True).encode()).hexdigest()[:20]
        out.append(Path(folder) / f"layer-{digest}.pt2")
    return out


def build(step: FusedStep, folder: Path) -> dict:
    """Compile both packages of `step` into `folder` (each written whole or not at all; present ones are kept).
    Returns {file name: seconds} of what it built."""
    built = {}
    for many, file in zip((False, True), package_files(step, folder)):
        if file.exists():
            continue
        start = time.perf_counter()
        program = export(step, many)
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_name(f".tmp-{os.getpid()}-{file.name}")
        try:
            with torch.inference_mode():
                torch._inductor.aoti_compile_and_package(program, package_path=str(tmp))
            os.replace(tmp, file)
        finally:
            tmp.unlink(missing_ok=True)
        built[file.name] = time.perf_counter() - start
    return built


def load(step: FusedStep, folder: Path) -> float:
    """Make `step`'s layer the packages in `folder` (built by `build` for this step's key); returns the seconds.
    A forward of more than MAX_ROWS rows runs the eager layer."""
    start = time.perf_counter()
    one, many = (_load(file) for file in package_files(step, folder))

    def layer(x, *args, **sizes):
        n = x.shape[0]
        if n > MAX_ROWS:
            return layer_forward(x, *args, **sizes)
        return (one if n == 1 else many)(x, *args)

    step.layer, step.compiled, step.ahead_of_time = layer, True, True
    return time.perf_counter() - start


def _load(file: Path):
    if not file.exists():
        raise FileNotFoundError(f"no compiled layer package {file.name}: build it first (engine/cuda/aot.py)")
    return load_package(file)
