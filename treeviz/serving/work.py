"""The model work of each request, the GPU side: `decode_events` (Run), `compare_events` (Compare), `race_events`
(Race) and `sweep_events` (Sweep), each stepped event by event by its RunSession (treeviz/serving/session.py).

One shape for all four, the ZeroGPU contract: a module-level generator under `@gpu(duration=...)` taking picklable
arguments (a RunSpec, lists, the session's key last) and yielding picklable events. On a Space each runs in a forked
worker where its session is a copy Stop cannot reach, so the session checks its flag between events too. Each opens
with `claim` (the session and the loaded pair), stops by `session.check()` / `run_to_end` raising Cancelled (the
session turns it into one Stopped) and asks for its GPU slot by `gpu_seconds` of the tokens it decodes.

Every run is built by engine.recipe (`start_run`); no tensor math here.
"""
from __future__ import annotations

from typing import Any, Iterator

from engine.bench.sweep import run_sweep
from engine.core.trace import RunResult
from engine.recipe import AR, WARM_UP_TOKENS, RunSpec, start_run
from treeviz.serving.ar_cache import Baseline, attach_comparison
from treeviz.serving.events import BaselineMeasured, Event, Finished, Iteration, Progress, Raced, Swept
from treeviz.serving.gpu import GPU_SECONDS_MAX, gpu
from treeviz.serving.server import SERVER
from treeviz.serving.session import Cancelled, RunSession
from treeviz.serving.throttle import UpdateThrottle


def claim(key: str, spec: RunSpec, button: str) -> tuple[RunSession, Any]:
    """The session `key` and the loaded pair for `spec` (UserError naming `button` if it is not loaded)."""
    return SERVER.session_of(key), SERVER.loaded_pair(spec, button)


def run_to_end(pair, spec: RunSpec, session: RunSession) -> RunResult:
    """`spec` decoded to its end, unobserved; Cancelled if the session's flag goes up between iterations."""
    run = start_run(pair, spec)
    for _ in run:
        session.check()
    return run.result


def measure_ar(pair, spec: RunSpec, session: RunSession, key: tuple) -> Baseline:
    """AR on `spec`'s prompt and settings, measured now and cached under `key` (SERVER.ar_key)."""
    return SERVER.ar_cache.put(key, run_to_end(pair, spec.as_method(AR), session))


def gpu_seconds(tokens: int) -> int:
    """The GPU slot to ask ZeroGPU for a request that decodes `tokens` in all: generous per token, capped (longer
    asks wait longer in its queue)."""
    return min(GPU_SECONDS_MAX, 20 + tokens // 4)


def run_seconds(spec: RunSpec, key: str) -> int:
    return gpu_seconds(spec.max_new_tokens)


@gpu(duration=run_seconds)
def decode_events(spec: RunSpec, key: str) -> Iterator[Event]:
    """A Run: Iteration events while it decodes (as often as the throttle allows: treeviz/serving/throttle.py),
    Finished when it ends (AR beside it if cached), else BaselineMeasured once AR on the same prompt is measured (if
    cancelled meanwhile the run stays shown, without a baseline)."""
    session, pair = claim(key, spec, "Run")
    run, throttle, shown = start_run(pair, spec), UpdateThrottle(), 0
    for _ in run:
        session.check()
        if throttle.due():
            started, snap = throttle.clock(), run.snapshot()  # only when shown: it re-decodes the text
            yield Iteration(snap, len(snap.iterations) - shown)
            shown = len(snap.iterations)
            throttle.sent(started)  # resumed: the update was built and sent meanwhile
    result, ar_key = run.result, SERVER.ar_key(pair, spec)
    measured = SERVER.ar_cache.put(ar_key, result) if spec.strategy == AR else SERVER.ar_cache.baseline(ar_key)
    if measured is not None:  # an AR run is its own baseline, measured just now
        attach_comparison(result, measured)
        yield Finished(result, measured.result)
        return
    yield Finished(result)
    measured = measure_ar(pair, spec, session, ar_key)
    attach_comparison(result, measured)
    yield BaselineMeasured(result, measured.result)


def compare_seconds(spec: RunSpec, methods: list[str], key: str) -> int:
    return gpu_seconds((1 + len(methods)) * spec.max_new_tokens)


@gpu(duration=compare_seconds)
def compare_events(spec: RunSpec, methods: list[str], key: str) -> Iterator[Event]:
    """AR (from the cache, else measured now, a Progress first) and each of `methods` on one prompt, unobserved: a
    Finished(result, ar) per method, AR first."""
    session, pair = claim(key, spec, "Compare")
    ar_key = SERVER.ar_key(pair, spec)
    measured = SERVER.ar_cache.baseline(ar_key)
    if measured is None:
        yield Progress("measuring plain autoregressive decoding on the same prompt…")
        measured = measure_ar(pair, spec, session, ar_key)
    ar = measured.result
    attach_comparison(ar, measured)
    yield Finished(ar, ar)
    for name in methods:
        yield Progress(f"running {name}…")
        result = run_to_end(pair, spec.as_method(name, spec.params if name == spec.strategy else {}), session)
        attach_comparison(result, measured)
        yield Finished(result, ar)


def race_seconds(lanes: list[tuple[str, RunSpec]], key: str) -> int:
    return gpu_seconds(len(lanes) * (lanes[0][1].max_new_tokens + WARM_UP_TOKENS))


@gpu(duration=race_seconds)
def race_events(lanes: list[tuple[str, RunSpec]], key: str) -> Iterator[Event]:
    """Every lane warmed up (a short run, discarded), then each decoded to its end, unobserved, one after the other;
    Raced with every lane compared with this request's AR (fresh, never from the cache). Without the warm-up the
    first lane, AR, would pay for the allocator's growth and kernel selection alone and read slow."""
    session, pair = claim(key, lanes[0][1], "Race")
    yield Progress(f"race: warming up {len(lanes)} lanes (short runs, not timed)…")
    for _, spec in lanes:
        run_to_end(pair, spec.warm_up(), session)
    runs = []
    for k, (label, spec) in enumerate(lanes, start=1):
        yield Progress(f"race: decoding {label} unobserved ({k} of {len(lanes)})…")
        runs.append((label, run_to_end(pair, spec, session)))
    measured = SERVER.ar_cache.put(SERVER.ar_key(pair, lanes[0][1]), runs[0][1])
    for _, result in runs:
        attach_comparison(result, measured)
    yield Raced(runs)


def sweep_seconds(spec: RunSpec, values: list[int], key: str) -> int:
    return gpu_seconds((len(values) + 1) * spec.max_new_tokens)


@gpu(duration=sweep_seconds)
def sweep_events(spec: RunSpec, values: list[int], key: str) -> Iterator[Event]:
    """engine.bench.sweep's progress as Swept events (the session's flag as its cancel)."""
    session, pair = claim(key, spec, "Sweep")
    for progress in run_sweep(pair, spec, values, cancel=lambda: session.cancelled):
        if progress.get("cancelled"):
            raise Cancelled
        yield Swept(progress)
