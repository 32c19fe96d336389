"""CUDA graphs of one StaticSteps' forwards, one per row-count bucket: the GPU's captured step.

    graphs = CudaGraphs(device)
    graphs.capture(b, run)          # `run()` is the bucket's eager forward on fixed tensors; returns (logits, hidden)
    logits, hidden = graphs.replay(b)

What a read of other runners (Sequoia, SGLang, vLLM) and of torch's own notes says goes wrong, and what is done here:
- cuBLAS keeps a workspace per handle and stream, allocated on first use: allocated during a capture it belongs to
  that graph's pool, and a pool whose graphs are all gone cannot be reused while a workspace still pins it (the
  capture then asserts `use_count > 0`). Workspaces are cleared before every capture, and a pool is only ever shared
  by graphs that live together (one pool per process, dropped when the last graph holding it is released).
- Warm-up calls run on the one side stream of the process (a new stream per capture would get a workspace each).
- Captures use `capture_error_mode="thread_local"`: another thread (the app's pair loader) allocating during a
  capture must not invalidate it.
- Replays return clones: the next replay of any graph in the shared pool may overwrite the outputs.
"""
from __future__ import annotations

import time
import weakref

import torch

WARMUP_CALLS = 2  # eager calls before a capture: first calls pick kernels and allocate workspaces
_SIDE: dict[int, torch.cuda.Stream] = {}  # device index -> the process's one side stream
_POOL: dict[int, tuple] = {}  # device index -> (pool handle, weak set of the CudaGraphs holding graphs in it)


def side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE:
        _SIDE[index] = torch.cuda.Stream(device)
    return _SIDE[index]


def shared_pool(device: torch.device, owner) -> tuple:
    """The pool every live graph on `device` draws from; a fresh handle once no CudaGraphs holds graphs in the old."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    pool, owners = _POOL.get(index, (None, None))
    if pool is None or not any(o.graphs for o in owners):
        pool, owners = torch.cuda.graph_pool_handle(), weakref.WeakSet()
        _POOL[index] = (pool, owners)
    owners.add(owner)
    return pool


def clear_workspaces() -> None:
    """Release cuBLAS workspaces so that none is allocated inside, and pins, a graph pool."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


class CudaGraphs:
    """One graph per bucket on a device, all drawing from the process's shared pool (or `pool` when given: a
    throwaway capture, such as a measurement, takes its own)."""

    def __init__(self, device: torch.device, pool=None):
        self.device = device
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.seconds: dict[int, float] = {}
        self._pool = pool

    def pool(self):
        return self._pool if self._pool is not None else shared_pool(self.device, self)

    def capture(self, bucket: int, run) -> None:
        """Capture `run()` (the bucket's forward on fixed tensors) after WARMUP_CALLS eager calls on the side stream."""
        start = time.perf_counter()
        torch.cuda.synchronize(self.device)
        clear_workspaces()
        side = side_stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_CALLS):
                run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        clear_workspaces()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool(), capture_error_mode="thread_local"):
            out = run()
        torch.cuda.synchronize(self.device)
        self.graphs[bucket] = (graph, out)
        self.seconds[bucket] = time.perf_counter() - start

    def replay(self, bucket: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        graph, (logits, hidden) = self.graphs[bucket]
        graph.replay()
        return logits[:n].clone(), hidden[:n].clone()

    def release(self) -> None:
        self.graphs.clear()
