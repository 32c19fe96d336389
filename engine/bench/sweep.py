"""Trade-off curves: one strategy run at several values of its size knob (`Strategy.auto_param`, e.g. the node
budget), plus one AR run, on one prompt, every run through engine.recipe (the one run recipe).

Bigger trees accept more tokens per target pass (L̄ up) but cost more per iteration (draft forwards, verification
rows); tokens/s peaks somewhere between. Each point records the engine's metrics (engine.measure.metrics via RunResult)
and, when the pair has a measured cost table, the cost model's prediction of the same run's tokens/s, so measurement and
model sit side by side.
"""
from __future__ import annotations

import copy
import json
from collections import OrderedDict
from dataclasses import replace
from typing import Any, Callable, Iterator

from engine.recipe import AR, RunSpec, start_run
from engine.strategies import STRATEGIES, make_strategy

DEFAULT_POINTS = 6
MAX_POINTS = 12          # each point is a whole run: a longer sweep belongs in scripts/make_sweep.py
RANGE_OVER_PRESET = 4    # the default range reaches 4× the preset's own size
CACHE_SIZE = 16


def size_param(strategy: str):
    """The strategy's size knob as a Param; ValueError for an unknown strategy or one without a knob."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    cls = STRATEGIES[strategy]
    if cls.auto_param is None:
        raise ValueError(f"{strategy!r} has no size knob (Strategy.auto_param) to sweep; strategies with one: "
                         f"{', '.join(n for n, c in STRATEGIES.items() if c.auto_param)}")
    return next(p for p in cls.params if p.name == cls.auto_param)


def size_values(strategy: str, preset: str = "cpu", params: dict | None = None, lo: int | None = None,
                hi: int | None = None, points: int = DEFAULT_POINTS) -> list[int]:
    """Sizes to sweep, spaced evenly on a log scale (the curves bend at small sizes). Default range: the smallest
    size the strategy accepts with these params, up to RANGE_OVER_PRESET × the preset's size, within the knob's
    min/max."""
    param = size_param(strategy)
    if not 2 <= points <= MAX_POINTS:
        raise ValueError(f"a sweep takes 2 to {MAX_POINTS} points, got {points}")
    preset_size = STRATEGIES[strategy].preset_values(preset)[param.name]
    top = int(param.maximum or 1024)
    hi = int(hi if hi is not None else min(top, RANGE_OVER_PRESET * preset_size))
    lo = int(lo if lo is not None else _smallest_valid(strategy, preset, params or {}, param, hi))
    if lo < (param.minimum or 1) or hi > top:
        raise ValueError(f"{param.name} must stay within {param.minimum:g}..{top}, got {lo}..{hi}")
    if lo >= hi:
        raise ValueError(f"empty range: {param.name} from {lo} to {hi}")
    ratio = (hi / lo) ** (1 / (points - 1))
    values = sorted({round(lo * ratio ** k) for k in range(points)})
    for value in values:  # a size another parameter rules out (e.g. SALF's batch above N): refuse it up front
        make_strategy(strategy, preset, **{**(params or {}), param.name: value})
    return values


def _smallest_valid(strategy: str, preset: str, params: dict, param, hi: int) -> int:
    """The smallest size that, with the other params, makes a valid strategy (a cheap check: no model runs)."""
    for value in range(int(param.minimum or 1), hi + 1):
        try:
            make_strategy(strategy, preset, **{**params, param.name: value})
            return value
        except ValueError:
            continue
    raise ValueError(f"no {param.name} up to {hi} is valid for {strategy} with {params}")


# -- running ---------------------------------------------------------------------------------------------------------
_CACHE: OrderedDict[tuple, dict[str, Any]] = OrderedDict()


def cache_key(pair, spec: RunSpec, values: list[int]) -> tuple:
    """Same pair, prompt, strategy, settings, token budget, sampling and sizes: the same sweep."""
    return (spec.pair, pair.target_name, pair.draft_name, spec.prompt_key(), spec.strategy, spec.preset,
            json.dumps(spec.params, sort_keys=True), int(spec.max_new_tokens), json.dumps(spec.sampling().as_dict()),
            spec.verifier, tuple(values))


def run_sweep(pair, spec: RunSpec, values: list[int] | None = None, points: int = DEFAULT_POINTS,
              cancel: Callable[[], bool] | None = None) -> Iterator[dict[str, Any]]:
    """Yield progress after the AR run and after each size: {"done", "total", "sweep"} with the sweep so far; the
    last event has "complete": True (or "cancelled": True when `cancel()` turned true: the sweep stops between
    iterations and nothing is cached). A sweep already run in this process is yielded at once from the cache."""
    param = size_param(spec.strategy)
    values = list(values) if values is not None else size_values(spec.strategy, spec.preset, spec.params,
                                                                 points=points)
    key = cache_key(pair, spec, values)
    if key in _CACHE:
        _CACHE.move_to_end(key)
        yield {"done": len(values) + 1, "total": len(values) + 1, "sweep": copy.deepcopy(_CACHE[key]), "complete": True,
               "cached": True}
        return
    sweep = _empty_sweep(pair, spec, param, values)
    total = len(values) + 1
    runs = [(None, spec.as_method(AR))] + [(v, held_at(spec, param.name, v)) for v in values]
    for done, (value, run_spec) in enumerate(runs, start=1):
        result = _run(pair, run_spec, cancel)
        if result is None:
            yield {"done": done - 1, "total": total, "sweep": sweep, "cancelled": True}
            return
        if value is None:
            sweep["ar"] = point(result)
        else:
            sweep["points"].append({"size": value, **point(result)})
        yield {"done": done, "total": total, "sweep": sweep}
    sweep["peak"] = max(sweep["points"], key=lambda p: p["tokens_per_s"] or 0.0)["size"]
    _remember(key, sweep)
    yield {"done": total, "total": total, "sweep": sweep, "complete": True}


def held_at(spec: RunSpec, name: str, value: int) -> RunSpec:
    """`spec` with its size knob `name` at `value`, held there for the whole run. Under the "auto" preset the sizer
    would move the knob every iteration and every point would measure the sizer's choice, so the run takes the auto
    preset's starting values on the cpu preset: the same settings, no sizer."""
    if spec.preset != "auto":
        return replace(spec, params={**spec.params, name: value})
    start = STRATEGIES[spec.strategy].preset_values("auto")
    return replace(spec, preset="cpu", params={**start, **spec.params, name: value})


