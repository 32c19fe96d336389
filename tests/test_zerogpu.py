"""The app on ZeroGPU, through the real `spaces` wrapper (0.51.3) in its ZeroGPU code path: `spaces.GPU` decorates
the app's own work (Config.zero_gpu on), so every request forks spaces' worker, pickles its arguments and events and
keeps only gradio errors' words. Only the scheduler client (schedule, allow, release) and the GPU (spaces.zero.torch's
init, move, unpatch, enter_mode) are stood in; the worker computes on the CPU.

spaces.zero.torch, spaces' GPU layer, cannot even be imported over a CPU build of torch (its static.py reads
`torch.version.cuda`, None there), so the stand-in GPU replaces that module as a whole before the wrapper imports it;
everything else of the wrapper runs as on a Space.

It shows what a Space needs of the app (docs/app.md, the ZeroGPU section): the visitor's request reaches the
scheduler; errors keep their words; Stop frees the GPU within 2 s in Run, Compare, Race and Sweep; a worker forked
while other threads hold the app's locks runs; a pair not loaded at start is refused and the working one kept; the AR
measured in a worker fills the main process's cache; and each `duration` asked is the work's own estimate."""
from __future__ import annotations

import html
import multiprocessing
import os
import pickle
import sys
import threading
import time
import types
from datetime import timedelta

import gradio as gr
import pytest
import torch

spaces = pytest.importorskip("spaces")


def gpu_init(nvidia_uuid):
    """The GPU's stand-in: the worker computes on the CPU, on one thread (the parent's OpenMP pool does not exist in
    a fork, and a parallel region that expects it never ends)."""
    torch.set_num_threads(1)


# The GPU, stood in: spaces.zero.torch's functions the wrapper calls (in the worker: unpatch, init, size, move; in the
# main process: enter_mode), none of which touches a device here.
GPU = types.ModuleType("spaces.zero.torch")
GPU.__dict__.update(unpatch=lambda: None, init=gpu_init, size=lambda: 0, move=lambda callback=None: None,
                    enter_mode=lambda: None, patch=lambda: None, pack=lambda: 0, is_in_bad_fork=lambda: False)
sys.modules.setdefault("spaces.zero.torch", GPU)
import spaces.zero  # noqa: E402
spaces.zero.torch = sys.modules["spaces.zero.torch"]
from gradio.context import LocalContext  # noqa: E402
from spaces.zero import client as zero_client  # noqa: E402
from spaces.zero import wrappers  # noqa: E402,F401  (imports the stand-in GPU above, as spaces.zero.torch)
from spaces.zero.api import ScheduleResponse  # noqa: E402

import engine.bench.sweep as sweep_module  # noqa: E402
from engine.recipe import RunSpec  # noqa: E402
from treeviz.page import handlers, teaching_handlers  # noqa: E402
from treeviz.serving import work  # noqa: E402
from treeviz.serving.server import SERVER  # noqa: E402
from treeviz.serving.session import STOPS, Ticket  # noqa: E402

PAIR, STATUS = "tiny-random", 3


class Scheduler:
    """ZeroGPU's scheduler client, stood in: it records what the wrapper asks and grants at once (GPU 0, a worker
    kept idle for the next call, as the real scheduler does)."""

    def __init__(self, folder):
        self.scheduled, self.released, self.folder = [], [], folder

    def schedule(self, task_id, request=None, duration=None, gpu_size=None, _first_attempt=True):
        self.scheduled.append({"request": request, "duration": duration, "at": time.monotonic()})
        return ScheduleResponse(idle=True, nvidiaIndex=0, nvidiaUUID="stand-in", allowToken=f"t{len(self.scheduled)}")

    def allow(self, allow_token):  # runs in the forked worker: it leaves its pid where the test can read it
        (self.folder / f"allowed-{allow_token}").write_text(str(os.getpid()))

    def release(self, allow_token, *, fail=False, allow_404=False):
        self.released.append({"token": allow_token, "fail": fail, "at": time.monotonic()})


