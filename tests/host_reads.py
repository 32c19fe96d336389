"""Counting a decoding iteration's reads from tensors to the host: on a GPU each read waits for the device to drain.

A read is a tensor's value turned into Python (`tolist`, `item`, `bool`, `int`, `float`, `__index__`, `numpy`),
counted outside the models' own forwards (on a GPU those replay from a graph, where no Python runs). On a CPU the
same calls are made as on a GPU, so a CPU test counts what a GPU would wait for. One place reads tensors it made from
host lists itself, which never live on the device: the static steps' staging of host inputs (HOST_MADE).
"""
from __future__ import annotations

import sys
import warnings
from contextlib import contextmanager

import torch

READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy")
HOST_MADE = {("steps.py", "_staged")}  # (file, function) reading only tensors it built from host lists


def _host_made() -> bool:
    caller = sys._getframe(2).f_code  # the function that called the read
    return (caller.co_filename.rsplit("/", 1)[-1], caller.co_name) in HOST_MADE


@contextmanager
def counted_reads(models):
    """Yields a dict whose "reads" counts the reads made while the block runs, outside `models`' forwards."""
    state = {"reads": 0, "inside": 0}
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(original):
        def read(self, *args, **kwargs):
            if not state["inside"] and not _host_made():
                state["reads"] += 1
            return original(self, *args, **kwargs)
        return read

    def enter(*_):
        state["inside"] += 1

    def leave(*_):
        state["inside"] -= 1

    handles = [h for model in models for h in (model.register_forward_pre_hook(enter),
                                               model.register_forward_hook(leave))]
    for name, original in originals.items():
        setattr(torch.Tensor, name, counting(original))
    try:
        yield state
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        for handle in handles:
            handle.remove()


@contextmanager
def counted_syncs():
    """Yields a dict whose "reads" counts, once the block has run, the synchronisations CUDA's own sync debug mode
    warns of (every call that waits for the device)."""
    state = {"reads": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield state
        finally:
            torch.cuda.set_sync_debug_mode("default")
    state["reads"] = sum("synchroniz" in str(w.message) for w in caught)