def _run(pair, spec: RunSpec, cancel: Callable[[], bool] | None):
    """The finished RunResult, or None if `cancel` turned true before or during the run."""
    run = start_run(pair, spec)
    for _ in run:
        if cancel is not None and cancel():
            return None
    return run.result


def _remember(key: tuple, sweep: dict[str, Any]) -> None:
    _CACHE[key] = copy.deepcopy(sweep)  # the caller keeps its own copy to change
    while len(_CACHE) > CACHE_SIZE:
        _CACHE.popitem(last=False)


def _empty_sweep(pair, spec: RunSpec, param, values: list[int]) -> dict[str, Any]:
    return {"pair": spec.pair, "target": pair.target_name, "draft": pair.draft_name,
            "prompt": spec.prompt, "strategy": spec.strategy, "preset": spec.preset, "params": dict(spec.params),
            "param": param.name, "param_label": param.label or param.name, "values": list(values),
            "max_new_tokens": int(spec.max_new_tokens), "sampling": spec.sampling().as_dict(),
            "has_costs": pair.costs is not None, "ar": None, "points": [], "peak": None}


def point(run) -> dict[str, Any]:
    """One run's numbers for the curves: the engine's metrics, and the cost model's prediction where it has one."""
    m = run.metrics
    return {"mean_tokens_per_iter": m.mean_tokens_per_iter, "acceptance_rate": m.acceptance_rate,
            "tokens_per_s": m.tokens_per_s, "predicted_tokens_per_s": predicted_tokens_per_s(run),
            "new_tokens": m.new_tokens, "total_s": m.total_s, "iterations": m.iterations}


def predicted_tokens_per_s(run) -> float | None:
    """Tokens/s as the cost table predicts the same run: every iteration's predicted draft + verify seconds
    (`IterationRecord.cost`, from PairCosts.predict) after the measured prefill (the table does not model it, and it
    is the same at every size). None when any iteration has no cost record (the pair has no cost table)."""
    its = run.iterations
    if not its or any(it.cost is None for it in its):
        return None
    seconds = float(run.metrics.ttft_s or 0.0) + sum(it.cost.predicted_s for it in its)
    return run.metrics.new_tokens / seconds if seconds > 0 else None
