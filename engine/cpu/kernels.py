"""Weight formats for linear layers, one kernel per format, chosen per call by row count from measured costs.

Every `nn.Linear` of a model can become a `RoutedLinear`, which keeps the original weight (tied weights stay tied)
and can hold the same weight in the other formats torch's CPU kernels read:

  plain   F.linear on the original weight. On CPU, torch's GEMM re-packs the weight into its blocked layout on every
          call with more than one row; for a 1.5B model that costs more than the multiplication.
  mkl     fp32, packed once for MKL's packed GEMM (`mkl._mkl_reorder_linear_weight`). One packed copy serves every row
          count (the packed layout does not depend on it; `mkl_works` checks that on this CPU before it is offered).
  packed  packed once into oneDNN's blocked layout (`mkldnn._reorder_linear_weight`), fp32 or bf16 (bf16 only where
          oneDNN has bf16 kernels: `onednn_bf16`).
  int8    weight-only int8, per-output-channel scales (`aten._weight_int8pack_mm`). Half the bytes of bf16.
  int4    weight-only int4, groupwise scales and zeros (`aten._weight_int4pack_mm_for_cpu`). A quarter of the bytes.
  dyn8    int8 weights (per-output-channel, symmetric) times int8 activations quantised on every call (7-bit
          codes; each row first scaled to max |x| = 1, then one range per call, so a row's codes depend on the rows
          beside it), summed in int32: fbgemm's dynamic-quantised linear
          (`quantized.linear_dynamic`, the kernel behind `torch.ao.quantization.quantize_dynamic`; x86 only). The weight-only formats dequantise to fp32, so on a
          CPU without native bf16 they lose to fp32 at every row count; this one multiplies in int8.
          Quantised formats are for the draft: they change its proposals, never the output (the target decides).

Which format is fastest depends on the CPU, the model and the row count, so no constant can be right: the formats a
model may use are measured (engine/cpu/formats.py), only those its routing picks are kept (`drop_format`: memory
is a budget), and all linears of a model share one `Router` that sends each row count to the fastest kept format.

A model whose sibling projections were stacked at load (engine/cpu/fusion.py) runs the stacked linear once per call
of their parent and hands each sibling its columns (`StackedCall`, `Slice`, at the end of this file).

Captured steps (engine/cpu/aoti.py) call the same kernels through one opaque operator, `treeviz::linear`, with
the weights as the package's inputs: a package holds no copy of them, so every package of a model shares the one
resident copy, and any number of packages fits in memory.
"""
from __future__ import annotations

import ctypes
import functools
import itertools
import os
import platform
import threading
import warnings
import weakref
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.runtime import onednn_bf16, router_of

PATHS = ("plain", "mkl", "packed", "int8", "int4", "dyn8")
PACKED = ("mkl", "packed")  # formats made by re-laying out the weight once
QUANTISED = ("int8", "int4", "dyn8")
QUANT_MODES = ("none", "int8", "int4", "dyn8", "auto")  # auto: every quantised format the device has kernels for
PACKED_DTYPES = (torch.float32, torch.bfloat16)
MODES = ("auto", "on", "off")
_BATCH_HINT = 16  # oneDNN and MKL pack for this row count; every row count still works
INT4_GROUP = 64  # int4 scales/zeros per 64 input features: 12 % extra bytes, finer than torchao's CPU default 128
_INT4_INNER_K_TILES = 1  # the CPU int4 kernel ignores the tiling the CUDA one needs; 1 is always valid
# the tensors each format reads (the plain weight is the layer's Parameter; the others are buffers)
FORMAT_TENSORS = {"plain": ("weight",), "mkl": ("mkl_weight",), "packed": ("packed_weight",),
                  "int8": ("int8_weight", "int8_scales"), "int4": ("int4_weight", "int4_scales_zeros"),
                  "dyn8": ("dyn8_handle",)}  # dyn8: the key of its packed weight in _DYN8 (below)


class PackingError(ValueError):
    """A weight format was asked for where it cannot be made."""


