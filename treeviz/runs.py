"""Runs on the loaded pair: one `RunSession` per request, which emits typed events; the handlers turn the events into
component updates (treeviz/handlers.py, treeviz/teaching_handlers.py).

A session owns what its request shares with the rest of the app: the cancel flag (Stop, and a newer request of the
same view, raise it: the one way a run is stopped), the wait for the model pair, the pair's run lock and the app's one
compute thread. The model work is in the `gpu`-decorated generators at the bottom (`decode_events`, `compare_events`,
`race_events`, `sweep_events`): on a ZeroGPU Space each runs in a forked worker, so they take picklable arguments (a
RunSpec, the session's key) and yield picklable events; their session there is a copy that Stop cannot reach, so the
session also checks its flag between events and closes the work (which ends the worker's task).

Every run is built by engine.session (`start_run`); no tensor math here.
"""
from __future__ import annotations

import logging
import threading
import traceback
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import gradio as gr

from engine.bench.sweep import run_sweep
from engine.core.trace import RunResult
from engine.session import AR, WARM_UP_TOKENS, RunSpec, start_run
from treeviz.ar_cache import ARCache, Baseline, attach_comparison
from treeviz.compute_thread import COMPUTE
from treeviz.errors import USER_FACING, UserError, friendly_error
from treeviz.gpu import GPU_SECONDS_MAX, gpu, is_zero_gpu_error, zero_gpu_message
from treeviz.pairs import PairManager
from treeviz.throttle import UpdateThrottle

log = logging.getLogger("treeviz")
_END = object()  # next()'s default: the work is exhausted


# -- what a session emits ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Started:
    text: str                          # what the request is about to do


@dataclass(frozen=True)
class Progress:
    text: str                          # waiting for the models or the pair, measuring AR, the next compared method
    fraction: float | None = None      # of the model load, when known


@dataclass(frozen=True)
class Iteration:
    """The run so far (a snapshot) while it decodes, `batched` iterations after the previous Iteration event."""
    run: RunResult
    batched: int


@dataclass(frozen=True)
class Finished:
    """One run ended, every iteration in `result`: a Run's (with AR beside it when AR was cached, else None until
    BaselineMeasured), or a compared method's (the first is AR itself: `result is ar`)."""
    result: RunResult
    ar: RunResult | None = None


@dataclass(frozen=True)
class BaselineMeasured:
    """AR on the same prompt was measured after the Run's Finished: `result` now carries its comparison."""
    result: RunResult
    ar: RunResult


@dataclass(frozen=True)
class Raced:
    runs: list                         # [(label, RunResult)], AR first, each compared with this request's AR


@dataclass(frozen=True)
class Swept:
    progress: dict                     # engine.bench.sweep's event: {"done", "total", "sweep", "complete"?, ...}


@dataclass(frozen=True)
class Stopped:
    superseded: bool                   # a newer request of the same view took over: its events own the views


@dataclass(frozen=True)
class Failed:
    message: str                       # one plain sentence; the traceback went to the log


Event = Started | Progress | Iteration | Finished | BaselineMeasured | Raced | Swept | Stopped | Failed


# -- the session -------------------------------------------------------------------------------------------------------
class RunSession:
    """One request of one browser session for one view ("run": Run and Compare, which share the main views; "race";
    "sweep"). `events` is the whole request as typed events, from Started to its last event."""

    def __init__(self, backend: "Backend", key: str):
        self.backend, self.key = backend, key
        self._cancel = threading.Event()
        self.superseded = False        # cancelled because a newer request of the same view began

    def cancel(self, superseded: bool = False) -> None:
        self.superseded = self.superseded or superseded
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def events(self, opening: str, pair_name: str, work: Callable[..., Iterator[Event]], *args: Any) -> Iterator[Event]:
        """Started, the wait for the pair (Progress, on this side of the GPU boundary), then `work(*args, key)`'s
        events, each produced on the compute thread under the pair's run lock, until the work ends (its last event is
        Stopped if it saw the flag itself) or the flag is seen here first: then Stopped, and the work is closed on the
        compute thread (a ZeroGPU worker's task ends with it). Failed on an error. The lock and the session are let
        go when the work ends or the consumer closes this generator."""
        try:
            yield Started(opening)
            yield from self._wait_for_pair(pair_name)
            if self.cancelled or not (yield from self._wait_for_lock()):
                yield Stopped(self.superseded)
                return
            steps = None
            try:
                steps = work(*args, self.key)
                while not self.cancelled:
                    event = COMPUTE.call(next, steps, _END)
                    if event is _END:
                        return
                    yield event
                    if isinstance(event, Stopped):
                        return
                yield Stopped(self.superseded)
            finally:
                if steps is not None:
                    COMPUTE.call(steps.close)
                self.backend.pairs.run_lock.release()
        except Exception as err:  # noqa: BLE001 - every error becomes one plain line, the traceback goes to the log
            yield Failed(self._message(err))
        finally:
            self.backend.close(self)

    def _wait_for_pair(self, name: str) -> Iterator[Progress]:
        """Loading progress until the pair is ready; UserError if it fails to load."""
        self.backend.pairs.request(name)
        told = -1.0
        while self.backend.pairs.ready(name) is None and not self.cancelled:  # ready() waits up to 0.25 s
            fraction, message = self.backend.pairs.status().progress
            if fraction != told:
                told = fraction
                yield Progress(f"waiting for the models: {message}", fraction)

    def _wait_for_lock(self) -> Iterator[Progress]:
        """Take the pair's run lock (one Progress while another run holds it); returns whether it was taken (False:
        the flag was raised first)."""
        told = False
        while not self.backend.pairs.run_lock.acquire(timeout=0.2):
            if self.cancelled:
                return False
            if not told:
                told = True
                yield Progress("waiting for another run on this model pair to finish…")
        return True

    @staticmethod
    def _message(err: Exception) -> str:
        if is_zero_gpu_error(err):
            return zero_gpu_message(err)
        if isinstance(err, gr.Error):
            return str(err.message)
        if not isinstance(err, USER_FACING):
            log.warning("run failed:\n%s", traceback.format_exc())
        return friendly_error(err)


