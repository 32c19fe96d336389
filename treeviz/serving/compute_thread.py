"""One thread for all of the app's model work.

torch's CPU kernels run in parallel through OpenMP, and GNU OpenMP keeps a pool of worker threads for each thread
that starts parallel work. Once two such pools exist on a small machine there are more OpenMP threads than cores,
and then, by libgomp's documented default (GOMP_SPINCOUNT), idle workers spin 100 times instead of 300,000 before
they sleep, so every parallel region has to wake them: a thread started after the main thread ran parallel work
runs the same kernels measurably slower (`python -m scripts.lab.thread_probe`; numbers in
docs/experiments/design-measurements.md). Gradio steps a streaming handler in whichever of its worker threads is
free, and each worker that ever ran a kernel keeps its pool, so without this module a run is slow whenever a step
lands on another worker.

So every model call the app makes runs on this one thread: a run session (treeviz/serving/session.py) asks it for each
event of its model work in turn, `call(next, work)`, exactly as if the handler stepped the work itself: the decoder
still pauses while the handler draws the event, and a `with` block in the work (inference mode, say, which is per
thread) opens and closes on one thread.

Each call runs in a copy of its caller's context (contextvars): the request a Gradio handler runs for is a context
variable (gradio's LocalContext.request), and ZeroGPU's `spaces.GPU` reads it when the work first runs, to charge the
visitor's own quota; without the copy this thread's empty context would make every run the Space's.
"""
from __future__ import annotations

import contextvars
import os
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable


class ComputeThread:
    """A daemon thread that runs the calls given to it, one at a time, in order (started on first use, and again
    in a forked process, which inherits no threads)."""

    def __init__(self, name: str = "treeviz-compute"):
        self.name = name
        self._jobs: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._pid = None
        self._start_lock = threading.Lock()

    def call(self, fn: Callable, *args: Any) -> Any:
        """fn(*args) on this thread in a copy of the caller's context, waited for; its exception is raised here.
        From this thread itself it just calls fn (a job waiting for its own thread would wait forever)."""
        if threading.current_thread() is self._thread:
            return fn(*args)
        done: Future = Future()
        self._queue().put((done, contextvars.copy_context().run, (fn, *args)))
        return done.result()

    @property
    def ident(self) -> int | None:
        """The thread's id once started (tests check that work ran here)."""
        return None if self._thread is None else self._thread.ident

    def _queue(self) -> queue.SimpleQueue:
        with self._start_lock:
            if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
                self._jobs, self._pid = queue.SimpleQueue(), os.getpid()
                self._thread = threading.Thread(target=self._serve, args=(self._jobs,), name=self.name, daemon=True)
                self._thread.start()
            return self._jobs

    @staticmethod
    def _serve(jobs: queue.SimpleQueue) -> None:
        while True:
            done, fn, args = jobs.get()
            if not done.set_running_or_notify_cancel():
                continue
            try:
                done.set_result(fn(*args))
            except BaseException as err:  # noqa: BLE001 - every error goes back to the caller, raised there
                done.set_exception(err)


COMPUTE = ComputeThread()  # one per process: the app's model work all runs on it