class Router:
    """The kernel path for each row count, shared by every RoutedLinear of one model.

    `by_rows[r - 1]` is the path for r rows; calls with more rows than the table covers take its last entry.
    `by_group[group]`, where present, is the same for the linears of one shape group ("1536x8960": every linear of
    that weight shape; formats win at different row counts for a wide and a square weight).
    `forced` overrides everything (calibration measures one path at a time with it).
    """

    def __init__(self, default: str = "plain"):
        self.default = default
        self.paths: list[str] = ["plain"]  # formats some RoutedLinear of the model holds
        self.by_rows: list[str] = []
        self.by_group: dict[str, list[str]] = {}
        self.forced: str | None = None

    def path(self, rows: int, group: str | None = None) -> str:
        if self.forced is not None:
            return self.forced
        table = self.by_group.get(group) or self.by_rows
        if not table:
            return self.default
        return table[min(rows, len(table)) - 1]

    def install(self, by_rows: list[str], by_group: dict[str, list[str]] | None = None) -> None:
        unknown = (set(by_rows) | {p for table in (by_group or {}).values() for p in table}) - set(self.paths)
        if unknown:
            raise PackingError(f"routing names paths this model does not have: {sorted(unknown)}")
        self.by_rows, self.by_group = list(by_rows), dict(by_group or {})

    def describe(self) -> str:
        """'plain 1-3, packed 4+' style summary of the routing (per group, groups that agree written once)."""
        if self.forced is not None:
            return f"{self.forced} (forced)"
        if not self.by_rows and not self.by_group:
            return f"{self.default} (not calibrated)"
        if not self.by_group:
            return describe_rows(self.by_rows)
        texts: dict[str, list[str]] = {}
        for group, table in self.by_group.items():
            texts.setdefault(describe_rows(table), []).append(group)
        return "; ".join(f"{', '.join(groups)}: {text}" for text, groups in texts.items())


def describe_rows(by_rows: list[str]) -> str:
    """['plain', 'packed', 'packed'] -> 'plain 1, packed 2+'."""
    spans, start = [], 1
    for r in range(2, len(by_rows) + 2):
        if r > len(by_rows) or by_rows[r - 1] != by_rows[start - 1]:
            end = "+" if r > len(by_rows) else (f"-{r - 1}" if r - 1 > start else "")
            spans.append(f"{by_rows[start - 1]} {start}{end}")
            start = r
    return ", ".join(spans)


# -- the kernels ---------------------------------------------------------------------------------------------------------
# One function per format: (rows x in_features input, the format's tensors, bias, out_features, int4 group) -> output
# in the input's dtype. Eager calls them directly; a package calls them through `treeviz::linear` (below).

def _plain(x, tensors, bias, out_features, group):
    return F.linear(x, tensors[0], bias)


def _mkl(x, tensors, bias, out_features, group):
    # the original weight is only read where the row count differs from the packing's, which never happens here:
    # the row count is passed as the packing's, and a zero-strided stand-in fills the argument
    ghost = x.new_zeros(()).expand(out_features, x.shape[-1])
    return torch.ops.mkl._mkl_linear(x.contiguous(), tensors[0], ghost, bias, x.shape[0])


def _packed(x, tensors, bias, out_features, group):
    weight = tensors[0]
    bias = None if bias is None else bias.to(weight.dtype)  # a bf16 model's fp32 copy (packed_dtype)
    out = torch.ops.mkldnn._linear_pointwise(x.to(weight.dtype), weight, bias, "none", [], "")
    return out.to(x.dtype)


def _int8(x, tensors, bias, out_features, group):
    weight, scales = tensors
    out = torch.ops.aten._weight_int8pack_mm(x.to(scales.dtype), weight, scales)
    return (out if bias is None else out + bias).to(x.dtype)


def _int4(x, tensors, bias, out_features, group):
    weight, scales_zeros = tensors
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(scales_zeros.dtype), weight, group, scales_zeros)
    return (out if bias is None else out + bias).to(x.dtype)


def _dyn8(x, tensors, bias, out_features, group):
    # fbgemm quantises the activations with one scale per call. Several rows are first scaled to max |x| = 1 each (the
    # output scaled back: the GEMM is linear), so a row of massive activations -- Qwen's first token in a prefill --
    # does not coarsen the other rows' codes. It costs ~15 us a call and lifts the 0.5B draft's top-1 agreement with
    # its fp32 self from ~87 % to ~92 % (8-row calls; 64-71 % to 87-90 % over a prefill). One row needs no scaling.
    # reduce_range: 7-bit activations, as quantize_dynamic uses on x86 -- without VNNI (AVX2: Zen 3) fbgemm sums
    # pairs of u8 x s8 products in int16, which 8-bit activations overflow, silently saturating.
    x32 = x if x.dtype == torch.float32 else x.float()
    params = dyn8_params(tensors[0])
    if x32.shape[0] > 1:
        rows = x32.abs().amax(dim=1, keepdim=True).clamp_(min=1e-30)
        out = torch.ops.quantized.linear_dynamic(x32 / rows, params, True).mul_(rows)
    else:
        out = torch.ops.quantized.linear_dynamic(x32, params, True)
    if bias is not None:
        out += bias
    return out if x.dtype == torch.float32 else out.to(x.dtype)


KERNELS = {"plain": _plain, "mkl": _mkl, "packed": _packed, "int8": _int8, "int4": _int4, "dyn8": _dyn8}

