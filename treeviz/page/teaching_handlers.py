"""The Race and the Sweep: the Gradio handlers of the teaching tabs. Like Run and Compare (treeviz/page/handlers.py),
each opens a RunSession for its view and turns its typed events into updates in one place.

The race decodes AR and each strategy UNOBSERVED (work.race_events: nothing is drawn while they run, only a status
line), back to back in one request, AR measured fresh (never taken from the AR cache), so its speedups are the app's
fair measurement; treeviz/figures/race.py replays the runs from their measured timestamps. The sweep runs
engine.bench.sweep (one strategy at several sizes of its size knob, plus AR; work.sweep_events), the session's flag as
its cancel.

Race outputs: RACE_OUTPUTS (the runs as state, the race figure, a status line, the summary as JSON); Sweep outputs:
SWEEP_OUTPUTS (the sweep figure, a status line, the sweep as JSON). API callers read the last value.
"""
from __future__ import annotations

import html
from typing import Any, Iterator

import gradio as gr

from engine.bench.sweep import DEFAULT_POINTS, MAX_POINTS, size_param, size_values
from engine.recipe import AR, RunSpec, check_spec
from engine.strategies import STRATEGIES
from treeviz.figures.race import NOTE, race_figure, race_summary, seconds
from treeviz.figures.sweep_figure import sweep_figure
from treeviz.page.handlers import browser_of, ending, spec_from_inputs, status_update
from treeviz.page.views import outputs, status_html
from treeviz.serving.errors import USER_FACING
from treeviz.serving.events import Event, Failed, Progress, Raced, Started, Stopped, Swept
from treeviz.serving.server import SERVER
from treeviz.serving.work import race_events, sweep_events

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
    """(label, spec) per lane, AR first: each ticked strategy ("name" or "name@preset", auto preset by default) on
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
    spec = spec_from_inputs(prompt, chat, pair, AR, "auto", max_new_tokens, temperature, top_p, top_k, seed,
                            verifier, {})
    lanes = race_lanes(spec, strategies)
    session = SERVER.open(browser_of(request), "race")
    opening = f"race: {len(lanes)} lanes on {spec.pair}, decoding unobserved…"
    for event in session.events(opening, spec.pair, race_events, lanes):
        yield race_update(event)


def race_update(event: Event) -> tuple:
    """One race event as RACE_OUTPUTS: status lines while the lanes decode, then the race."""
    match event:
        case Started(text) | Progress(text, _):
            return status_update(text, names=RACE_OUTPUTS)
        case Raced(runs):
            summary = race_json(runs)
            return outputs({"race_runs": runs, "race_plot": race_figure(runs), "status": race_status_html(summary),
                            "race_summary": summary}, RACE_OUTPUTS)
        case Stopped() | Failed():
            return ending(event, RACE_OUTPUTS, "race stopped: nothing to show until every lane has finished")
    raise TypeError(f"not a race event: {event!r}")


def race_json(runs: list[tuple[str, Any]]) -> dict[str, Any]:
    """treeviz.figures.race's summary, with how it was measured and whether each lane wrote AR's text."""
    summary = race_summary(runs)
    for lane, (_, result) in zip(summary["lanes"], sorted(runs, key=lambda item: item[1].strategy != AR)):
        lane["matches_ar"] = bool(result.comparison is not None and result.comparison.exact_match)
    return {**summary, "measurement": FAIR, "ar_reused": False, "max_new_tokens": runs[0][1].config.max_new_tokens,
            "pair": str(runs[0][1].config.target)}


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
    session = SERVER.open(browser_of(request), "sweep")
    for event in session.events(f"sweep: {spec.strategy} at {values} and AR…", spec.pair, sweep_events, spec, values):
        yield sweep_update(event)


def sweep_update(event: Event) -> tuple:
    """One sweep event as SWEEP_OUTPUTS: the curves so far after every run, the sweep as JSON once complete."""
    match event:
        case Started(text):
            return status_update(text, names=SWEEP_OUTPUTS, progress=0.0)
        case Progress(text, fraction):
            return status_update(text, names=SWEEP_OUTPUTS, progress=fraction)
        case Swept(progress):
            return outputs({"sweep_plot": sweep_figure(progress["sweep"]), "status": sweep_status_html(progress),
                            **({"sweep_summary": sweep_json(progress)} if progress.get("complete") else {})},
                           SWEEP_OUTPUTS)
        case Stopped() | Failed():
            return ending(event, SWEEP_OUTPUTS, "sweep stopped (a stopped sweep is not cached)")
    raise TypeError(f"not a sweep event: {event!r}")


def sweep_status_html(event: dict[str, Any]) -> str:
    """Progress (runs done of the total) while it runs; the peak and its speedup once complete."""
    sweep, done, total = event["sweep"], event["done"], event["total"]
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
