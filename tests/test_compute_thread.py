"""The app's one compute thread (treeviz/serving/compute_thread.py): a run session's work runs every step on that
thread, one event per request, closes there, and its errors reach the caller; the app's runs decode there."""
from __future__ import annotations

import threading

import pytest

from treeviz.serving.compute_thread import ComputeThread


@pytest.fixture(scope="module")
def backend():
    from treeviz.serving.server import Server
    backend = Server()
    backend.pairs.load("tiny-random")
    return backend


def test_a_sessions_work_runs_every_step_on_the_compute_thread_in_lockstep(backend):
    from treeviz.serving.compute_thread import COMPUTE
    from treeviz.serving.events import Progress, Started
    log = []

    def work(ticket):
        for i in range(3):
            log.append(("made", i, threading.get_ident()))
            yield Progress(str(i))
    caller = threading.get_ident()
    for event in backend.open("lockstep", "run").events("go", "tiny-random", work):
        if not isinstance(event, Started):
            log.append(("used", int(event.text), caller))
    assert [entry[:2] for entry in log] == [("made", 0), ("used", 0), ("made", 1), ("used", 1), ("made", 2),
                                           ("used", 2)]  # lockstep: nothing is made ahead of its use
    assert {entry[2] for entry in log if entry[0] == "made"} == {COMPUTE.ident} and COMPUTE.ident != caller


def test_closing_a_session_closes_its_work_on_the_compute_thread(backend):
    from treeviz.serving.compute_thread import COMPUTE
    from treeviz.serving.events import Progress
    closed_on = []

    def work(ticket):
        try:
            for i in range(100):
                yield Progress(str(i))
        finally:
            closed_on.append(threading.get_ident())
    events = backend.open("closing", "run").events("go", "tiny-random", work)
    assert [next(events).text for _ in range(3)] == ["go", "0", "1"]
    events.close()  # the consumer went away: the work's finally runs where the work ran, the pair is let go
    assert closed_on == [COMPUTE.ident] and not backend.pairs.run_lock.locked()


def test_errors_reach_the_caller_and_the_thread_goes_on(backend):
    from treeviz.serving.events import Failed, Progress
    compute = ComputeThread("test-compute")

    def bad():
        raise ValueError("bad step")
    with pytest.raises(ValueError, match="bad step"):
        compute.call(bad)
    assert compute.call(lambda a, b: a + b, 2, 3) == 5
    assert compute.call(lambda: compute.call(threading.get_ident)) == compute.ident  # a call from itself runs inline

    def work(ticket):
        yield Progress("1")
        raise ValueError("bad step")
    events = list(backend.open("errors", "run").events("go", "tiny-random", work))
    assert events[1:] == [Progress("1"), Failed("ValueError: bad step")]  # one plain line, not a traceback
    assert not backend.pairs.run_lock.locked()


def test_the_apps_runs_decode_on_the_compute_thread(backend):
    """A RunSession steps its model work there (Run, Compare, race and sweep all go through it) under the pair's
    lock, while the wait for the pair and its lock stays in the caller's thread; the lock is let go at the end."""
    from treeviz.serving.compute_thread import COMPUTE
    from treeviz.serving.events import Progress, Started
    seen = []

    def work(ticket):
        seen.append((threading.get_ident(), backend.pairs.run_lock.locked(), ticket.key))
        yield Progress("step")
    events = list(backend.open("s", "run").events("go", "tiny-random", work))
    assert events == [Started("go"), Progress("step")]
    assert seen == [(COMPUTE.ident, True, "s/run")] and seen[0][0] != threading.get_ident()
    assert not backend.pairs.run_lock.locked() and backend.running("s") == []


def test_each_call_runs_in_a_copy_of_the_callers_context():
    """A context variable set by the caller (gradio's request is one: ZeroGPU's wrapper reads it) is seen by the call
    on the compute thread; what the call sets stays in its copy."""
    import contextvars
    request = contextvars.ContextVar("request", default=None)
    compute = ComputeThread("test-context")

    def read_and_set():
        seen = request.get()
        request.set("changed on the compute thread")
        return seen
    request.set("the visitor's request")
    assert compute.call(read_and_set) == "the visitor's request"
    assert request.get() == "the visitor's request"
    assert compute.call(request.get) == "the visitor's request"