@dataclass
class PageState:
    """What a browser session's page shows that a run's last event must respect, written by the page's own handlers:
    the iteration the user scrubbed to and the node inspected once the run had finished (None: the last iteration,
    the default node) and the entropy switch."""
    shown: int | None = None
    node: int | None = None
    entropy: bool = False


class Backend:
    """The pair, the AR cache, the running sessions (one per browser session and view) and each page's state."""

    MAX_PAGES = 1024

    def __init__(self):
        self.pairs = PairManager()
        self.ar_cache = ARCache()
        self._sessions: dict[str, RunSession] = {}
        self._pages: OrderedDict[str, PageState] = OrderedDict()
        self._lock = threading.Lock()

    def open(self, browser: str, view: str) -> RunSession:
        """A new session for `view`, superseding (cancelling) the older one of that browser session and view."""
        session = RunSession(self, f"{browser}/{view}")
        with self._lock:
            old = self._sessions.get(session.key)
            self._sessions[session.key] = session
        if old is not None:
            old.cancel(superseded=True)
        return session

    def session_of(self, key: str) -> RunSession:
        """The running session `key`; an unregistered one (nothing can stop it) if none runs, as in a ZeroGPU worker
        forked before the request began."""
        with self._lock:
            return self._sessions.get(key) or RunSession(self, key)

    def running(self, browser: str) -> list[str]:
        """The views this browser session is running now (busy state as data)."""
        return list(self._live(browser))

    def stop(self, browser: str) -> list[str]:
        """Cancel every running session of `browser`; the views it stopped (none: nothing was running)."""
        live = self._live(browser)
        for session in live.values():
            session.cancel()
        return list(live)

    def _live(self, browser: str) -> dict[str, RunSession]:
        """`browser`'s sessions not cancelled, by view."""
        with self._lock:
            return {key.partition("/")[2]: s for key, s in self._sessions.items()
                    if key.partition("/")[0] == browser and not s.cancelled}

    def close(self, session: RunSession) -> None:
        with self._lock:
            if self._sessions.get(session.key) is session:
                del self._sessions[session.key]

    def page(self, browser: str) -> PageState:
        with self._lock:
            state = self._pages.pop(browser, None) or PageState()
            self._pages[browser] = state
            while len(self._pages) > self.MAX_PAGES:
                self._pages.popitem(last=False)
            return state

    def loaded_pair(self, spec: RunSpec, button: str):
        pair = self.pairs.ready(spec.pair, timeout=0)
        if pair is None:
            raise UserError(f"the model pair is not loaded yet: press {button} again")
        return pair

    def ar_key(self, pair, spec: RunSpec) -> tuple:
        steps = pair.describe_capture() if pair.capture_ready and spec.capture != "off" else "eager"
        return ARCache.key(self.pairs.loaded_name, pair.dtype, spec, steps)


BACKEND = Backend()  # one per process: the handlers (and tests) reach it as this module global, never as an argument


# -- the model work (GPU side) -----------------------------------------------------------------------------------------
def run_to_end(pair, spec: RunSpec, session: RunSession) -> RunResult | None:
    """`spec` decoded to its end, unobserved; None if the session was cancelled between iterations."""
    run = start_run(pair, spec)
    for _ in run:
        if session.cancelled:
            return None
    return run.result


def measure_ar(pair, spec: RunSpec, session: RunSession, key: tuple) -> Baseline | None:
    """AR on `spec`'s prompt and settings, measured now and cached under `key` (BACKEND.ar_key); None if
    cancelled while measuring."""
    result = run_to_end(pair, spec.as_method(AR), session)
    return None if result is None else BACKEND.ar_cache.put(key, result)


def baseline(pair, spec: RunSpec, session: RunSession) -> Iterator[Progress]:
    """AR on `spec`'s prompt and settings: from the cache, else measured now (a Progress first); returns a Baseline,
    or None if cancelled while measuring."""
    key = BACKEND.ar_key(pair, spec)
    cached = BACKEND.ar_cache.baseline(key)
    if cached is not None:
        return cached
    yield Progress("measuring plain autoregressive decoding on the same prompt…")
    return measure_ar(pair, spec, session, key)


