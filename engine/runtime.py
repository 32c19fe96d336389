"""Leaf utilities every layer may use: device synchronisation for honest timings, where caches live on disk, loading
an AOTInductor package without leaving its unpacked folder behind, and what the device rooms leave on a model or a
machine that the measurements read (oneDNN's bf16, a model's kernel router, and
forcing it onto one path while a measurement runs).

Imports nothing from engine, so anything (kernels, costs, models, the decoder) can import it without a circle.
"""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from unittest.mock import patch

import torch


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so perf_counter() around it measures the work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cache_dir() -> Path:
    """$TREEVIZ_CACHE or ~/.cache/treeviz: converted models are gigabytes and must never land in the repo."""
    root = os.environ.get("TREEVIZ_CACHE") or Path.home() / ".cache" / "treeviz"
    return Path(root).expanduser()


def model_device(model) -> torch.device:
    """The device a model computes on: its first parameter that is not a shapeless stand-in on `meta` (a builder
    process drops the weights a package never reads: engine/cpu/aoti.py `release_weights`)."""
    return next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))


_FORK_HOOK = []


def one_thread_in_forked_children() -> None:
    """Every child forked from this process afterwards runs torch's CPU ops on one thread. GNU OpenMP's thread pool
    does not survive a fork: a child forked after the parent ran parallel CPU work can hang in its first parallel op.
    ZeroGPU's workers are such children, and their work is on the GPU (so one CPU thread costs them nothing)."""
    if not _FORK_HOOK:
        os.register_at_fork(after_in_child=lambda: torch.set_num_threads(1))
        _FORK_HOOK.append(True)


def load_package(file: Path):
    """AOTInductor's runner of the package `file`, unpacked into a folder of our own that is removed once it is
    loaded: torch unpacks into a temporary folder it removes only when the runner is collected, which never happens
    in a process that exits or is killed with the runner alive (every start would leave gigabytes behind). The
    runner's library stays mapped; the space is returned when the process ends. Both devices' packages load here
    (engine/cpu/aoti.py, engine/cuda/aot.py)."""
    tempfile.gettempdir()  # fix Python's own temporary folder before TMPDIR points elsewhere for a moment
    with tempfile.TemporaryDirectory(prefix="treeviz-aot-") as folder, patch.dict(os.environ, {"TMPDIR": folder}):
        return torch._inductor.aoti_load_package(str(file))  # the C++ loader unpacks under $TMPDIR


def onednn_bf16() -> bool:
    """Whether oneDNN runs bf16 GEMMs here (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT, and honours a lowered
    ONEDNN_MAX_CPU_ISA): without them `mkldnn._reorder_linear_weight` refuses bf16."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def fused_projections(model) -> int:
    """How many parents' sibling projections the CPU room stacked into one linear in `model` (engine/cpu/fusion.py;
    0: none). Read here so that cache keys, reports and the builder's request see it without importing the room."""
    return getattr(model, "fused_projections", 0)


def router_of(model):
    """The kernel router a model's linears share, where the CPU room installed one (engine/cpu/kernels.py `Router`;
    None: its linears are torch's own). Read here so that the measurements read it without importing the room."""
    return getattr(model, "kernel_router", None)


@contextmanager
def forcing(model: nn.Module, path: str | None):
    """Every routed linear of `model` takes `path` inside the block (None: its routing); the previous setting comes
    back afterwards. Calibration times one path at a time this way."""
    router = router_of(model)
    before = router.forced if router is not None else None
    if router is not None:
        router.forced = path
    try:
        yield
    finally:
        if router is not None:
            router.forced = before
