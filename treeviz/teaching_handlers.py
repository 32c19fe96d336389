"""The Race and the Sweep: the Gradio handlers of the teaching tabs, on the skeleton of treeviz/handlers.py
(`in_session` around, `reported` inside a `gpu`-decorated generator, the pair's run lock held by `Backend.holding`).

The race decodes AR and each strategy UNOBSERVED (`Backend.iterate(stream=False)`: nothing is drawn while they run,
only a status line), back to back in one request, AR measured fresh (never taken from the AR cache), so its speedups
are the app's fair measurement; treeviz/race.py replays the runs from their measured timestamps. The sweep runs
engine.bench.sweep (one strategy at several sizes of its size knob, plus AR), the session's Stop flag as its cancel.

Race outputs: RACE_OUTPUTS (the runs as state, the race figure, a status line, the summary as JSON); Sweep outputs:
SWEEP_OUTPUTS (the sweep figure, a status line, the sweep as JSON). API callers read the last value.
"""
from __future__ import annotations

import html
from typing import Any, Iterator

import gradio as gr

from engine.bench.sweep import DEFAULT_POINTS, MAX_POINTS, run_sweep, size_param, size_values
from engine.session import AR, WARM_UP_TOKENS, RunSpec, check_spec
from engine.strategies import STRATEGIES
from treeviz.ar_cache import attach_comparison
from treeviz.errors import USER_FACING
from treeviz.gpu import GPU_SECONDS_MAX, gpu
from treeviz.handlers import in_session, loaded_pair, reported, spec_from_inputs, status_update
from treeviz.race import NOTE, race_figure, race_summary, seconds
from treeviz.runs import BACKEND, Status
from treeviz.sweep_figure import sweep_figure
from treeviz.views import outputs, status_html

RACE_OUTPUTS = ("race_runs", "race_plot", "status", "race_summary")
SWEEP_OUTPUTS = ("sweep_plot", "status", "sweep_summary")
DEFAULT_RACE = ("dynatree",)
FAIR = ("fair measurement: AR and every strategy decoded back to back in this request, on the same prompt and "
        "settings, unobserved (nothing drawn while they ran), AR measured fresh (not reused from the cache), every "
        "lane's forwards run the same way: on the pair's captured steps once they are ready (AR then takes the "
        "captured one-row step, AR at its fastest on this machine), eagerly before")
# A sweep is (points + 1) whole runs (AR once) of max_new_tokens each, and it holds the pair's run lock throughout:
# every other Run on the pair waits for it. The default pair writes about 15 tokens/s on the 2-core CPU this app is
# sized for, so 4096 tokens is about 4-5 minutes, the longest a page should hold the pair. Longer sweeps belong in
# scripts/make_sweep.py.
SWEEP_TOKEN_BUDGET = 4096


# -- the race --------------------------------------------------------------------------------------------------------
def race_lanes(spec: RunSpec, strategies: list[str] | None) -> list[tuple[str, RunSpec]]:
    """(label, spec) per lane, AR first: each ticked strategy ("name" or "name@preset", cpu preset by default) on
    `spec`'s prompt and settings; gr.Error with a plain message for an unknown or unusable one."""
    if isinstance(strategies, str):
        strategies = [strategies]
    names = list(dict.fromkeys(str(s).strip() for s in (strategies or []) if str(s).strip()))
    if not names:
        raise gr.Error("Tick at least one strategy to race against AR.")
    lanes = [("AR", spec.as_method(AR))]
    for name in names:
        base, _, preset = name.partition("@")
        if base not in STRATEGIES or base == AR:
            choices = ", ".join(s for s in STRATEGIES if s != AR)
            raise gr.Error(f"Unknown strategy {base!r} for the race; choose from {choices} (AR always races).")
        if preset and preset not in STRATEGIES[base].preset_names():
            raise gr.Error(f"{base} has no preset {preset!r}; presets: {', '.join(STRATEGIES[base].preset_names())}.")
        lane = spec.as_method(name)
        _checked(lane)
        lanes.append((name, lane))
    return lanes


def _checked(spec: RunSpec) -> None:
    try:
        check_spec(spec)
    except (ValueError, TypeError, *USER_FACING) as err:
        raise gr.Error(f"{spec.strategy}: {err}") from None


def race(prompt: str, chat: bool, pair: str, strategies: list[str], max_new_tokens: float, temperature: float,
         top_p: float, top_k: float, seed: float, verifier: str, request: gr.Request) -> Iterator[tuple]:
    """AR and each strategy decoded unobserved on the prompt, then the race figure and its summary."""
    spec = spec_from_inputs(prompt, chat, pair, AR, "cpu", max_new_tokens, temperature, top_p, top_k, seed,
                            verifier, {})
    lanes = race_lanes(spec, strategies)
    opening = outputs({"status": status_html(f"race: {len(lanes)} lanes on {spec.pair}, decoding unobserved…")},
                      RACE_OUTPUTS)
    yield from in_session(request, spec, RACE_OUTPUTS, opening, lambda session: race_views(lanes, session),
                          view="race")


