"""The app's one compute thread (treeviz/compute_thread.py): a generator stepped there runs every step on that
thread, one item per request, closes there, and its errors reach the caller; the app's runs decode there."""
from __future__ import annotations

import threading

import pytest

from treeviz.compute_thread import ComputeThread


def test_a_stepped_generator_runs_every_step_on_the_compute_thread_in_lockstep():
    compute, log = ComputeThread("test-compute"), []

    def body():
        for i in range(3):
            log.append(("made", i, threading.get_ident()))
            yield i
    caller = threading.get_ident()
    for item in compute.stepped(body()):
        log.append(("used", item, caller))
    assert [entry[:2] for entry in log] == [("made", 0), ("used", 0), ("made", 1), ("used", 1), ("made", 2),
                                           ("used", 2)]  # lockstep: nothing is made ahead of its use
    assert {entry[2] for entry in log if entry[0] == "made"} == {compute.ident} and compute.ident != caller


def test_closing_the_stepped_generator_closes_the_body_on_the_compute_thread():
    compute, closed_on = ComputeThread("test-compute"), []

    def body():
        try:
            yield from range(100)
        finally:
            closed_on.append(threading.get_ident())
    items = compute.stepped(body())
    assert next(items) == 0 and next(items) == 1
    items.close()  # Stop: the body's finally (the pair's lock, say) runs where the body ran
    assert closed_on == [compute.ident]


def test_errors_reach_the_caller_and_the_thread_goes_on():
    compute = ComputeThread("test-compute")

    def body():
        yield 1
        raise ValueError("bad step")
    items = compute.stepped(body())
    assert next(items) == 1
    with pytest.raises(ValueError, match="bad step"):
        next(items)
    assert compute.call(lambda a, b: a + b, 2, 3) == 5
    assert compute.call(lambda: compute.call(threading.get_ident)) == compute.ident  # a call from itself runs inline


def test_the_apps_runs_decode_on_the_compute_thread():
    """A RunSession steps its model work there (Run, Compare, race and sweep all go through it) under the pair's
    lock, while the wait for the pair and its lock stays in the caller's thread; the lock is let go at the end."""
    from treeviz.compute_thread import COMPUTE
    from treeviz.runs import Backend, Progress, Started
    backend, seen = Backend(), []
    backend.pairs.load("tiny-random")

    def work(key):
        seen.append((threading.get_ident(), backend.pairs.run_lock.locked(), key))
        yield Progress("step")
    events = list(backend.open("s", "run").events("go", "tiny-random", work))
    assert events == [Started("go"), Progress("step")]
    assert seen == [(COMPUTE.ident, True, "s/run")] and seen[0][0] != threading.get_ident()
    assert not backend.pairs.run_lock.locked() and backend.running("s") == []
