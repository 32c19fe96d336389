"""One request's life cycle: a `RunSession` per request of one browser session and one view, which emits typed
events (treeviz/serving/events.py) from Started to its last one.

A session owns what its request shares with the rest of the app: the cancel flag (Stop, and a newer request of the
same view, raise it: the one way a run is stopped), the wait for the model pair, the pair's run lock and the app's one
compute thread. The model work it steps is treeviz/serving/work.py's, handed a `Ticket`: what the work needs from this
process, picklable, read without a lock (on ZeroGPU the work runs in a worker forked from this multi-threaded process,
where a lock another thread held at the fork stays held forever). A cancel becomes one Stopped, here: the work checks
the ticket between its iterations (the flag lives in memory every forked worker shares, `STOPS`), the session checks
its flag between events, and whatever ends a cancelled request ends it as Stopped.
"""
from __future__ import annotations

import itertools
import logging
import mmap
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from engine.recipe import RunSpec
from treeviz.serving.ar_cache import Baseline
from treeviz.serving.compute_thread import COMPUTE
from treeviz.serving.errors import USER_FACING, friendly_error
from treeviz.serving.events import ARMeasured, Event, Failed, Progress, Started, Stopped
from treeviz.serving.gpu import PAGE, error_text, is_zero_gpu_error, zero_gpu_message

log = logging.getLogger("treeviz")
_END = object()  # next()'s default: the work is exhausted


class Cancelled(Exception):
    """The session's flag was seen: raised by `RunSession.check` inside the work, turned into Stopped by `events`."""


class StopTable:
    """Stop flags shared with every worker forked after import: one 8-byte slot per session in an anonymous shared
    mapping (MAP_SHARED: a fork shares the pages, not a copy), holding the serial of the session that owns it while
    it runs. A session takes slot `serial % SLOTS`; the work reads its slot without a lock and is cancelled once the
    slot no longer holds its serial (Stop or the session's end write 0; a session SLOTS requests later takes the slot
    over). Only this process writes, under its lock; a torn read can only read as cancelled."""

    SLOTS = 16384

    def __init__(self):
        self._map = mmap.mmap(-1, 8 * self.SLOTS)
        self._slots = memoryview(self._map).cast("Q")
        self._serials = itertools.count(1)
        self._lock = threading.Lock()

    def open(self) -> tuple[int, int]:
        """(slot, serial) for a new session, its flag down."""
        with self._lock:
            serial = next(self._serials)
            slot = serial % self.SLOTS
            self._slots[slot] = serial
            return slot, serial

    def stop(self, slot: int, serial: int) -> None:
        with self._lock:
            if self._slots[slot] == serial:
                self._slots[slot] = 0

    def running(self, slot: int, serial: int) -> bool:
        return self._slots[slot] == serial


STOPS = StopTable()  # made at import: every ZeroGPU worker (forked later) shares it


@dataclass(frozen=True)
class Ticket:
    """What a request's work gets from the main process: its session's key and stop slot, and the AR baseline cached
    there for the request's prompt (`baseline`, under `baseline_key`; a worker's own copy of the cache may predate the
    fork). Picklable; nothing here takes a lock."""
    key: str
    slot: int
    serial: int
    baseline: Baseline | None = None
    baseline_key: tuple | None = None

    @property
    def cancelled(self) -> bool:
        return not STOPS.running(self.slot, self.serial)

    def check(self) -> None:
        """Cancelled if the session's flag is up (Stop, a newer request of its view, or its end)."""
        if self.cancelled:
            raise Cancelled

    def cached(self, key: tuple) -> Baseline | None:
        """The handed-over baseline if it was cached under `key` (how the work's AR would run), else None."""
        return self.baseline if self.baseline is not None and self.baseline_key == key else None