@pytest.fixture
def zero(monkeypatch, tmp_path):
    """spaces in its ZeroGPU code path; `decorate(fn)` is spaces.GPU over the app's work with its own duration."""
    monkeypatch.setattr(spaces.config.Config, "zero_gpu", True)
    scheduler = Scheduler(tmp_path)
    for name in ("schedule", "allow", "release"):
        monkeypatch.setattr(zero_client, name, getattr(scheduler, name))
    assert wrappers.torch is GPU, "spaces.zero.torch was imported before the stand-in GPU"
    durations = {work.decode_events: work.run_seconds, work.compare_events: work.compare_seconds,
                 work.race_events: work.race_seconds, work.sweep_events: work.sweep_seconds}
    on_gpu = {fn: spaces.GPU(duration=durations[fn])(fn) for fn in durations}
    monkeypatch.setattr(handlers, "decode_events", on_gpu[work.decode_events])
    monkeypatch.setattr(handlers, "compare_events", on_gpu[work.compare_events])
    monkeypatch.setattr(teaching_handlers, "race_events", on_gpu[work.race_events])
    monkeypatch.setattr(teaching_handlers, "sweep_events", on_gpu[work.sweep_events])
    SERVER.pairs.load(PAIR)  # on the main thread, as app.py does on ZeroGPU
    monkeypatch.setattr(SERVER.pairs, "pinned", (PAIR,))
    return scheduler


def visitor(browser: str) -> gr.Request:
    """A visitor's request, as gradio sets it in the handler's context (LocalContext.request)."""
    request = gr.Request(username=None)
    request.session_hash = browser
    LocalContext.request.set(request)
    return request


def run_args(prompt: str, strategy: str, tokens: int):
    return (prompt, False, PAIR, strategy, "cpu", tokens, 0.0, 1.0, 0, 0, "auto", {}, "per iteration")


def spec_of(prompt: str, strategy: str, tokens: int) -> RunSpec:
    return handlers.spec_from_inputs(*run_args(prompt, strategy, tokens)[:12])


def test_a_run_charges_the_visitor_and_its_ar_comes_back_to_the_cache(zero, tmp_path):
    """The wrapper receives the visitor's request (the compute thread runs each step in the caller's context); the
    work ran in a forked worker; its AR measurement fills this process's cache, so the next Run on the prompt asks for
    one run's seconds and gets AR from the ticket, though the reused worker's own cache predates it."""
    SERVER.ar_cache.entries.clear()
    request = visitor("zero-visitor")
    prompt = "def quota(n):\n"
    outputs = list(handlers.run(*run_args(prompt, "linear", 12), request))
    assert "12 tokens in" in outputs[-1][STATUS] and "speedup" in outputs[-1][STATUS]
    first = zero.scheduled[0]
    assert first["request"] is request  # not None: the visitor's own quota and priority
    spec = spec_of(prompt, "linear", 12)
    assert first["duration"] == timedelta(seconds=work.gpu_seconds(PAIR, 24))  # the run and AR
    worker = int((tmp_path / "allowed-t1").read_text())
    assert worker != os.getpid()
    key = SERVER.ar_key(SERVER.pairs.held(PAIR), spec)
    assert key in SERVER.ar_cache and len(SERVER.ar_cache) == 1

    outputs = list(handlers.run(*run_args(prompt, "fixed", 12), request))
    assert "against AR reused from the cache" in outputs[-1][STATUS]
    second = zero.scheduled[1]
    assert second["request"] is request and second["duration"] == timedelta(seconds=work.gpu_seconds(PAIR, 12))
    assert not (tmp_path / "allowed-t2").exists()  # the idle worker took it: no fork, its cache an old copy
    assert len(SERVER.ar_cache) == 1 and [r["fail"] for r in zero.released] == [False, False]


def test_errors_keep_their_words_across_the_worker(zero, monkeypatch):
    """A user-facing engine error and a bug both reach the page as their sentence, not 'ZeroGPU worker error'."""
    request = visitor("zero-errors")
    limit = SERVER.pairs.held(PAIR).target.config.max_position_embeddings
    outputs = list(handlers.run(*run_args("x " * limit, "linear", 4), request))
    assert html.escape(f"max_new_tokens exceeds the model's {limit} positions") in outputs[-1][STATUS]
    assert "ZeroGPU" not in outputs[-1][STATUS]
    assert zero.released[-1]["fail"] is True  # it crossed as an error

    def broken(pair, spec):
        raise RuntimeError("a stand-in fault in the engine")
    monkeypatch.setattr(work, "start_run", broken)  # before the next fork: the worker inherits it
    outputs = list(handlers.run(*run_args("def fault():\n", "linear", 4), request))
    assert "RuntimeError: a stand-in fault in the engine" in outputs[-1][STATUS]


def slow_run(run):
    """`run` (a DecodeRun) with every iteration 0.2 s longer: the slow stand-in step, on the run's own loop."""
    iterate = run.iterate

    def slower():
        time.sleep(0.2)
        return iterate()

    run.iterate = slower
    return run


def slow_steps(monkeypatch):
    for module in (work, sweep_module):
        real = module.start_run
        monkeypatch.setattr(module, "start_run", lambda pair, spec, real=real: slow_run(real(pair, spec)))


