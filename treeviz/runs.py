"""Runs on the loaded pair: one decoding loop per request, iterated by the request's own handler under the pair's
lock, with what it streams (`Status`, `Step`, `Done`), per-session cancel flags, and AR baselines (cached).

Every run is built by engine.session (`start_run`); no tensor math here.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Generator, Iterator

from engine.core.trace import RunResult
from engine.session import AR, RunSpec, start_run
from treeviz.ar_cache import ARCache, Baseline, attach_comparison
from treeviz.compute_thread import COMPUTE
from treeviz.pairs import PairManager


class Cancel:
    """A session's cancel flag, checked by its run between iterations."""

    def __init__(self):
        self.event = threading.Event()
        self.superseded = False  # cancelled because a newer run of the same session started

    def set(self, superseded: bool = False) -> None:
        self.superseded = self.superseded or superseded
        self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set()


# What a run streams to its handler (the handler turns each into component updates).
@dataclass
class Status:
    text: str


@dataclass
class Step:
    run: Any                           # the DecodeRun after one more iteration: .snapshot() is the run so far


@dataclass
class Done:
    """A finished run (None when stopped or superseded). A Run streams it twice: at once with `ar` None, then again
    with AR beside it once AR on the same prompt is measured (at once if it is cached)."""
    result: RunResult | None
    ar: RunResult | None = None


def request_key(session: str, view: str) -> str:
    """The cancel flag's key of one browser session's requests for one view: "run" (Run and Compare, which share
    the main views), "race" or "sweep". A newer request supersedes only the older one of its own view, so a slider
    released while a race decodes re-runs the Run view (after the race, on the pair's lock) instead of silently
    killing the race."""
    return f"{session}/{view}"