def _run_seconds(spec: RunSpec, key: str) -> int:
    """The GPU slot to ask ZeroGPU for: generous per token, capped (longer asks wait longer in its queue)."""
    return min(GPU_SECONDS_MAX, 20 + spec.max_new_tokens // 4)


@gpu(duration=_run_seconds)
def decode_events(spec: RunSpec, key: str) -> Iterator[Event]:
    """A Run: Iteration events while it decodes (as often as the throttle allows: treeviz/throttle.py), Finished
    when it ends (AR beside it if cached), else BaselineMeasured once AR on the same prompt is measured."""
    session, pair = BACKEND.session_of(key), BACKEND.loaded_pair(spec, "Run")
    run, throttle, shown = start_run(pair, spec), UpdateThrottle(), 0
    for _ in run:
        if session.cancelled:
            yield Stopped(session.superseded)
            return
        if throttle.due():
            started, snap = throttle.clock(), run.snapshot()  # only when shown: it re-decodes the text
            yield Iteration(snap, len(snap.iterations) - shown)
            shown = len(snap.iterations)
            throttle.sent(started)  # resumed: the update was built and sent meanwhile
    result, ar_key = run.result, BACKEND.ar_key(pair, spec)
    measured = BACKEND.ar_cache.put(ar_key, result) if spec.strategy == AR else BACKEND.ar_cache.baseline(ar_key)
    if measured is not None:  # an AR run is its own baseline, measured just now
        attach_comparison(result, measured)
        yield Finished(result, measured.result)
        return
    yield Finished(result)
    measured = measure_ar(pair, spec, session, ar_key)
    if measured is None:  # the run stays shown, without a baseline
        yield Stopped(session.superseded)
        return
    attach_comparison(result, measured)
    yield BaselineMeasured(result, measured.result)


def _compare_seconds(spec: RunSpec, methods: list[str], key: str) -> int:
    return min(GPU_SECONDS_MAX, 20 + (1 + len(methods)) * spec.max_new_tokens // 4)


@gpu(duration=_compare_seconds)
def compare_events(spec: RunSpec, methods: list[str], key: str) -> Iterator[Event]:
    """AR and each of `methods` on one prompt, unobserved: a Finished(result, ar) per method, AR first."""
    session, pair = BACKEND.session_of(key), BACKEND.loaded_pair(spec, "Compare")
    measured: Baseline | None = yield from baseline(pair, spec, session)
    if measured is None:
        yield Stopped(session.superseded)
        return
    ar = measured.result
    attach_comparison(ar, measured)
    yield Finished(ar, ar)
    for name in methods:
        yield Progress(f"running {name}…")
        result = run_to_end(pair, spec.as_method(name, spec.params if name == spec.strategy else {}), session)
        if result is None:
            yield Stopped(session.superseded)
            return
        attach_comparison(result, measured)
        yield Finished(result, ar)


def _race_seconds(lanes: list[tuple[str, RunSpec]], key: str) -> int:
    return min(GPU_SECONDS_MAX, 20 + len(lanes) * (lanes[0][1].max_new_tokens + WARM_UP_TOKENS) // 4)


@gpu(duration=_race_seconds)
def race_events(lanes: list[tuple[str, RunSpec]], key: str) -> Iterator[Event]:
    """Every lane warmed up (a short run, discarded), then each decoded to its end, unobserved, one after the other;
    Raced with every lane compared with this request's AR (fresh, never from the cache). Without the warm-up the
    first lane, AR, would pay for the allocator's growth and kernel selection alone and read slow."""
    session, pair = BACKEND.session_of(key), BACKEND.loaded_pair(lanes[0][1], "Race")
    yield Progress(f"race: warming up {len(lanes)} lanes (short runs, not timed)…")
    for _, spec in lanes:
        if run_to_end(pair, spec.warm_up(), session) is None:
            yield Stopped(session.superseded)
            return
    runs = []
    for k, (label, spec) in enumerate(lanes, start=1):
        yield Progress(f"race: decoding {label} unobserved ({k} of {len(lanes)})…")
        result = run_to_end(pair, spec, session)
        if result is None:
            yield Stopped(session.superseded)
            return
        runs.append((label, result))
    measured = BACKEND.ar_cache.put(BACKEND.ar_key(pair, lanes[0][1]), runs[0][1])
    for _, result in runs:
        attach_comparison(result, measured)
    yield Raced(runs)


def _sweep_seconds(spec: RunSpec, values: list[int], key: str) -> int:
    return min(GPU_SECONDS_MAX, 20 + (len(values) + 1) * spec.max_new_tokens // 4)


@gpu(duration=_sweep_seconds)
def sweep_events(spec: RunSpec, values: list[int], key: str) -> Iterator[Event]:
    """engine.bench.sweep's progress as Swept events (the session's flag as its cancel)."""
    session, pair = BACKEND.session_of(key), BACKEND.loaded_pair(spec, "Sweep")
    for progress in run_sweep(pair, spec, values, cancel=lambda: session.cancelled):
        yield Stopped(session.superseded) if progress.get("cancelled") else Swept(progress)