REQUESTS = {
    "run": lambda r: handlers.run(*run_args("def slow(n):\n", "linear", 200), r),
    "compare": lambda r: handlers.compare(*run_args("def slow(n):\n", "linear", 200)[:12], ["linear"],
                                          "per iteration", r),
    "race": lambda r: teaching_handlers.race("def slow(n):\n", False, PAIR, ["linear"], 200, 0.0, 1.0, 0, 0, "auto",
                                             r),
    "sweep": lambda r: teaching_handlers.sweep("def slow(n):\n", False, PAIR, "fixed", "cpu", {}, 100, 2, 4, 2,
                                               request=r),
}


@pytest.mark.parametrize("name", list(REQUESTS))
def test_stop_frees_the_gpu_within_two_seconds(zero, monkeypatch, name):
    """Stop while the worker decodes (unobserved in Compare, Race and Sweep): the request ends Stopped and the GPU
    is released, both within 2 s of the Stop."""
    slow_steps(monkeypatch)
    request = visitor(f"zero-stop-{name}")
    outputs, done = [], threading.Event()

    def consume():
        LocalContext.request.set(request)
        outputs.extend(REQUESTS[name](request))
        done.set()
    threading.Thread(target=consume, daemon=True).start()
    deadline = time.monotonic() + 60
    while not zero.scheduled and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.5)  # the worker is inside its slow runs by now
    assert not done.is_set() and not zero.released
    stopped_at = time.monotonic()
    handlers.stop(request)
    assert done.wait(2.0), f"{name} still running 2 s after Stop"
    assert zero.released and zero.released[-1]["at"] - stopped_at < 2.0
    assert "stopped" in " ".join(map(str, outputs[-1]))


def forked_run(spec: RunSpec, ticket: Ticket, conn) -> None:
    gpu_init("stand-in")
    try:
        conn.send([type(e).__name__ for e in work.decode_events(spec, ticket)])
    except BaseException as err:  # noqa: BLE001 - the parent reports it
        conn.send(repr(err))


def test_a_worker_forked_while_other_threads_hold_the_locks_runs():
    """The work takes no lock a parent thread could hold at the fork: forked while another thread holds the
    server's, the pair manager's, the run lock and the stop table's, it runs to its end."""
    SERVER.pairs.load(PAIR)
    session = SERVER.open("zero-fork", "run")
    spec = spec_of("def fork():\n", "linear", 8)
    ticket = pickle.loads(pickle.dumps(session.ticket(spec)))
    held, release = threading.Event(), threading.Event()
    locks = (SERVER._lock, SERVER.pairs._cond, SERVER.pairs.run_lock, STOPS._lock)

    def hold():
        for lock in locks:
            lock.acquire()
        held.set()
        release.wait()
        for lock in reversed(locks):
            lock.release()
    threading.Thread(target=hold, daemon=True).start()
    assert held.wait(5)
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=forked_run, args=(spec, ticket, send), daemon=True)
    try:
        child.start()
        assert receive.poll(60), "the forked worker deadlocked"
        events = receive.recv()
    finally:
        release.set()
        child.join(10)
        SERVER.close(session)
    assert events[-1] in ("Finished", "BaselineMeasured") and "ARMeasured" in events, events


def test_a_pair_not_loaded_at_start_is_refused_and_the_working_one_kept(zero):
    """On ZeroGPU another pair (the dropdown offers none; the API can name one) gets a plain sentence; the pair
    loaded at start keeps serving."""
    from treeviz.serving.pairs import pair_choices
    request = visitor("zero-pairs")
    pair = SERVER.pairs.held(PAIR)
    args = list(run_args("def other():\n", "linear", 4))
    args[2] = "tiny-random-identical"
    outputs = list(handlers.run(*args, request))
    assert "serves only the model pair it loaded at start (tiny-random)" in outputs[-1][STATUS]
    assert SERVER.pairs.held(PAIR) is pair and pair_choices(SERVER.pairs) == [PAIR]
    assert not zero.scheduled  # refused before any GPU was asked for
    outputs = list(handlers.run(*run_args("def other():\n", "linear", 4), request))
    assert "4 tokens in" in outputs[-1][STATUS]


def test_a_request_too_long_for_one_gpu_slot_is_refused_in_words(zero):
    request = visitor("zero-long")
    tokens = int((work.GPU_SECONDS_MAX - work.START_S) / (work.MARGIN * work.STEPS_PER_TOKEN * work.DEFAULT_STEP_S))
    outputs = list(handlers.run(*run_args("def long():\n", "linear", tokens), request))
    assert "one request may ask for at most 120 s" in outputs[-1][STATUS] and not zero.scheduled