class Backend:
    """The pair, the AR cache and one cancel flag per browser session and view (a new request cancels the older one
    of the same view; Stop cancels all of the session's)."""

    def __init__(self):
        self.pairs = PairManager()
        self.ar_cache = ARCache()
        self._cancels: dict[str, Cancel] = {}
        self._lock = threading.Lock()

    # -- sessions ----------------------------------------------------------------------------------------------------
    def begin(self, key: str) -> Cancel:
        """A fresh cancel flag for request `key` (request_key), superseding the older request under that key."""
        cancel = Cancel()
        with self._lock:
            old = self._cancels.get(key)
            if old is not None:
                old.set(superseded=True)
            self._cancels[key] = cancel
        return cancel

    def cancel_of(self, key: str) -> Cancel:
        """The flag `begin` made for `key`; an unregistered one (nothing can raise it) if none was begun."""
        with self._lock:
            return self._cancels.get(key) or Cancel()

    def busy(self, key: str) -> bool:
        """Whether a request under `key` was begun and is still running, not cancelled."""
        with self._lock:
            cancel = self._cancels.get(key)
        return cancel is not None and not cancel.is_set()

    def stop(self, session: str) -> bool:
        """Cancel every running request of browser session `session`; False if none was running."""
        with self._lock:
            running = [c for key, c in self._cancels.items() if key.partition("/")[0] == session and not c.is_set()]
        for cancel in running:
            cancel.set()
        return bool(running)

    def end(self, key: str, cancel: Cancel) -> None:
        with self._lock:
            if self._cancels.get(key) is cancel:
                del self._cancels[key]

    # -- the pair's lock -----------------------------------------------------------------------------------------------
    def locked(self, cancel: Cancel) -> Iterator[Status | bool]:
        """Wait for the pair's run lock, yielding one Status while another run holds it; yields True once held
        (the caller releases it) or returns early if cancelled."""
        told = False
        while not self.pairs.run_lock.acquire(timeout=0.2):
            if cancel.is_set():
                return
            if not told:
                told = True
                yield Status("waiting for another run on this model pair to finish…")
        yield True

    def holding(self, cancel: Cancel, body: Iterator, cancelled: tuple = ()) -> Iterator:
        """`body`'s items, produced on the compute thread (treeviz/compute_thread.py) while holding the pair's run
        lock (a Status while waiting for it, here in the caller's thread: waiting there would hold up the run that
        has the lock; `cancelled`'s items instead if the run is cancelled first). The lock is released when the body
        ends or the consumer closes this generator (Stop)."""
        held = False
        try:
            for item in self.locked(cancel):
                if item is True:
                    held = True
                else:
                    yield item
            if not held:
                yield from cancelled
                return
            yield from COMPUTE.stepped(body)  # the model work, on the app's one compute thread
        finally:
            if held:
                self.pairs.run_lock.release()

    # -- the work ------------------------------------------------------------------------------------------------------
    @staticmethod
    def iterate(pair, spec: RunSpec, cancel: Cancel, stream: bool) -> Generator[Step, None, RunResult | None]:
        """The one decoding loop: run `spec` to its end (a Step after every iteration when `stream`); returns its
        result, or None if cancelled between iterations."""
        run = start_run(pair, spec)
        for _ in run:
            if stream:
                yield Step(run)
            if cancel.is_set():
                return None
        return run.result

    def ar_key(self, pair, spec: RunSpec) -> tuple:
        steps = pair.describe_capture() if pair.capture_ready and spec.capture != "off" else "eager"
        return ARCache.key(self.pairs.loaded_name, pair.dtype, spec, steps)

    def baseline(self, pair, spec: RunSpec, cancel: Cancel) -> Generator[Status, None, Baseline | None]:
        """AR on the same prompt and settings: from the cache, else measured now (a Status first); None if
        cancelled while measuring."""
        key = self.ar_key(pair, spec)
        cached = self.ar_cache.baseline(key)
        if cached is not None:
            return cached
        yield Status("measuring plain autoregressive decoding on the same prompt…")
        result = yield from self.iterate(pair, spec.as_method(AR), cancel, stream=False)
        return None if result is None else self.ar_cache.put(key, result)

    def decode(self, pair, spec: RunSpec, cancel: Cancel) -> Iterator[Status | Step | Done]:
        """Decode `spec` under the pair's lock: a Step after every iteration, Done as soon as it ends, then Done
        again with AR beside it once AR is measured (or found in the cache)."""
        return self.holding(cancel, self._decode(pair, spec, cancel), cancelled=(Done(None),))

    def _decode(self, pair, spec: RunSpec, cancel: Cancel) -> Iterator[Status | Step | Done]:
        result = yield from self.iterate(pair, spec, cancel, stream=True)
        if result is None:
            yield Done(None)
            return
        if spec.strategy == AR:
            self.ar_cache.put(self.ar_key(pair, spec), result)
        if self.ar_key(pair, spec) not in self.ar_cache:
            yield Done(result)  # show the run now; AR follows
        baseline = yield from self.baseline(pair, spec, cancel)
        if baseline is None:  # cancelled while measuring AR: the run stays shown, without a baseline
            return
        if result is baseline.result:  # an AR run is its own baseline, measured just now
            baseline.reused = False
        attach_comparison(result, baseline)
        yield Done(result, baseline.result)

    def compare(self, pair, spec: RunSpec, methods: list[str], cancel: Cancel) -> Iterator[Status | Done]:
        """AR and each of `methods` on one prompt; a Done(result, ar) per method, AR first."""
        return self.holding(cancel, self._compare(pair, spec, methods, cancel))

    def _compare(self, pair, spec: RunSpec, methods: list[str], cancel: Cancel) -> Iterator[Status | Done]:
        baseline = yield from self.baseline(pair, spec, cancel)
        if baseline is None:
            return
        ar = baseline.result
        attach_comparison(ar, baseline)
        yield Done(ar, ar)
        for name in methods:
            yield Status(f"running {name}…")
            method = spec.as_method(name, spec.params if name == spec.strategy else {})
            result = yield from self.iterate(pair, method, cancel, stream=False)
            if result is None:
                return
            attach_comparison(result, baseline)
            yield Done(result, ar)


BACKEND = Backend()  # one per process: the handlers (and tests) reach it as this module global, never as an argument