# dyn8's packed weight is a torchbind object (fbgemm's), not a tensor, and a package's inputs must be tensors. So the
# packed weights live in this process-wide registry, and a layer holds a one-element int64 tensor with its key
# (`dyn8_handle`): a package is traced with a stand-in key and called with the model's own, so it runs in any process.


class _Dyn8Entry(NamedTuple):
    params: torch.ScriptObject  # fbgemm's packed weight
    nbytes: int  # the bytes it holds (`_pack_dyn8`)
    handle: weakref.ref  # the handle tensor naming it: `tensor_bytes` of that tensor is `nbytes`


_DYN8: dict[int, _Dyn8Entry] = {}
_DYN8_KEYS = itertools.count(1)  # never 0: stand-in handles are zeros, and must not name a real weight


def dyn8_params(handle: torch.Tensor) -> torch.ScriptObject:
    """The packed weight a dyn8 handle names (PackingError if it was freed, or is a stand-in)."""
    key = int(handle)
    entry = _DYN8.get(key)
    if entry is None:
        raise PackingError(f"dyn8 handle {key} names no packed weight (freed, or a package's stand-in)")
    return entry.params


def _dyn8_entry(tensor: torch.Tensor) -> _Dyn8Entry | None:
    """The registry entry `tensor` is the handle of (that very tensor, not one holding the same number), or None."""
    if tensor.dtype != torch.int64 or tensor.numel() != 1 or tensor.device.type != "cpu":
        return None
    entry = _DYN8.get(int(tensor))
    return entry if entry is not None and entry.handle() is tensor else None


