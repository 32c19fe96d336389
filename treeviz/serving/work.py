"""The model work of each request, the GPU side: `decode_events` (Run), `compare_events` (Compare), `race_events`
(Race) and `sweep_events` (Sweep), each stepped event by event by its RunSession (treeviz/serving/session.py).

One shape for all four, the ZeroGPU contract: a module-level generator under `@boundary(duration=...)` taking
picklable arguments (a RunSpec, lists, the session's Ticket last) and yielding picklable events. The work is handed
the pair's name, never the pair, and reads the pair itself (`SERVER.loaded_pair`): on a Space each runs in a forked
worker that receives its arguments pickled, and the pair (gigabytes, placed on `cuda` at start) can only be inherited
by the fork, never sent; one path serves every device. So the work takes no lock, learns of Stop from
its ticket between iterations (every unobserved run too), reads the AR cached in the main process from its ticket and
sends what it measures back as ARMeasured (the session caches it there). `boundary` gives every error words that
survive the worker: the page's error type carrying its plain sentence.

What a request asks ZeroGPU for (`gpu_seconds`): START_S + MARGIN x the tokens it decodes x STEPS_PER_TOKEN one-row
target steps, the step from the shipped GPU table of the pair's shapes where the pair runs the forwards that table
measured (CUDA graphs), else DEFAULT_STEP_S (eager); spaces then multiplies the ask by its card's factor
(gpu.duration_factor). A request whose ask exceeds GPU_SECONDS_MAX is refused before it is scheduled, in words.

Every run is built by engine.recipe (`start_run`); no tensor math here.
"""
from __future__ import annotations

import logging
import math
import time
import traceback
from functools import wraps
from typing import Callable, Iterator

from engine.bench.sweep import run_sweep
from engine.core.trace import RunResult
from engine.measure.gpu_tables import find, shipped
from engine.recipe import AR, WARM_UP_TOKENS, RunSpec, start_run
from treeviz.serving.ar_cache import Baseline, attach_comparison
from treeviz.serving.errors import USER_FACING, UserError, friendly_error
from treeviz.serving.events import (ARMeasured, BaselineMeasured, Finished, Iteration, Progress, Raced, Swept,
                                    WorkEvent)
from treeviz.serving.gpu import GPU_SECONDS_MAX, duration_factor, gpu, page_error
from treeviz.serving.server import SERVER
from treeviz.serving.session import Cancelled, Ticket
from treeviz.serving.throttle import UpdateThrottle

log = logging.getLogger("treeviz")

START_S = 10.0          # a GPU call's start: fork, CUDA, the pair moved onto the GPU (the check's H100 child placed
                        # Pythia-2.8B/70M in 2.1 s and captured its graphs in 2.5 s; ZeroGPU's own transfer unmeasured)
STEPS_PER_TOKEN = 2.0   # one decoded token costs at most two one-row target steps: the slowest method measured on the
                        # H100 (docs/experiments/gpu-2026-11-26) ran at 0.76x AR, 1.32 steps a token
DEFAULT_STEP_S = 0.040  # an eager one-row target step where no table applies: Pythia-2.8B eager on the H100 measured
                        # 15-39 ms (docs/experiments/cuda.md); the slowest taken
MARGIN = 1.5            # on the decoding part: drift between calls was 2x on one VM, the ask must not run out


# -- the boundary ------------------------------------------------------------------------------------------------------

def boundary(duration: Callable[..., int]) -> Callable[[Callable], Callable]:
    """The work as a GPU call (`gpu.gpu`, spaces.GPU on ZeroGPU) whose errors keep their words across the worker:
    any exception but Cancelled becomes the page's error type carrying its plain sentence (the traceback logged
    here, in the worker, unless the error was written for the user); Cancelled ends the work early, and the session
    (which sees its own flag) ends the request as Stopped. Without a page errors pass unchanged (nothing crosses)."""
    def decorate(work: Callable[..., Iterator[WorkEvent]]) -> Callable[..., Iterator[WorkEvent]]:
        @wraps(work)
        def bounded(*args) -> Iterator[WorkEvent]:
            try:
                yield from work(*args)
            except Cancelled:
                return
            except Exception as err:  # noqa: BLE001 - every error reaches the page in words
                crossing = page_error(friendly_error(err))
                if crossing is None:
                    raise
                if not isinstance(err, USER_FACING):
                    log.warning("%s failed:\n%s", work.__name__, traceback.format_exc())
                raise crossing from err
        return gpu(duration)(bounded)
    return decorate


def step_seconds(pair_name: str) -> tuple[float, str]:
    """(seconds of one one-row target step on this GPU, where that figure comes from) for the loaded pair."""
    pair = SERVER.pairs.held(pair_name)
    if pair is not None and pair.graphs:
        table = find(shipped(), pair.target_name, pair.draft_name)
        if table is not None:
            return table.target_s[1], f"{table.label} ({table.file})"
    return DEFAULT_STEP_S, "the stated eager default"


def gpu_seconds(pair_name: str, tokens: int) -> int:
    """The GPU seconds to ask for a request that decodes `tokens` on `pair_name` (module docstring); UserError, in
    words, when the ask times spaces' factor would exceed GPU_SECONDS_MAX."""
    step, _ = step_seconds(pair_name)
    seconds = math.ceil(round(START_S + MARGIN * STEPS_PER_TOKEN * step * tokens, 6))  # no ceil of float noise
    asked = seconds * duration_factor()
    if asked > GPU_SECONDS_MAX:
        raise UserError(f"this request decodes {tokens} tokens, about {asked:.0f} s of GPU time; one request may ask "
                        f"for at most {GPU_SECONDS_MAX} s: lower max new tokens, or the number of methods, lanes or "
                        f"sizes")
    return seconds


