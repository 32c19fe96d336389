"""One request's life cycle: a `RunSession` per request of one browser session and one view, which emits typed
events (treeviz/serving/events.py) from Started to its last one.

A session owns what its request shares with the rest of the app: the cancel flag (Stop, and a newer request of the
same view, raise it: the one way a run is stopped), the wait for the model pair, the pair's run lock and the app's one
compute thread. The model work it steps is treeviz/serving/work.py's. A cancel becomes one Stopped, here: the work
raises `Cancelled` when it sees the flag between its iterations (`check`), the session checks it between events, and
whatever ends a cancelled request ends it as Stopped.
"""
from __future__ import annotations

import logging
import threading
import traceback
from typing import Any, Callable, Iterator

import gradio as gr

from treeviz.serving.compute_thread import COMPUTE
from treeviz.serving.errors import USER_FACING, friendly_error
from treeviz.serving.events import Event, Failed, Progress, Started, Stopped
from treeviz.serving.gpu import is_zero_gpu_error, zero_gpu_message

log = logging.getLogger("treeviz")
_END = object()  # next()'s default: the work is exhausted


class Cancelled(Exception):
    """The session's flag was seen: raised by `RunSession.check` inside the work, turned into Stopped by `events`."""


class RunSession:
    """One request of one browser session for one view ("run": Run and Compare, which share the main views; "race";
    "sweep"). `events` is the whole request as typed events, from Started to its last event. `server` is the
    treeviz.serving.server.Server that registered it (its pair manager; it forgets the session at the end)."""

    def __init__(self, server, key: str):
        self.server, self.key = server, key
        self._cancel = threading.Event()
        self.superseded = False        # cancelled because a newer request of the same view began

    def cancel(self, superseded: bool = False) -> None:
        self.superseded = self.superseded or superseded
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def check(self) -> None:
        """Raise Cancelled if the flag is up: the work calls it between iterations, the session between events."""
        if self.cancelled:
            raise Cancelled

    def events(self, opening: str, pair_name: str, work: Callable[..., Iterator[Event]], *args: Any) -> Iterator[Event]:
        """Started, the wait for the pair (Progress, on this side of the GPU boundary), then `work(*args, key)`'s
        events, each produced on the compute thread under the pair's run lock, until the work ends or the flag is
        seen (by the work or here): then the work is closed on the compute thread (a ZeroGPU worker's task ends with
        it) and the last event is Stopped. Failed on an error (Stopped if the flag is up by then). The lock and the
        session are let go when the work ends or the consumer closes this generator."""
        try:
            yield Started(opening)
            yield from self._wait_for_pair(pair_name)
            yield from self._take_lock()
            work_events = None
            try:
                work_events = work(*args, self.key)
                while True:
                    self.check()
                    event = COMPUTE.call(next, work_events, _END)
                    if event is _END:
                        return
                    yield event
            finally:
                if work_events is not None:
                    COMPUTE.call(work_events.close)
                self.server.pairs.run_lock.release()
        except Exception as err:  # noqa: BLE001 - every error becomes one plain line, the traceback goes to the log
            if self.cancelled:  # Cancelled, raised here or by the work (from a ZeroGPU worker, as the worker's error)
                yield Stopped(self.superseded)
            else:
                yield Failed(self._message(err))
        finally:
            self.server.close(self)

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
        if is_zero_gpu_error(err):
            return zero_gpu_message(err)
        if isinstance(err, gr.Error):
            return str(err.message)
        if not isinstance(err, USER_FACING):
            log.warning("run failed:\n%s", traceback.format_exc())
        return friendly_error(err)
