"""Kernel paths for linear layers, chosen per call by row count from measured costs (engine/measure/costs.py).

Every `nn.Linear` of a model can become a `RoutedLinear`, which keeps the original weight (tied weights stay tied)
and adds the other ways torch offers to multiply by it:

  plain   F.linear on the original weight. On CPU, torch's GEMM re-packs the whole weight into its blocked layout
          on every call with more than one row; for a 1.5B model that costs more than the multiplication.
  packed  a copy reordered once into oneDNN's blocked layout (`mkldnn._reorder_linear_weight`), so multi-row calls
          (tree verification, batched draft levels) skip the re-packing. Costs a second copy of the weights.
  int8    weight-only int8, per-output-channel scales (`aten._weight_int8pack_mm`). Half the bytes of bf16.
  int4    weight-only int4, groupwise scales and zeros (`aten._weight_int4pack_mm_for_cpu`). A quarter of the bytes.
          Quantised paths are for the draft: they change its proposals, never the output (the target decides).

Which path is fastest depends on the CPU, the model and the row count (quantised kernels win at 1-4 rows and lose
at 16+; on one CPU the plain path wins single rows, on another the packed one), so no constant can be right. All
linears of a model share one `Router`, filled from the model's measured cost table: for each row count, the path
whose whole-model forward was fastest. Until a table is installed the router sends every call to its `default`.

bf16 on a CPU without native bf16 instructions: oneDNN emulates bf16 GEMMs slowly, so the packed copy is kept in
fp32 instead (every bf16 value is exactly representable in fp32, so the products are the same; only the accumulation
order differs) and multi-row outputs are rounded back to bf16.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

PATHS = ("plain", "packed", "int8", "int4")
QUANT_MODES = ("none", "int8", "int4", "auto")  # auto: both quantised paths, where the device has the kernels
PACKED_DTYPES = (torch.float32, torch.bfloat16)
MODES = ("auto", "on", "off")
_BATCH_HINT = 16  # oneDNN picks the blocked layout for this row count; every row count still works
INT4_GROUP = 64  # int4 scales/zeros per 64 input features: 12 % extra bytes, finer than torchao's CPU default 128
_INT4_INNER_K_TILES = 1  # the CPU int4 kernel ignores the tiling the CUDA one needs; 1 is always valid
_HEADROOM = 2 << 30  # keep this much memory free after packing in "auto"


class PackingError(ValueError):
    """Packing or quantising was asked for where it cannot be done."""


class Router:
    """The kernel path for each row count, shared by every RoutedLinear of one model.

    `by_rows[r - 1]` is the path for r rows; calls with more rows than the table covers take its last entry.
    `forced` overrides everything (calibration measures one path at a time with it).
    """

    def __init__(self, default: str = "plain"):
        self.default = default
        self.paths: list[str] = ["plain"]  # paths every RoutedLinear of the model can take
        self.by_rows: list[str] = []
        self.forced: str | None = None

    def path(self, rows: int) -> str:
        if self.forced is not None:
            return self.forced
        if not self.by_rows:
            return self.default
        return self.by_rows[min(rows, len(self.by_rows)) - 1]

    def install(self, by_rows: list[str]) -> None:
        unknown = set(by_rows) - set(self.paths)
        if unknown:
            raise PackingError(f"routing names paths this model does not have: {sorted(unknown)}")
        self.by_rows = list(by_rows)

    def describe(self) -> str:
        """'plain 1-3, packed 4+' style summary of the routing."""
        if self.forced is not None:
            return f"{self.forced} (forced)"
        if not self.by_rows:
            return f"{self.default} (not calibrated)"
        spans, start = [], 1
        for r in range(2, len(self.by_rows) + 2):
            if r > len(self.by_rows) or self.by_rows[r - 1] != self.by_rows[start - 1]:
                end = "+" if r > len(self.by_rows) else (f"-{r - 1}" if r - 1 > start else "")
                spans.append(f"{self.by_rows[start - 1]} {start}{end}")
                start = r
        return ", ".join(spans)


class RoutedLinear(nn.Module):
    """An nn.Linear that can run each call on a different kernel path (same results up to rounding)."""

    def __init__(self, linear: nn.Linear, router: Router):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the same Parameters: tied weights stay tied
        self.router = router
        self.paths = {"plain"}
        self.compute_dtype = linear.weight.dtype

    # -- adding paths ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def add_packed(self, compute_dtype: torch.dtype | None = None) -> None:
        self.compute_dtype = compute_dtype or self.weight.dtype
        weight = self.weight.detach().to(self.compute_dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _BATCH_HINT)
        bias = None if self.bias is None else self.bias.detach().to(self.compute_dtype)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("packed_bias", bias, persistent=False)
        self.paths.add("packed")

    @torch.no_grad()
    def add_int8(self) -> bool:
        w = self.weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
        q = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.register_buffer("int8_weight", q, persistent=False)
        self.register_buffer("int8_scales", scales.to(self.weight.dtype), persistent=False)
        self.paths.add("int8")
        return True

    @torch.no_grad()
    def add_int4(self, group: int = INT4_GROUP) -> bool:
        """Adds the int4 path where the kernel takes the shape (in_features a multiple of `group`, out_features of
        16); returns whether it did."""
        if self.in_features % group or self.out_features % 16:
            return False
        w = self.weight.detach().float().reshape(self.out_features, -1, group)
        lo, hi = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
        scales = ((hi - lo) / 15).clamp(min=1e-12)
        q = ((w - lo) / scales).round().clamp(0, 15).reshape(self.out_features, self.in_features)
        # The kernel dequantises (q - 8) * scale + zero, so zero is the value of the group's middle code.
        zeros = lo + 8 * scales
        scales_zeros = torch.stack([scales.squeeze(-1), zeros.squeeze(-1)], dim=-1).transpose(0, 1).contiguous()
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), _INT4_INNER_K_TILES)
        self.register_buffer("int4_weight", packed, persistent=False)
        self.register_buffer("int4_scales_zeros", scales_zeros.to(self.weight.dtype), persistent=False)
        self.int4_group = group
        self.paths.add("int4")
        return True

    def dequantized(self, path: str) -> torch.Tensor:
        """The weight a quantised path effectively multiplies by (fp32), for tests and error reports."""
        if path == "int8":
            return self.int8_weight.float() * self.int8_scales.float()[:, None]
        if path == "int4":
            eye = torch.eye(self.in_features, dtype=self.int4_scales_zeros.dtype)
            return self._int4(eye).float().T
        return self.weight.float()

    # -- calling ---------------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        path = self.router.path(rows)
        if path == "plain" or path not in self.paths:  # a layer whose shape the path cannot take
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features)
        if path == "packed":
            out = torch.ops.mkldnn._linear_pointwise(flat.to(self.compute_dtype), self.packed_weight,
                                                     self.packed_bias, "none", [], "")
        elif path == "int8":
            out = torch.ops.aten._weight_int8pack_mm(flat.to(self.int8_scales.dtype), self.int8_weight,
                                                     self.int8_scales)
        else:
            out = self._int4(flat)
        if self.bias is not None and path != "packed":
            out = out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _int4(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(flat.to(self.int4_scales_zeros.dtype), self.int4_weight,
                                                          self.int4_group, self.int4_scales_zeros)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, paths={sorted(self.paths)}"


# ----------------------------------------------------------------------------------------------------------------------
# installing paths on a model


@contextmanager
def forcing(model: nn.Module, path: str | None):
    """Every routed linear of `model` takes `path` inside the block (None: its routing); the previous setting comes
    back afterwards. Calibration times one path at a time this way; the compiled AR traces the plain path."""
    router = router_of(model)
    before = router.forced if router is not None else None
    if router is not None:
        router.forced = path
    try:
        yield
    finally:
        if router is not None:
            router.forced = before


def router_of(model: nn.Module) -> Router | None:
    return getattr(model, "kernel_router", None)


def routed_linears(model: nn.Module) -> list[RoutedLinear]:
    return [m for m in model.modules() if isinstance(m, RoutedLinear)]


def route_linears(model: nn.Module) -> Router:
    """Swap every nn.Linear of `model` for a RoutedLinear sharing one Router (idempotent); returns the router."""
    router = router_of(model)
    if router is None:
        router = Router()
        model.kernel_router = router
    targets = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, RoutedLinear(linear, router))
    return router


def pack_linears(model: nn.Module, compute_dtype: torch.dtype | None = None) -> int:
    """Give every linear of `model` the packed path and make it the default until costs are measured; returns how
    many linears were packed."""
    router = route_linears(model)
    layers = routed_linears(model)
    for layer in layers:
        layer.add_packed(compute_dtype)
    router.paths = _union(router.paths, ["packed"])
    router.default = "packed"
    return len(layers)


def quantize_linears(model: nn.Module, mode: str) -> int:
    """Give every linear of `model` the int8 or int4 path, or both for "auto" (CPU only; elsewhere "auto" adds
    nothing); mode "none": nothing. Returns how many paths were added.

    A quantised path is only a candidate: the router sends a row count to it where it measured fastest."""
    mode = check_quant_mode(mode)
    device = next(model.parameters()).device.type
    if mode == "none" or (mode == "auto" and device != "cpu"):
        return 0
    if device != "cpu":
        raise PackingError(f"{mode} draft weights use torch's CPU kernels; they are not available on {device}")
    modes = ["int8", "int4"] if mode == "auto" else [mode]
    router = route_linears(model)
    done = 0
    for layer in routed_linears(model):
        done += sum(layer.add_int8() if m == "int8" else layer.add_int4() for m in modes)
    router.paths = _union(router.paths, modes)
    return done


def check_quant_mode(mode: str | None) -> str:
    mode = str(mode or "none").strip().lower()
    if mode not in QUANT_MODES:
        raise PackingError(f"draft quantisation must be one of {', '.join(QUANT_MODES)}, got {mode!r}")
    return mode


def _union(have: list[str], new: list[str]) -> list[str]:
    return [p for p in PATHS if p in have or p in new]


# ----------------------------------------------------------------------------------------------------------------------
# whether to pack


def packed_dtype(dtype: torch.dtype, native_bf16: bool) -> torch.dtype:
    """The dtype the packed copy is kept in: fp32 stands in for bf16 where the CPU would emulate bf16."""
    return torch.float32 if dtype == torch.bfloat16 and not native_bf16 else dtype


def linear_bytes(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of all linear weights of `model`, counted in `dtype` (default: their own)."""
    size = torch.empty((), dtype=dtype).element_size() if dtype is not None else None
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, RoutedLinear))]
    return sum(m.weight.numel() * (size or m.weight.element_size()) for m in layers)


_PATH_BUFFERS = {"packed": ("packed_weight",), "int8": ("int8_weight", "int8_scales"),
                 "int4": ("int4_weight", "int4_scales_zeros")}


def step_bytes(model: nn.Module) -> int:
    """Bytes of linear weights one single-row forward reads on the model's current routing (quantised paths read
    their codes and scales, the others the weight in its own dtype). This is what bounds a memory-bound step."""
    router = router_of(model)
    path = router.path(1) if router is not None else "plain"
    total = 0
    for m in model.modules():
        if isinstance(m, RoutedLinear) and path in m.paths and path != "plain":
            total += sum(getattr(m, b).numel() * getattr(m, b).element_size() for b in _PATH_BUFFERS[path])
        elif isinstance(m, (nn.Linear, RoutedLinear)):
            total += m.weight.numel() * m.weight.element_size()
    return total


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
    return True, f"packed weights (+{need / 2**30:.1f} GiB), routed per row count by measured cost"