def _pack_dyn8(weight: torch.Tensor) -> tuple[torch.ScriptObject, int]:
    """(fbgemm's packed weight, its bytes) for an fp32 weight: symmetric int8 per output channel (codes -127..127, as
    the int8 format's), no bias (the kernel adds the layer's own after scaling rows back). The bytes are the int8
    weight and fbgemm's per-channel scale, zero point and column offset; its block padding (a few percent) is not
    counted."""
    scales = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12).double()
    zeros = torch.zeros(weight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # torch 2.13 deprecates quantized tensors, but prepacking still takes one
        warnings.filterwarnings("ignore", message=r"torch\.quantize_per_tensor, torch\.quantize_per_channel")
        qweight = torch.quantize_per_channel(weight, scales, zeros, 0, torch.qint8)
    return _prepack_dyn8(qweight)


def _prepack_dyn8(qweight: torch.Tensor) -> tuple[torch.ScriptObject, int]:
    """(fbgemm's packed weight, its bytes as `_pack_dyn8` counts them) for a per-channel qint8 weight."""
    engines = torch.backends.quantized.supported_engines
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = "fbgemm" if "fbgemm" in engines else "x86"  # packing dispatches on it
    try:
        params = torch.ops.quantized.linear_prepack(qweight, None)
    finally:
        torch.backends.quantized.engine = before
    return params, qweight.numel() + 12 * qweight.shape[0]


@torch.library.custom_op("treeviz::linear", mutates_args=())
def opaque_linear(x: torch.Tensor, tensors: list[torch.Tensor], bias: torch.Tensor | None, path: str,
                  out_features: int, group: int) -> torch.Tensor:
    """A format's kernel as one operator the compiler cannot see into: inductor then neither folds the weights into a
    package nor asks them to be constants (its own lowering of the packed ops does), so they stay the package's
    inputs. Only exported graphs call it (`opaque_linears`); eager calls the kernels directly (no dispatch cost)."""
    return KERNELS[path](x, tensors, bias, out_features, group)


@opaque_linear.register_fake
def _(x, tensors, bias, path, out_features, group):
    return x.new_empty(x.shape[0], out_features)


_OPAQUE = threading.local()


@contextmanager
def opaque_linears():
    """Routed linears in this thread call `treeviz::linear` inside the block (torch.export traces that)."""
    before = getattr(_OPAQUE, "on", False)
    _OPAQUE.on = True
    try:
        yield
    finally:
        _OPAQUE.on = before


class RoutedLinear(nn.Module):
    """An nn.Linear that can run each call on a different kernel path (same results up to rounding)."""

    def __init__(self, linear: nn.Linear, router: Router, group: str = "*"):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # the same Parameters: tied weights stay tied
        self.router, self.group = router, group
        self.paths = {"plain"}
        self.int4_group = INT4_GROUP
        self.bound: list[torch.Tensor] | None = None  # a package's weight inputs while it is traced (aoti.py)
        self.bound_path: str | None = None  # and the format they are in

    # -- adding formats --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def add_mkl(self) -> None:
        packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight.detach().float(), _BATCH_HINT)
        self.register_buffer("mkl_weight", packed, persistent=False)
        self.paths.add("mkl")

    @torch.no_grad()
    def add_packed(self, compute_dtype: torch.dtype | None = None) -> None:
        dtype = compute_dtype or self.weight.dtype
        if dtype == torch.bfloat16 and not onednn_bf16():
            raise PackingError("oneDNN has no bf16 GEMM on this CPU (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT); "
                               "pack a bf16 model's weights in fp32 instead (kernels.packed_dtype)")
        packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach().to(dtype), _BATCH_HINT)
        self.register_buffer("packed_weight", packed, persistent=False)
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
    def add_dyn8(self) -> bool:
        """Pack the weight for fbgemm's dynamic-quantised linear (`_pack_dyn8`), kept in the registry under a fresh
        key that the `dyn8_handle` buffer holds; a packing made before is freed first. PackingError where fbgemm
        cannot run (`format_unavailable`)."""
        self._check_dyn8()
        self._keep_dyn8(*_pack_dyn8(self.weight.detach().float()))
        return True

    def _check_dyn8(self) -> None:
        reason = format_unavailable("dyn8", self.weight.device, self.weight.dtype)
        if reason:
            raise PackingError(reason)

    def _keep_dyn8(self, params: torch.ScriptObject, nbytes: int) -> None:
        self._free_dyn8()
        key = next(_DYN8_KEYS)
        handle = torch.tensor([key], dtype=torch.int64)
        _DYN8[key] = _Dyn8Entry(params, nbytes, weakref.ref(handle))
        self.register_buffer("dyn8_handle", handle, persistent=False)
        self._dyn8_release = weakref.finalize(self, _DYN8.pop, key, None)  # a layer collected undropped frees it too
        self.paths.add("dyn8")

    def _free_dyn8(self) -> None:
        release = self.__dict__.pop("_dyn8_release", None)
        if release is not None:
            release()

    @torch.no_grad()
    def add_int4(self, group: int = INT4_GROUP) -> bool:
        """Adds the int4 path where the kernel takes the shape (`takes`); returns whether it did."""
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

    # -- a quantised format kept on disk ------------------------------------------------------------------------
    def stored(self, path: str) -> dict[str, torch.Tensor]:
        """The plain tensors that remake quantised format `path` (QUANTISED) without the float weight: int8's and
        int4's own buffers, dyn8's int8 codes and per-channel scales (fbgemm's packing is an object, not a tensor).
        Quantising reads every float weight; these are a quarter of its bytes (engine/cpu/formats.py)."""
        if path == "dyn8":
            qweight, _ = torch.ops.quantized.linear_unpack(dyn8_params(self.dyn8_handle))
            return {"codes": qweight.int_repr(), "scales": qweight.q_per_channel_scales()}
        return {name: getattr(self, name) for name in FORMAT_TENSORS[path]}

    @torch.no_grad()
    def restore(self, path: str, tensors: dict[str, torch.Tensor]) -> None:
        """Format `path` from what `stored` returned: the same weights and kernels as `add` makes them, in this
        process's own memory at torch's 64-byte alignment. A file maps a tensor 8-byte aligned, and torch's int8
        kernel crashed on such a weight at 4 bf16 rows (docs/experiments/2026-12-06-zen4.md); dyn8's prepacking
        copies anyway."""
        if path == "dyn8":
            self._check_dyn8()
            codes = tensors["codes"]
            zeros = torch.zeros(codes.shape[0], dtype=torch.long)
            qweight = torch._make_per_channel_quantized_tensor(codes, tensors["scales"].double(), zeros, 0)
            self._keep_dyn8(*_prepack_dyn8(qweight))
            return
        for name in FORMAT_TENSORS[path]:
            self.register_buffer(name, tensors[name].clone(), persistent=False)
        self.paths.add(path)

    @torch.no_grad()
    def restore_plain(self, weight: torch.Tensor) -> None:
        """The plain weight again after `drop("plain")` freed it (engine/models/checkpoint.py reads it back)."""
        if weight.shape != (self.out_features, self.in_features) or weight.dtype != self.weight.dtype:
            raise PackingError(f"a plain weight of {tuple(weight.shape)} {weight.dtype} cannot stand for this "
                               f"layer's {(self.out_features, self.in_features)} {self.weight.dtype}")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.paths.add("plain")

    def takes(self, path: str) -> bool:
        """Whether this layer's shape takes format `path` (int4: in_features a multiple of its group, out_features of
        16; every other format takes every shape)."""
        return path != "int4" or (self.in_features % self.int4_group == 0 and self.out_features % 16 == 0)

    def add(self, path: str, compute_dtype: torch.dtype | None = None) -> bool:
        """Add one format by name; returns whether this layer's shape took it."""
        if path == "plain":
            return True
        if path == "mkl":
            self.add_mkl()
            return True
        if path == "packed":
            self.add_packed(compute_dtype)
            return True
        if path == "dyn8":
            return self.add_dyn8()
        return self.add_int8() if path == "int8" else self.add_int4()

    def drop(self, path: str) -> None:
        """Free one format's tensors. The plain weight becomes a shapeless stand-in on the meta device (its shape and
        dtype stay readable); a plain weight tied to another module (the input embedding) is never freed here."""
        if path not in self.paths or len(self.paths) == 1:
            return
        if path == "plain":
            page_out(self.weight)
            self.weight = nn.Parameter(torch.empty(self.weight.shape, dtype=self.weight.dtype, device="meta"),
                                       requires_grad=False)
        else:
            for name in FORMAT_TENSORS[path]:
                self._buffers.pop(name, None)
            if path == "dyn8":
                self._free_dyn8()
        self.paths.discard(path)

    def dequantized(self, path: str) -> torch.Tensor:
        """The weight a quantised path effectively multiplies by (fp32), for tests and error reports."""
        if path == "int8":
            return self.int8_weight.float() * self.int8_scales.float()[:, None]
        if path == "int4":
            eye = torch.eye(self.in_features, dtype=self.int4_scales_zeros.dtype)
            return _int4(eye, self.tensors("int4"), None, self.out_features, self.int4_group).float().T
        if path == "dyn8":
            qweight, _ = torch.ops.quantized.linear_unpack(dyn8_params(self.dyn8_handle))
            return qweight.dequantize()
        return self.weight.float()

    # -- calling ---------------------------------------------------------------------------------------------------
    def tensors(self, path: str) -> list[torch.Tensor]:
        """The tensors `path` reads, in the order its kernel takes them."""
        return [getattr(self, name) for name in FORMAT_TENSORS[path]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        bound = self.bound is not None  # a package's inputs while it is traced
        path = self.bound_path if bound else self.router.path(rows, self.group)
        if path not in self.paths and not bound:  # a layer whose shape the format cannot take
            path = "plain" if "plain" in self.paths else next(p for p in PATHS if p in self.paths)
        if getattr(_OPAQUE, "on", False):
            tensors = self.bound if bound else self.tensors(path)
            out = torch.ops.treeviz.linear(x.reshape(rows, self.in_features), tensors, self.bias, path,
                                           self.out_features, self.int4_group)
            return out.reshape(*x.shape[:-1], self.out_features)
        if path == "plain":
            return F.linear(x, self.weight, self.bias)  # nn.Linear's own call
        out = KERNELS[path](x.reshape(rows, self.in_features), self.tensors(path), self.bias, self.out_features,
                            self.int4_group)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, paths={sorted(self.paths)}"


# ----------------------------------------------------------------------------------------------------------------------
# formats on a model


_MADV_DONTNEED, _MADV_PAGEOUT = 4, 21  # PAGEOUT: Linux 5.4+


def page_out(tensor: torch.Tensor) -> None:
    """Give back the whole pages under a CPU tensor about to be dropped. A loaded weight is a view into the
    checkpoint's memory map, so freeing the tensor leaves its pages mapped (counted against the app's memory);
    unmapping them makes a freed format's memory visibly free. Pages of a file mapping are only unmapped
    (MADV_DONTNEED): the page cache keeps the file, so the next start reads it from memory, not the disk (reclaiming
    them, as PAGEOUT does, made every warm start read ~5 GB from disk:
    docs/experiments/2026-11-28-first-start-float32.md); a weight is never written, so a page read back holds
    what it held. Other memory is paged out (MADV_PAGEOUT), which keeps its contents. Either way a page still shared
    (a tied embedding) reads back on use. Best effort: nothing happens elsewhere."""
    if tensor.device.type != "cpu" or tensor.numel() == 0 or not hasattr(ctypes, "CDLL"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        page = os.sysconf("SC_PAGE_SIZE")
        start = -(-tensor.data_ptr() // page) * page
        end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page * page
        if end > start:
            advice = _MADV_DONTNEED if _file_mapped(start, end) else _MADV_PAGEOUT
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice)
    except (OSError, AttributeError, ValueError):
        pass


def own_plain_weights(model: nn.Module, layers: list[RoutedLinear] | None = None) -> int:
    """Copy each routed plain weight (of `layers`, default all) that is still a view of the checkpoint's file into this
    process's own memory, one weight at a time, unmapping the file's pages after; returns the bytes copied. The
    float32 default target's one-row step ran 8-13 % faster on its own copies than on the file's pages, interleaved
    on one machine (docs/experiments/2026-11-29-room-for-ar.md). The memory plan already counts every kept plain
    weight as resident; the file's pages stay in the page cache, reclaimable, for the next start."""
    copied, seen = 0, set()
    for layer in routed_linears(model) if layers is None else layers:
        weight = layer.weight
        if "plain" not in layer.paths or weight.device.type != "cpu" or id(weight) in seen:
            continue
        seen.add(id(weight))  # a tied head and the embedding share one Parameter: copied once, for both
        try:
            mapped = _file_mapped(weight.data_ptr(), weight.data_ptr() + weight.nbytes)
        except OSError:  # no /proc/self/maps: nothing known to copy
            return copied
        if mapped:
            view, weight.data = weight.data, weight.data.clone()
            page_out(view)
            copied += weight.nbytes
    return copied


def _file_mapped(start: int, end: int) -> bool:
    """Whether [start, end) lies inside one mapping of a file, per /proc/self/maps (False where it cannot say)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= start < high:
                return end <= high and len(fields) >= 6 and fields[4] != "0" and fields[5].startswith("/")
    return False


def named_routed_linears(model: nn.Module) -> list[tuple[str, RoutedLinear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, RoutedLinear)]


def routed_linears(model: nn.Module) -> list[RoutedLinear]:
    return [m for _, m in named_routed_linears(model)]


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
        setattr(parent, child, RoutedLinear(linear, router, group_of(linear)))
    return router


def group_of(linear: nn.Linear) -> str:
    """The shape group of a linear: its weight's shape, in x out ("1536x8960"). Kernels care about shapes, not
    names: a model's gate and up projections behave alike, and timing them together halves the probe's noise."""
    return f"{linear.in_features}x{linear.out_features}"


def add_format(model: nn.Module, path: str, compute_dtype: torch.dtype | None = None,
               drop_plain: bool = False) -> int:
    """Give every linear of `model` the format `path` (where its shape takes it); returns how many took it.
    `drop_plain`: free each layer's plain weight right after its new copy is made, so the model never holds two
    whole copies at once (a tied weight stays: the embedding reads it)."""
    router = route_linears(model)
    tied = tied_weights(model)
    done = 0
    for layer in routed_linears(model):
        if layer.add(path, compute_dtype):
            done += 1
            if drop_plain and path != "plain" and id(layer.weight) not in tied:
                layer.drop("plain")
    router.paths = [p for p in PATHS if any(p in layer.paths for layer in routed_linears(model))]
    return done


def drop_format(model: nn.Module, path: str) -> None:
    """Free `path`'s tensors in every linear of `model` (a tied plain weight stays)."""
    tied = tied_weights(model)
    for layer in routed_linears(model):
        if not (path == "plain" and id(layer.weight) in tied):
            layer.drop(path)
    router = router_of(model)
    if router is not None:
        router.paths = [p for p in PATHS if any(p in layer.paths for layer in routed_linears(model))]
        if router.default not in router.paths:
            router.default = router.paths[0]


def tied_weights(model: nn.Module) -> set[int]:
    """ids of linear weights another module also reads (the input embedding of a tied LM head)."""
    embeddings = [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]
    return {id(w) for w in embeddings}


def pack_linears(model: nn.Module, compute_dtype: torch.dtype | None = None) -> int:
    """Give every linear of `model` oneDNN's packed format and make it the default until costs are measured;
    returns how many linears were packed."""
    count = add_format(model, "packed", compute_dtype)
    router_of(model).default = "packed"
    return count


def quantize_linears(model: nn.Module, mode: str) -> int:
    """Give every linear of `model` the int8, int4 or dyn8 format, or for "auto" each of them this CPU can make
    (`format_unavailable`; elsewhere "auto" adds nothing); mode "none": nothing. Returns how many formats were added.

    A quantised format is only a candidate: the router sends a row count to it where it measured fastest."""
    mode = check_quant_mode(mode)
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    if mode == "none" or (mode == "auto" and device.type != "cpu"):
        return 0
    if device.type != "cpu":
        raise PackingError(f"{mode} draft weights use torch's CPU kernels; they are not available on {device.type}")
    modes = [m for m in QUANTISED if format_unavailable(m, device, dtype) is None] if mode == "auto" else [mode]
    return sum(add_format(model, m) for m in modes)


def check_quant_mode(mode: str | None) -> str:
    mode = str(mode or "none").strip().lower()
    if mode not in QUANT_MODES:
        raise PackingError(f"draft quantisation must be one of {', '.join(QUANT_MODES)}, got {mode!r}")
    return mode


def assigned(model: nn.Module, formats: dict[str, str]) -> list[tuple[RoutedLinear, str]]:
    """(layer, format) for every routed linear of `model` in module order: `formats` maps a shape group to its
    format, "*" every other group; a layer whose shape does not take its format stays plain (as its forward does:
    a layer keeps its plain weight where a kept format cannot take it, formats.make_whole)."""
    pairs = [(layer, formats.get(layer.group, formats.get("*", "plain"))) for layer in routed_linears(model)]
    return [(layer, path if layer.takes(path) else "plain") for layer, path in pairs]


def format_tensors(model: nn.Module, formats: dict[str, str]) -> list[torch.Tensor]:
    """The tensors each layer's format reads (`assigned` order): a package's weight inputs (aoti.py)."""
    return [t for layer, path in assigned(model, formats) for t in layer.tensors(path)]


_STANDIN = {"plain": (None,), "mkl": (torch.float32,), "packed": ("compute",), "int8": (torch.int8, None),
            "int4": (torch.uint8, None), "dyn8": (torch.int64,)}  # None: the model's dtype


def standin_tensors(model: nn.Module, formats: dict[str, str], compute_dtype: torch.dtype | None = None
                    ) -> list[torch.Tensor]:
    """One-element tensors of the right dtypes in format_tensors's order: what a package is traced with. Every
    format's kernel, plain included, is opaque to the compiler, so it never reads their shapes; the package is then
    built without the weights (or the memory to make them: a plain GEMM traced on full-size stand-ins grew the fp32
    target's compile by 5 GB) and called with the model's own."""
    def dtype(kind):
        return model.dtype if kind is None else (compute_dtype or model.dtype) if kind == "compute" else kind

    return [torch.zeros(1, dtype=dtype(kind)) for _, path in assigned(model, formats) for kind in _STANDIN[path]]


@contextmanager
def bound_tensors(model: nn.Module, formats: dict[str, str], tensors: list[torch.Tensor]):
    """Inside the block each routed linear reads its format's tensors from `tensors` (format_tensors's order) and
    takes the format `formats` gives its group, whatever its router says."""
    layers = assigned(model, formats)
    widths = [len(FORMAT_TENSORS[path]) for _, path in layers]
    if len(tensors) != sum(widths):
        raise PackingError(f"{len(tensors)} tensors for {len(layers)} layers needing {sum(widths)}")
    start = 0
    for (layer, path), width in zip(layers, widths):
        layer.bound, layer.bound_path = list(tensors[start:start + width]), path
        start += width
    try:
        yield
    finally:
        for layer, _ in layers:
            layer.bound, layer.bound_path = None, None


# ----------------------------------------------------------------------------------------------------------------------
# which formats this CPU can make


def mkl_works() -> str | None:
    """None if MKL's packed GEMM gives F.linear's numbers at every row count from one packing on this CPU, else why
    not. (The one-packing-for-all-rows use is checked, not assumed: MKL may pick its layout per CPU.)"""
    if not getattr(torch._C, "has_mkl", False):
        return "this PyTorch build has no MKL"
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 160, generator=generator)
    try:
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, _BATCH_HINT)
        for rows in (1, 3, 16, 37):
            x = torch.randn(rows, 160, generator=generator)
            got = _mkl(x, [packed], None, 96, 0)
            if not torch.allclose(got, F.linear(x, weight), rtol=1e-4, atol=1e-4):
                return f"MKL's packed GEMM disagrees with F.linear at {rows} rows on this CPU"
    except RuntimeError as err:
        return f"MKL's packed GEMM failed here ({str(err)[:120]})"
    return None