def _race_seconds(lanes: list[tuple[str, RunSpec]], session: str) -> int:
    return min(GPU_SECONDS_MAX, 20 + len(lanes) * (lanes[0][1].max_new_tokens + WARM_UP_TOKENS) // 4)


@gpu(duration=_race_seconds)
def race_views(lanes: list[tuple[str, RunSpec]], session: str) -> Iterator[tuple]:
    """Status lines while the lanes decode, then the race (picklable values, like handlers.decode_views)."""
    yield from reported(_race_updates(lanes, session), RACE_OUTPUTS, "race")


def _race_updates(lanes: list[tuple[str, RunSpec]], session: str) -> Iterator[tuple]:
    cancel = BACKEND.cancel_of(session)
    pair = loaded_pair(lanes[0][1], "Race")
    for item in BACKEND.holding(cancel, _decode_lanes(pair, lanes, cancel)):
        if isinstance(item, Status):
            yield status_update(item.text, names=RACE_OUTPUTS)
            continue
        runs = item
        baseline = BACKEND.ar_cache.put(BACKEND.ar_key(pair, lanes[0][1]), runs[0][1])
        for _, result in runs:  # AR fresh from this request: every lane's comparison says "measured for this run"
            attach_comparison(result, baseline)
        summary = race_json(runs)
        yield outputs({"race_runs": runs, "race_plot": race_figure(runs), "status": race_status_html(summary),
                       "race_summary": summary}, RACE_OUTPUTS)
        return
    if not cancel.superseded:
        yield status_update("race stopped: nothing to show until every lane has finished", names=RACE_OUTPUTS)


def _decode_lanes(pair, lanes: list[tuple[str, RunSpec]], cancel) -> Iterator[Status | list]:
    """Every lane warmed up (a short run, discarded), then each decoded to its end, one after the other, nothing
    streamed; the list of (label, RunResult) last (nothing if cancelled). Without the warm-up the first lane, AR,
    would pay for the allocator's growth and kernel selection alone and read slow."""
    yield Status(f"race: warming up {len(lanes)} lanes (short runs, not timed)…")
    for _, spec in lanes:
        if (yield from BACKEND.iterate(pair, spec.warm_up(), cancel, stream=False)) is None:
            return
    runs = []
    for k, (label, spec) in enumerate(lanes, start=1):
        yield Status(f"race: decoding {label} unobserved ({k} of {len(lanes)})…")
        result = yield from BACKEND.iterate(pair, spec, cancel, stream=False)
        if result is None:
            return
        runs.append((label, result))
    yield runs


def race_json(runs: list[tuple[str, Any]]) -> dict[str, Any]:
    """treeviz.race's summary, with how it was measured and whether each lane wrote AR's text."""
    summary = race_summary(runs)
    for lane, (_, result) in zip(summary["lanes"], sorted(runs, key=lambda item: item[1].strategy != AR)):
        lane["matches_ar"] = bool((result.comparison or {}).get("exact_match"))
    return {**summary, "measurement": FAIR, "ar_reused": False, "max_new_tokens": runs[0][1].config.get(
        "max_new_tokens"), "pair": str(runs[0][1].config.get("target"))}


def race_status_html(summary: dict[str, Any]) -> str:
    """The race's headline: each strategy's speedup as AR's decode time over its own, the winner, how measured."""
    ar = summary["lanes"][0]
    parts = [f"<b>{html.escape(lane['label'])} {lane['speedup_vs_ar']:.2f}× AR</b> (AR {seconds(ar['decode_s'])} ÷ "
             f"{html.escape(lane['label'])} {seconds(lane['decode_s'])})"
             for lane in summary["lanes"][1:] if lane["speedup_vs_ar"] is not None]
    steps = f"; forwards: {ar['steps']}" if ar.get("steps") else ""
    return (f"<div class='tv-status' id='tv-race-headline'>Race speedup — {' · '.join(parts) or 'no speedup'} · "
            f"winner: <b>{html.escape(summary['winner'])}</b><br><span style='font-size:12px;color:#6b7280'>"
            f"{html.escape(FAIR)}{html.escape(steps)}; {html.escape(NOTE)}</span></div>")


# -- the sweep -------------------------------------------------------------------------------------------------------
def sweep_values(spec: RunSpec, size_min: Any, size_max: Any, points: Any) -> list[int]:
    """The sizes to sweep (blank min / max: engine.bench.sweep's default range); gr.Error for an unknown strategy, one
    without a size knob, an empty or out-of-range range, or a sweep too large for this machine."""
    try:
        size_param(spec.strategy)  # unknown strategy, or one without a size knob: its own plain message
        points = int(points if points is not None else 6)
        lo = None if size_min in (None, "") else int(size_min)
        hi = None if size_max in (None, "") else int(size_max)
        values = size_values(spec.strategy, spec.preset, spec.params, lo, hi, points)
    except (ValueError, TypeError, *USER_FACING) as err:
        raise gr.Error(f"Sweep: {err}") from None
    total = (len(values) + 1) * spec.max_new_tokens
    if total > SWEEP_TOKEN_BUDGET:
        raise gr.Error(f"Sweep too large for this machine: {len(values)} sizes + AR × {spec.max_new_tokens} tokens = "
                       f"{total} tokens; the limit is {SWEEP_TOKEN_BUDGET} (the sweep holds the model pair). Lower "
                       f"max new tokens or the number of points (2 to {MAX_POINTS}).")
    return values


def sweep(prompt: str, chat: bool, pair: str, strategy: str, preset: str, params: dict, max_new_tokens: float,
          size_min: float | None = None, size_max: float | None = None, points: float = DEFAULT_POINTS,
          temperature: float = 0.0, top_p: float = 1.0, top_k: float = 0, seed: float = 0, verifier: str = "auto",
          request: gr.Request = None) -> Iterator[tuple]:
    """The strategy at several sizes of its size knob, plus AR, on the prompt: the curves grow run by run. A blank
    size_min / size_max (None: optional in the API too) takes the strategy's own range."""
    spec = spec_from_inputs(prompt, chat, pair, strategy, preset, max_new_tokens, temperature, top_p, top_k, seed,
                            verifier, params)
    values = sweep_values(spec, size_min, size_max, points)
    opening = outputs({"status": status_html(f"sweep: {spec.strategy} at {values} and AR…", progress=0.0)},
                      SWEEP_OUTPUTS)
    yield from in_session(request, spec, SWEEP_OUTPUTS, opening, lambda session: sweep_views(spec, values, session),
                          view="sweep")


def _sweep_seconds(spec: RunSpec, values: list[int], session: str) -> int:
    return min(GPU_SECONDS_MAX, 20 + (len(values) + 1) * spec.max_new_tokens // 4)


@gpu(duration=_sweep_seconds)
def sweep_views(spec: RunSpec, values: list[int], session: str) -> Iterator[tuple]:
    yield from reported(_sweep_updates(spec, values, session), SWEEP_OUTPUTS, "sweep")


def _sweep_updates(spec: RunSpec, values: list[int], session: str) -> Iterator[tuple]:
    cancel = BACKEND.cancel_of(session)
    pair = loaded_pair(spec, "Sweep")
    last = None
    for item in BACKEND.holding(cancel, run_sweep(pair, spec, values, cancel=cancel.is_set)):
        if isinstance(item, Status):
            yield status_update(item.text, names=SWEEP_OUTPUTS)
            continue
        last = item
        yield outputs({"sweep_plot": sweep_figure(item["sweep"]), "status": sweep_status_html(item),
                       **({"sweep_summary": sweep_json(item)} if item.get("complete") else {})}, SWEEP_OUTPUTS)
    if last is None and not cancel.superseded:
        yield status_update("sweep stopped before its first run finished", names=SWEEP_OUTPUTS)


def sweep_status_html(event: dict[str, Any]) -> str:
    """Progress (runs done of the total) while it runs; the peak and its speedup once complete."""
    sweep, done, total = event["sweep"], event["done"], event["total"]
    if event.get("cancelled"):
        return status_html(f"sweep stopped after {done} of {total} runs (nothing cached)")
    if not event.get("complete"):
        return status_html(f"sweep: {done} of {total} runs done (AR, then {sweep['strategy']} at {sweep['param']} = "
                           f"{', '.join(map(str, sweep['values']))})", progress=done / total)
    best = next((p for p in sweep["points"] if p["size"] == sweep.get("peak")), None)
    ar = (sweep.get("ar") or {}).get("tokens_per_s")
    peak = ""
    if best and best.get("tokens_per_s"):
        peak = f": peak {best['tokens_per_s']:.1f} tokens/s at {sweep['param']} = {best['size']}"
        peak += f" ({best['tokens_per_s'] / ar:.2f}× AR, measured in this sweep)" if ar else ""
    cached = " (from this session's sweep cache)" if event.get("cached") else ""
    return status_html(f"sweep done: {total} runs{peak}{cached}")


def sweep_json(event: dict[str, Any]) -> dict[str, Any]:
    """The sweep as /sweep returns it: engine.bench.sweep's data, with whether it was complete or cached."""
    return {**event["sweep"], "complete": bool(event.get("complete")), "cached": bool(event.get("cached")),
            "runs": event["total"]}
