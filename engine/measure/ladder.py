"""Climbing a ladder of row counts and reading it between its rungs: pure Python, so modules that only read tables
(the app's GPU tables, engine/measure/gpu_tables.py) need not import torch."""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable

CLIMB_LIMIT = 2.0  # a path this many times the best at a rung stops climbing the ladder


def climb(paths: Iterable[str], ladder, sample: Callable[[str, int], float], repeats: int,
          at_rung: Callable[[int, list[str]], None] | None = None) -> dict[str, dict[int, float]]:
    """Seconds per path and rung: the fastest of `repeats` calls of `sample(path, rows)`, paths interleaved within
    each repeat (drift hits every path alike; interference only ever adds time, so the minimum is kept). A path
    CLIMB_LIMIT times the best at a rung is not measured further up: infinity there (not competitive, never
    guessed). `at_rung(rows, live paths)` runs before each rung's samples (inputs, warm-up)."""
    live, seconds = list(paths), {p: {} for p in paths}
    for rows in ladder:
        if at_rung is not None:
            at_rung(rows, live)
        samples = {p: [] for p in live}
        for _ in range(repeats):
            for path in live:
                samples[path].append(sample(path, rows))
        for path in live:
            seconds[path][rows] = min(samples[path])
        best = min(seconds[p][rows] for p in live)
        live = [p for p in live if seconds[p][rows] < CLIMB_LIMIT * best]
    for table in seconds.values():
        table.update({r: math.inf for r in ladder if r not in table})
    return seconds


def interpolate(points: dict[int, float], rows: int) -> float:
    """Seconds at `rows` from measured rungs: linear between rungs, linear extrapolation past the last two; infinity
    wherever an unmeasured (not competitive) rung is involved."""
    xs = sorted(points)
    if rows <= xs[0]:
        return points[xs[0]]
    for lo, hi in zip(xs, xs[1:]):
        if rows <= hi:
            if rows == hi or math.isinf(points[lo]) or math.isinf(points[hi]):
                return points[hi] if rows == hi or math.isinf(points[hi]) else math.inf
            return points[lo] + (points[hi] - points[lo]) * (rows - lo) / (hi - lo)
    lo, hi = xs[-2], xs[-1]
    if math.isinf(points[hi]):
        return math.inf
    return points[hi] + max(points[hi] - points[lo], 0.0) * (rows - hi) / (hi - lo)