class RunSession:
    """One request of one browser session for one view ("run": Run and Compare, which share the main views; "race";
    "sweep"). `events` is the whole request as typed events, from Started to its last event. `server` is the
    treeviz.serving.server.Server that registered it (its pair manager; it forgets the session at the end)."""

    def __init__(self, server, key: str):
        self.server, self.key = server, key
        self._cancel = threading.Event()
        self.superseded = False        # cancelled because a newer request of the same view began
        self.slot, self.serial = STOPS.open()

    def cancel(self, superseded: bool = False) -> None:
        self.superseded = self.superseded or superseded
        self._cancel.set()
        STOPS.stop(self.slot, self.serial)

    def ticket(self, baseline_for: RunSpec | None = None) -> Ticket:
        """This session's Ticket, with the AR baseline cached here for `baseline_for` (if given and cached)."""
        key, baseline = self.server.cached_baseline(baseline_for) if baseline_for is not None else (None, None)
        return Ticket(self.key, self.slot, self.serial, baseline, key)

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def check(self) -> None:
        """Raise Cancelled if the flag is up: the session checks it between events (the work checks its Ticket)."""
        if self.cancelled:
            raise Cancelled

    def events(self, opening: str, pair_name: str, work: Callable[..., Iterator], *args: Any,
               baseline_for: RunSpec | None = None) -> Iterator[Event]:
        """Started, the wait for the pair (Progress, on this side of the GPU boundary), then `work(*args, ticket)`'s
        events (its ticket hands over the AR cached here for `baseline_for`, when given), each produced on the
        compute thread under the pair's run lock, until the work ends or the flag is seen (by the work or here): then
        the work is closed on the compute thread (a ZeroGPU worker's task ends with it) and the last event is Stopped.
        Failed on an error (Stopped if the flag is up by then). The lock and the session are let go when the work
        ends or the consumer closes this generator."""
        try:
            yield Started(opening)
            yield from self._wait_for_pair(pair_name)
            yield from self._take_lock()
            try:
                work_events = work(*args, self.ticket(baseline_for))
                try:  # the loop sits here, not in a generator of its own: one frame fewer on every run's path
                    while (event := self._next(work_events)) is not _END:
                        yield event
                finally:  # however this ends: the ticket stopped first (a worker between two yields stops at its
                    STOPS.stop(self.slot, self.serial)  # next check, which closing the work waits for), then closed
                    COMPUTE.call(work_events.close)
            finally:
                self.server.pairs.run_lock.release()
        except Exception as err:  # noqa: BLE001 - every error becomes one plain line, the traceback goes to the log
            if self.cancelled:  # Cancelled, raised here or by the work (from a ZeroGPU worker, as the worker's error)
                yield Stopped(self.superseded)
            else:
                yield Failed(self._message(err))
        finally:
            STOPS.stop(self.slot, self.serial)  # a worker still running on this ticket stops at its next check
            self.server.close(self)

    def _next(self, work_events: Iterator) -> Event | object:
        """The work's next event, asked for on the compute thread (in this thread's context: the request's), AR
        measurements kept in this process's cache on the way; _END when it ends; Cancelled once the flag is up, also
        when the work ended early because it saw the flag."""
        self.check()
        while True:
            event = COMPUTE.call(next, work_events, _END)
            if event is _END:
                self.check()
                return _END
            if not isinstance(event, ARMeasured):
                return event
            self.server.ar_cache.put(event.key, event.result, event.measured_at)

    def _wait_for_pair(self, name: str) -> Iterator[Progress]:
        """Loading progress until the pair is ready or the flag is up; UserError if it fails to load."""
        self.server.pairs.request(name)
        told = -1.0
        while self.server.pairs.ready(name) is None and not self.cancelled:  # ready() waits up to 0.25 s
            fraction, message = self.server.pairs.status().progress
            if fraction != told:
                told = fraction
                yield Progress(f"waiting for the models: {message}", fraction)

    def _take_lock(self) -> Iterator[Progress]:
        """Take the pair's run lock (one Progress while another run holds it); Cancelled, and the lock not taken, if
        the flag is raised first."""
        self.check()
        told = False
        while not self.server.pairs.run_lock.acquire(timeout=0.2):
            self.check()
            if not told:
                told = True
                yield Progress("waiting for another run on this model pair to finish…")

    @staticmethod
    def _message(err: Exception) -> str:
        """ZeroGPU's own errors and the work's (crossed as the page's error type) keep their text; any other error
        becomes its plain sentence, the traceback logged unless it was written for the user."""
        if is_zero_gpu_error(err):
            return zero_gpu_message(err)
        if PAGE.error is not None and isinstance(err, PAGE.error):
            return error_text(err)
        if not isinstance(err, USER_FACING):
            log.warning("run failed:\n%s", traceback.format_exc())
        return friendly_error(err)
