"""Reading a measured ladder between its rungs: pure Python, so modules that only read tables (the app's GPU tables,
engine/measure/gpu_tables.py) need not import torch."""
from __future__ import annotations

import math


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
