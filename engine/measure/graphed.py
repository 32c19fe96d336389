"""Timing forwards through the engine's static steps, rung by rung: a GPU's cost table graphed, and the sweep that
CPU packages are timed with (engine/cpu/packages.py).

A GPU's eager forwards cost what the host takes to launch them, which a run on CUDA graphs never pays; so a GPU's
table is measured here, one CUDA graph per rung, where engine/measure/costs.py `measure` times a CPU's kernel paths
eagerly. On a CPU the same static steps run eagerly: what the tests check (tests/test_gpu_path.py).
"""
from __future__ import annotations

import time

import torch

from engine.core.steps import LADDER, StaticSteps, graph_capacity
from engine.measure.costs import PREFIX, REPEATS, probe_ids
from engine.runtime import synchronize


def time_rungs(steps, ids: list[int], prefix: int, rungs, repeats: int) -> dict[int, float]:
    """Seconds of a forward of each rung's row count through `steps` after a `prefix`-token prefill, synchronised,
    the cache rolled back after each; fastest of `repeats` whole sweeps after one warm-up sweep."""
    samples: dict[int, list[float]] = {r: [] for r in rungs}
    with torch.inference_mode():
        steps.prefill(ids[:prefix])
        for sweep in range(repeats + 1):
            for rows in rungs:
                synchronize(steps.device)
                start = time.perf_counter()
                steps.forward(ids[prefix:prefix + rows], list(range(prefix, prefix + rows)))
                synchronize(steps.device)
                if sweep:
                    samples[rows].append(time.perf_counter() - start)
                steps.keep(prefix, [])
    return {r: min(v) for r, v in samples.items()}


def measure_graphed(model, paths: list[str], ladder=None, prefix: int | None = None, repeats: int | None = None
                    ) -> dict[str, dict[int, float]]:
    """costs.measure's table through the engine's static steps with one CUDA graph per rung, on a cache as long as a
    run at `prefix` tokens would get (steps.graph_capacity), its own graph pool (a throwaway capture must not pin the
    shared one); each rung's forward timed from its inputs' copy to its logits, synchronised; fastest of `repeats`
    whole sweeps after one warm-up sweep. One path ("plain": a GPU has no kernel routing); `paths` is accepted for
    measure's signature. (On a CPU the same static steps run eagerly: what the tests check.)"""
    ladder, prefix, repeats = ladder or LADDER, prefix or PREFIX, repeats or REPEATS
    ids = probe_ids(model, prefix + max(ladder)).tolist()
    graphs = next(model.parameters()).device.type == "cuda"
    pool = torch.cuda.graph_pool_handle() if graphs else None
    steps = StaticSteps(model, graph_capacity(prefix + max(ladder)), tuple(ladder), graphs=graphs, pool=pool)
    try:
        return {"plain": time_rungs(steps, ids, prefix, ladder, repeats)}
    finally:
        if steps.graphs is not None:
            steps.graphs.release()