def format_unavailable(path: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """None if `path` can be made for a model of `dtype` on `device`, else the reason it cannot."""
    if path == "plain":
        return None
    if device.type != "cpu":
        return f"the {path} format is a CPU format (device is {device.type})"
    if path == "dyn8":
        return dyn8_unavailable()
    if path in QUANTISED:
        return None
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch build has no oneDNN"
    if path == "mkl":
        return "MKL's packed GEMM is fp32 only" if dtype != torch.float32 else mkl_works()
    if dtype not in PACKED_DTYPES:
        return f"packed weights support fp32 and bf16, not {str(dtype).removeprefix('torch.')}"
    return None


@functools.cache
def dyn8_unavailable() -> str | None:
    """None if fbgemm's dynamic-quantised linear runs here, else why not: fbgemm is x86 code, and a PyTorch build may
    leave it out (`supported_engines` then lacks fbgemm and x86). Checked by running it once, not assumed."""
    arch = platform.machine().lower()
    if arch not in ("x86_64", "amd64", "x86", "i686", "i386"):
        return f"dyn8 runs on fbgemm, which is x86 only (this CPU is {arch or 'unknown'})"
    engines = torch.backends.quantized.supported_engines
    if "fbgemm" not in engines and "x86" not in engines:
        return f"this PyTorch build has no fbgemm (its quantized engines: {', '.join(engines) or 'none'})"
    generator = torch.Generator().manual_seed(0)
    weight, x = torch.randn(48, 96, generator=generator), torch.randn(3, 96, generator=generator)
    try:
        params, _ = _pack_dyn8(weight)
        got = torch.ops.quantized.linear_dynamic(x, params, True)
    except RuntimeError as err:
        return f"fbgemm's dynamic int8 linear failed here ({str(err)[:120]})"
    want = F.linear(x, weight)
    if (got - want).abs().max() > 0.05 * want.abs().max():  # 7-bit activations: about 1 % off, not more
        return "fbgemm's dynamic int8 linear disagrees with F.linear on this CPU"
    return None


def packed_dtype(dtype: torch.dtype, native_bf16: bool) -> torch.dtype:
    """The dtype oneDNN's packed copy is kept in: fp32 stands in for bf16 where oneDNN has no bf16 GEMM (every bf16
    value is exactly representable in fp32, so the products are the same; only the accumulation order differs)."""
    return torch.float32 if dtype == torch.bfloat16 and not native_bf16 else dtype


def linear_bytes(model: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of all linear weights of `model`, counted in `dtype` (default: their own)."""
    size = torch.empty((), dtype=dtype).element_size() if dtype is not None else None
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, RoutedLinear))]
    return sum(m.weight.numel() * (size or m.weight.element_size()) for m in layers)


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Resident bytes of one of a format's tensors; for a dyn8 handle, those of the packed weight it names (the
    memory plan and the bandwidth estimate count what a format holds, not its one-int64 key)."""
    if tensor.device.type == "meta":
        return 0
    entry = _dyn8_entry(tensor)
    if entry is not None:
        return entry.nbytes
    if tensor.is_mkldnn:
        return int(torch.ops.mkldnn._nbytes(tensor))
    return tensor.numel() * tensor.element_size()


def format_bytes(model: nn.Module, path: str) -> int:
    """Resident bytes of `path`'s tensors over every linear of `model` (0 for a freed plain weight)."""
    return sum(tensor_bytes(t) for t in format_tensors(model, {"*": path}))


def step_bytes(model: nn.Module) -> int:
    """Bytes of linear weights one single-row forward reads on the model's current routing. This is what bounds a
    memory-bound step."""
    router = router_of(model)
    total = 0
    for m in model.modules():
        if isinstance(m, RoutedLinear):
            path = router.path(1, m.group) if router is not None else "plain"  # each shape group's own route
            use = path if path in m.paths else "plain"
            total += sum(tensor_bytes(t) if use != "plain" else t.numel() * t.element_size()
                         for t in m.tensors(use))
        elif isinstance(m, nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
    return total


def return_freed_memory() -> None:
    """Hand the memory freed while formats were made and probed back to the OS (glibc keeps freed blocks in its
    arenas, so the process would go on counting them: ~2 GB after a first start of the fp32 default pair). Best
    effort: nothing happens without glibc."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


# -- sibling projections stacked into one linear (engine/cpu/fusion.py stacks them at load) ----------------------------


class FusionError(RuntimeError):
    """A fused sibling was called on an input its parent's stacked linear did not run on."""


class Slice(nn.Module):
    """What a sibling projection becomes: columns [start, stop) of the stacked output its parent made for `x`."""

    def __init__(self, name: str, start: int, stop: int):
        super().__init__()
        self.name, self.start, self.stop = name, start, stop
        self.made: tuple[torch.Tensor, torch.Tensor] | None = None  # (input, stacked output) of the parent's call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.made is None or self.made[0] is not x:
            raise FusionError(f"{self.name} was called on an input its parent's fused projection did not see")
        return self.made[1][..., self.start:self.stop]

    def extra_repr(self) -> str:
        return f"{self.name}: columns {self.start}:{self.stop}"


class StackedCall:
    """A fused parent's hooks (engine/cpu/fusion.py puts them there): on entry, run the stacked linear on the
    parent's input (`argument`, or its first positional argument) and hand the output to its Slices; on exit, even
    by an exception, let go of it. Everything is looked up on the module per call, so a copied model's hooks serve
    the copy, and the linear the formats put in place of the stacked one (a RoutedLinear) is the one that runs."""

    def __init__(self, stacked: str, names: tuple[str, ...], argument: str):
        self.stacked, self.names, self.argument = stacked, names, argument

    def run(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs[self.argument]
        made = (x, getattr(module, self.stacked)(x))
        for name in self.names:
            getattr(module, name).made = made

    def forget(self, module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        for name in self.names:
            getattr(module, name).made = None
