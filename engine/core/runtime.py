"""Leaf utilities every layer may use: device synchronisation for honest timings, and where caches live on disk.

Imports nothing from engine, so anything (kernels, costs, models, the decoder) can import it without a circle.
"""
from __future__ import annotations

import os
from pathlib import Path

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
    process drops the weights a package never reads: engine/capture/aoti.py `release_weights`)."""
    return next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))


_FORK_HOOK = []


def one_thread_in_forked_children() -> None:
    """Every child forked from this process afterwards runs torch's CPU ops on one thread. GNU OpenMP's thread pool
    does not survive a fork: a child forked after the parent ran parallel CPU work can hang in its first parallel op.
    ZeroGPU's workers are such children, and their work is on the GPU (so one CPU thread costs them nothing)."""
    if not _FORK_HOOK:
        os.register_at_fork(after_in_child=lambda: torch.set_num_threads(1))
        _FORK_HOOK.append(True)
