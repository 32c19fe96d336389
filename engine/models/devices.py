"""Where models run and in what precision.

`resolve_device` and `resolve_dtype` turn the user's words ("auto", "cuda:1", "bf16") into torch objects or a
ModelLoadError that says what to use instead; "auto" picks bf16 only where it is fast (CUDA, or a CPU with native
bf16 dot products), else fp32, which keeps greedy decoding exact.
"""
from __future__ import annotations

import os

import torch

from engine.cpu.aoti import compiler_missing
from engine.measure.costs import cpu_capability, cpu_info
from engine.models.pair import ModelLoadError
from engine.runtime import onednn_bf16


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """"auto" -> cuda if available else cpu. Also cpu, cuda, cuda:N, mps."""
    if isinstance(name, torch.device):
        name = str(name)
    name = (name or "auto").strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):
        raise ModelLoadError(f"Unknown device {name!r}. Use 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'.")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(f"Device {name!r} was asked for but CUDA is not available in this torch build or "
                                 "on this machine. Use --device cpu (or 'auto').")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ModelLoadError(f"Device {name!r} does not exist: this machine has "
                                 f"{torch.cuda.device_count()} CUDA device(s).")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ModelLoadError("Device 'mps' was asked for but is not available here. Use --device cpu (or 'auto').")
    return device


_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU, as torch's kernels will drive it, has native bf16 dot products: the flags (avx512_bf16 or
    amx_bf16), AVX-512 kernels in ATen (ATEN_CPU_CAPABILITY may lower that) and bf16 GEMMs in oneDNN
    (ONEDNN_MAX_CPU_ISA may lower that). So an emulated AVX2-only machine (docs/cpu.md) is one here too. bf16 is the
    default only where this holds; elsewhere fp32 keeps greedy decoding exact and fast."""
    flags = cpu_info()["flags"].split()
    if "avx512_bf16" not in flags and "amx_bf16" not in flags:
        return False
    return cpu_capability().startswith("AVX512") and onednn_bf16()


def cpu_class() -> str:
    """The class this CPU runs as, for people: "AMX" / "native bf16" / "AVX-512" / "AVX2" (after any emulation)."""
    capability = cpu_capability()
    if cpu_has_fast_bf16():
        return "AMX" if "amx_bf16" in cpu_info()["flags"].split() else "native bf16"
    return "AVX-512" if capability.startswith("AVX512") else capability.replace("AVX2", "AVX2 only")


def machine_label(device: torch.device) -> str:
    """e.g. "Intel(R) Xeon(R) Processor, 2 cores, AMX" or "NVIDIA H100 80GB HBM3": what a recorded speed was
    measured on, so a page that shows it can say so (CPUs differ more than any setting)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = cpu_info()["name"]
    return f"{'unknown CPU' if name == 'unknown' else name}, {os.cpu_count()} cores, {cpu_class()}"


def resolve_dtype(name: str | torch.dtype, device: torch.device) -> torch.dtype:
    """"auto": cuda -> bf16 (fp16 on GPUs without bf16); cpu -> bf16 only with native bf16 instructions, else fp32."""
    if isinstance(name, torch.dtype):
        if name in _DTYPES.values():
            return name
        raise ModelLoadError(f"Unsupported dtype {name}. Use fp32, bf16 or fp16.")
    key = str(name or "auto").strip().lower().removeprefix("torch.")
    if key == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if device.type == "cpu" and cpu_has_fast_bf16():
            return torch.bfloat16
        return torch.float32
    if key not in _DTYPES:
        raise ModelLoadError(f"Unknown dtype {name!r}. Use 'auto', 'fp32'/'float32', 'bf16'/'bfloat16' or "
                             "'fp16'/'float16'.")
    return _DTYPES[key]


CAPTURE_MODES = ("auto", "on", "off")


class CaptureUnavailable(RuntimeError):
    """Captured steps were asked for (`on`) where they cannot be built."""


def capture_backend(mode: str, device: torch.device) -> str | None:
    """"aoti" (CPU packages, engine/cpu/packages.py), "cuda-graphs" (engine/cuda/graphs.py), or None (eager) for
    the pair's switch `mode` (auto | on | off) on `device`."""
    if mode not in CAPTURE_MODES:
        raise ValueError(f"capture must be one of {', '.join(CAPTURE_MODES)}, not {mode!r}")
    if mode == "off":
        return None
    if device.type == "cuda":  # graphs = eager = AR token for token on an H100 (docs/gpu.md): on by default
        return "cuda-graphs"
    if device.type != "cpu":
        if mode == "on":
            raise CaptureUnavailable(f"captured steps run on CPU (AOTInductor) or CUDA (graphs), not {device.type}")
        return None
    reason = compiler_missing()
    if reason and mode == "on":
        raise CaptureUnavailable(f"captured CPU steps need inductor's C++ compiler: {reason}")
    return None if reason else "aoti"