# -- the work ------------------------------------------------------------------------------------------------------

def run_to_end(pair, spec: RunSpec, ticket: Ticket) -> RunResult:
    """`spec` decoded to its end, unobserved; Cancelled if the ticket's flag goes up between iterations."""
    return start_run(pair, spec).to_end(ticket.check)


def measured(key: tuple, result: RunResult) -> tuple[Baseline, ARMeasured]:
    """AR's `result`, measured just now: the Baseline to compare against and the event that caches it (session)."""
    baseline = Baseline(result, time.time())
    return baseline, ARMeasured(key, result, baseline.measured_at)


def run_seconds(spec: RunSpec, ticket: Ticket) -> int:
    ar = 0 if spec.strategy == AR or ticket.baseline is not None else spec.max_new_tokens
    return gpu_seconds(spec.pair, spec.max_new_tokens + ar)


@boundary(duration=run_seconds)
def decode_events(spec: RunSpec, ticket: Ticket) -> Iterator[WorkEvent]:
    """A Run: Iteration events while it decodes (as often as the throttle allows: treeviz/serving/throttle.py),
    Finished when it ends (AR beside it if cached), else BaselineMeasured once AR on the same prompt is measured (if
    cancelled meanwhile the run stays shown, without a baseline)."""
    pair = SERVER.loaded_pair(spec, "Run")
    run, throttle, shown = start_run(pair, spec), UpdateThrottle(), 0
    for _ in run:
        ticket.check()
        if throttle.due():
            started, snap = throttle.clock(), run.snapshot()  # only when shown: it re-decodes the text
            yield Iteration(snap, len(snap.iterations) - shown)
            shown = len(snap.iterations)
            throttle.sent(started)  # resumed: the update was built and sent meanwhile
    result, key = run.result, SERVER.ar_key(pair, spec)
    if spec.strategy == AR:  # an AR run is its own baseline, measured just now
        baseline, event = measured(key, result)
        yield event
    else:
        baseline = ticket.cached(key)
    if baseline is not None:
        attach_comparison(result, baseline)
        yield Finished(result, baseline.result)
        return
    yield Finished(result)
    baseline, event = measured(key, run_to_end(pair, spec.as_method(AR), ticket))
    yield event
    attach_comparison(result, baseline)
    yield BaselineMeasured(result, baseline.result)


def compare_seconds(spec: RunSpec, methods: list[str], ticket: Ticket) -> int:
    return gpu_seconds(spec.pair, (len(methods) + (ticket.baseline is None)) * spec.max_new_tokens)


@boundary(duration=compare_seconds)
def compare_events(spec: RunSpec, methods: list[str], ticket: Ticket) -> Iterator[WorkEvent]:
    """AR (handed over cached, else measured now, a Progress first) and each of `methods` on one prompt,
    unobserved: a Finished(result, ar) per method, AR first."""
    pair = SERVER.loaded_pair(spec, "Compare")
    key = SERVER.ar_key(pair, spec)
    baseline = ticket.cached(key)
    if baseline is None:
        yield Progress("measuring plain autoregressive decoding on the same prompt…")
        baseline, event = measured(key, run_to_end(pair, spec.as_method(AR), ticket))
        yield event
    ar = baseline.result
    attach_comparison(ar, baseline)
    yield Finished(ar, ar)
    for name in methods:
        yield Progress(f"running {name}…")
        result = run_to_end(pair, spec.as_method(name, spec.params if name == spec.strategy else {}), ticket)
        attach_comparison(result, baseline)
        yield Finished(result, ar)


def race_seconds(lanes: list[tuple[str, RunSpec]], ticket: Ticket) -> int:
    return gpu_seconds(lanes[0][1].pair, len(lanes) * (lanes[0][1].max_new_tokens + WARM_UP_TOKENS))


@boundary(duration=race_seconds)
def race_events(lanes: list[tuple[str, RunSpec]], ticket: Ticket) -> Iterator[WorkEvent]:
    """Every lane warmed up (a short run, discarded), then each decoded to its end, unobserved, one after the other;
    Raced with every lane compared with this request's AR (fresh, never from the cache; it goes into the cache).
    Without the warm-up the first lane, AR, would pay for the allocator's growth and kernel selection alone."""
    pair = SERVER.loaded_pair(lanes[0][1], "Race")
    yield Progress(f"race: warming up {len(lanes)} lanes (short runs, not timed)…")
    for _, spec in lanes:
        run_to_end(pair, spec.warm_up(), ticket)
    runs = []
    for k, (label, spec) in enumerate(lanes, start=1):
        yield Progress(f"race: decoding {label} unobserved ({k} of {len(lanes)})…")
        runs.append((label, run_to_end(pair, spec, ticket)))
    baseline, event = measured(SERVER.ar_key(pair, lanes[0][1]), runs[0][1])
    yield event
    for _, result in runs:
        attach_comparison(result, baseline)
    yield Raced(runs)


def sweep_seconds(spec: RunSpec, values: list[int], ticket: Ticket) -> int:
    return gpu_seconds(spec.pair, (len(values) + 1) * spec.max_new_tokens)


@boundary(duration=sweep_seconds)
def sweep_events(spec: RunSpec, values: list[int], ticket: Ticket) -> Iterator[WorkEvent]:
    """engine.bench.sweep's progress as Swept events (the ticket's flag as its cancel, checked between iterations)."""
    pair = SERVER.loaded_pair(spec, "Sweep")
    for progress in run_sweep(pair, spec, values, cancel=lambda: ticket.cancelled):
        if progress.get("cancelled"):
            raise Cancelled
        yield Swept(progress)
