"""Pre-packed CPU weights for multi-row forwards.

On CPU, PyTorch's GEMM re-packs the whole weight matrix into its blocked layout on every call with more than one
input row. For a 1.5B model that re-packing costs more than the multiplication: a 16-token tree verification took
3.4 single-token steps on the 2-core development machine, and 1.6 steps once the weights were packed ahead of time.
Tree verification and batched draft levels are exactly those calls, so they decide whether speculation pays.

`pack_linears` gives every `nn.Linear` a second copy of its weight, reordered once into oneDNN's blocked layout, and
routes calls with more than MAX_PLAIN_ROWS rows through it. Calls with fewer rows (plain autoregressive decoding,
small draft levels) keep the original path, which is memory-bound and as fast or a little faster there. The
price is a second copy of the weights in memory, so `auto` packs only when the memory is free.

bf16 on a CPU without native bf16 instructions: oneDNN emulates bf16 GEMMs slowly, so the packed copy is kept in fp32
instead (every bf16 value is exactly representable in fp32, so the products are the same; only the accumulation
order differs) and multi-row outputs are rounded back to bf16. Single-row calls keep the half-size bf16 weights,
which is where bf16 pays on such a CPU: a memory-bound matrix-vector product.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

PACKED_DTYPES = (torch.float32, torch.bfloat16)
MODES = ("auto", "on", "off")
_BATCH_HINT = 16  # oneDNN picks the blocked layout for this row count; every row count still works
# Up to this many rows the plain path is as fast or faster (memory-bound either way); measured on the 1.5B/0.5B pair.
MAX_PLAIN_ROWS = 3
MAX_PLAIN_ROWS_EMULATED_BF16 = 2  # emulated bf16 GEMMs are already slow at 3 rows
_HEADROOM = 2 << 30  # keep this much memory free after packing in "auto"


class PackingError(ValueError):
    """Packing was asked for where it cannot be done."""


class PackedLinear(nn.Module):
    """An nn.Linear whose multi-row calls use a pre-packed oneDNN copy of the weight (same results up to rounding)."""

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the same Parameters: tied weights stay tied
        self.compute_dtype = compute_dtype or linear.weight.dtype
        same = self.compute_dtype == linear.weight.dtype
        self.max_plain_rows = MAX_PLAIN_ROWS if same else MAX_PLAIN_ROWS_EMULATED_BF16
        with torch.no_grad():
            weight = linear.weight.detach().to(self.compute_dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_HINT)
            bias = None if linear.bias is None else linear.bias.detach().to(self.compute_dtype)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("packed_bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows <= self.max_plain_rows:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features).to(self.compute_dtype)
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed_weight, self.packed_bias, "none", [], "")
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        dtype = str(self.compute_dtype).removeprefix("torch.")
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN {dtype}"


def packed_dtype(dtype: torch.dtype, native_bf16: bool) -> torch.dtype:
    """The dtype the packed copy is kept in: fp32 stands in for bf16 where the CPU would emulate bf16."""
    return torch.float32 if dtype == torch.bfloat16 and not native_bf16 else dtype


def linear_bytes(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of all nn.Linear weights of `model`, counted in `dtype` (default: their own)."""
    size = torch.empty((), dtype=dtype).element_size() if dtype is not None else None
    return sum(m.weight.numel() * (size or m.weight.element_size()) for m in model.modules() if type(m) is nn.Linear)


def available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def packing_supported(device: torch.device, dtype: torch.dtype) -> str | None:
    """None if packing can be done here, else the reason it cannot."""
    if device.type != "cpu":
        return f"packed weights are a CPU optimisation (device is {device.type})"
    if dtype not in PACKED_DTYPES:
        return f"packed weights support fp32 and bf16, not {str(dtype).removeprefix('torch.')}"
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch build has no oneDNN"
    return None


def should_pack(mode: str, models: list[nn.Module], device: torch.device, dtype: torch.dtype,
                native_bf16: bool = False) -> tuple[bool, str]:
    """Decide whether to pack; returns (pack?, why) so the choice can be shown to the user."""
    mode = str(mode or "auto").strip().lower()
    if mode not in MODES:
        raise PackingError(f"packed weights must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "off":
        return False, "packed weights off"
    reason = packing_supported(device, dtype)
    if reason:
        if mode == "on":
            raise PackingError(f"cannot pack weights: {reason}")
        return False, reason
    need = sum(linear_bytes(m, packed_dtype(dtype, native_bf16)) for m in models)
    if mode == "auto":
        free = available_memory()
        if free is None or free < need + _HEADROOM:
            have = "unknown" if free is None else f"{free / 2**30:.1f} GiB"
            return False, f"packed weights need {need / 2**30:.1f} GiB more memory (available: {have})"
    return True, f"packed weights for multi-row forwards (+{need / 2**30:.1f} GiB)"


def pack_linears(model: nn.Module, compute_dtype: torch.dtype | None = None) -> int:
    """Swap every nn.Linear of `model` for a PackedLinear in place; returns how many were swapped."""
    targets = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(linear, compute_dtype))
    return len(targets)
