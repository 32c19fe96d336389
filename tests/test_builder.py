"""The builder process (engine/cpu/builder.py) lives within its limits (engine/cpu/build_guard.py): one compile
at a time across processes, a compile that does not fit in memory declined with a message, an end with the app that
started it, its state in a status file.

Every builder here is a real process on the tiny pair (`python -m engine build` through start_builder). One
test compiles (the tiny target's one-row package: tens of seconds on 2 cores); the others hold the build lock or give
no memory, so nothing compiles.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from procs import process_state, stat_fields, wait_until

from engine.cli import load_request_pair
from engine.cpu.aoti import Recipe, write_meta
from engine.cpu.build_guard import (DEFAULT_PEAK_FIXED, WaitClock, build_lock, compile_peak_estimate,
                                    descendants, earlier_peaks, identities, package_weight_bytes, proc_stat,
                                    watch_parent)
from engine.cpu.builder import EXIT_DECLINED, EXIT_STOPPED, NICENESS, REPOSITORY, build_request, start_builder

ONE_ROW = Recipe(1, "plain")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty cache for this test (start_builder's children inherit it); its captured folder."""
    monkeypatch.setenv("TREEVIZ_CACHE", str(tmp_path))
    folder = tmp_path / "captured"
    folder.mkdir()
    return folder


def tiny_request(**limits) -> dict:
    pair = load_request_pair({"target": "tiny-random", "draft": None, "dtype": "float32", "device": "cpu"})
    return build_request(pair, "tiny-random", None, {"target": [ONE_ROW]}, **limits)


def start(folder: Path, name: str, **limits):
    log = open(folder.parent / f"{name}.log", "w")  # the builder's stdout and stderr; closed with the test's process
    return start_builder(tiny_request(**limits), log)


def gone(pid: int, start_time: int) -> bool:
    stat = proc_stat(pid)
    return stat is None or stat[2] != start_time


def test_a_second_builder_waits_for_the_lock_then_skips_what_the_first_built(cache):
    """Two builders of the same package start while the lock is held elsewhere: both wait and say so; once it is
    free, one compiles (its measured peak lands in the package's meta) and the other, still waiting meanwhile,
    finds the package on disk and skips it."""
    with build_lock(cache, timeout=0) as held:
        assert held
        builders = [start(cache, "a"), start(cache, "b")]
        wait_until(lambda: all(b.status().get("state") == "waiting for lock" for b in builders), what="both waiting")
        assert "pid" in builders[0].status()["message"]  # names who holds the lock
        assert not list(cache.glob("*.pt2"))
    assert [b.wait(timeout=600) for b in builders] == [0, 0]
    statuses = [b.status() for b in builders]
    assert [s["state"] for s in statuses] == ["done", "done"]
    built = [s for s in statuses if s["built"]]
    skipped = [s for s in statuses if s["skipped"]]
    assert len(built) == 1 and len(skipped) == 1, statuses
    assert skipped[0]["skipped"] == [{"package": "the target's 1 row plain",
                                      "reason": "built by another process while this one waited"}]

    [file] = cache.glob("*.pt2")  # (its key names this process's thread count, not the builder's: found, not keyed)
    meta = json.loads(file.with_suffix(".json").read_text())
    assert meta["compile_s"] > 0 and meta["key"]["recipe"]["rows"] == 1 and meta["key"]["recipe"]["path"] == "plain"
    pair = load_request_pair(tiny_request())
    assert meta["weight_bytes"] == package_weight_bytes(pair.target) > 0  # norms and biases
    assert meta["peak_rss_bytes"] >= meta["rss_before_bytes"] > 0
    assert meta["compile_growth_bytes"] == meta["peak_rss_bytes"] - meta["rss_before_bytes"]
    assert earlier_peaks(cache, meta["key"]) == [(meta["weight_bytes"], meta["compile_growth_bytes"])]


def test_a_package_that_does_not_fit_is_declined_with_a_message(cache):
    """A budget of 1 MiB for the compile: the builder waits for memory (saying so), declines the package, and exits
    cleanly with EXIT_DECLINED and the reason in its status file; nothing is compiled."""
    builder = start(cache, "declined", budget_bytes=1 << 20, memory_wait_s=1.0, memory_poll_s=0.2)
    assert builder.wait(timeout=120) == EXIT_DECLINED
    status = builder.status()
    assert status["state"] == "done" and status["built"] == [] and status["total"] == 1
    [declined] = status["declined"]
    assert declined["package"] == "the target's 1 row plain"
    assert "GiB" in declined["reason"] and "was free for it" in declined["reason"]
    assert declined["reason"] in status["message"]
    log = (cache.parent / "declined.log").read_text()
    assert "waiting for memory: waiting for memory to compile the target's 1 row plain" in log
    assert "Traceback" not in log
    assert not list(cache.glob("*.pt2")) and not list(cache.glob(".tmp-*"))


def test_stop_ends_the_builder_and_says_so(cache):
    with build_lock(cache, timeout=0):
        builder = start(cache, "stopped")
        wait_until(lambda: builder.status().get("state") == "waiting for lock", what="the builder waiting")
        assert builder.stop() == EXIT_STOPPED
        assert builder.stop() == EXIT_STOPPED  # idempotent
    status = builder.status()
    assert status["state"] == "stopped" and status["message"] == "the builder stopped: stopped by its app"


def test_the_builder_and_its_threads_run_at_the_lowest_priority(cache):
    with build_lock(cache, timeout=0):
        builder = start(cache, "nice")
        wait_until(lambda: builder.status().get("state") == "waiting for lock", what="the builder waiting")
        tasks = list(Path(f"/proc/{builder.pid}/task").iterdir())
        niceness = {int(stat_fields(task / "stat")[16]) for task in tasks}
        autogroup = Path(f"/proc/{builder.pid}/autogroup")
        group = autogroup.read_text() if autogroup.exists() else None  # "/autogroup-N nice K" where the kernel has it
        builder.stop()
    assert len(tasks) > 1 and niceness == {NICENESS}  # threads started after Popen returned inherited it
    assert group is None or group.split()[-1] == str(NICENESS)  # its session's group too: else the nice counts for
    # nothing against the app, which is in another session (measured: a first run as slow beside a niced builder)


def test_a_paused_builder_is_stopped_by_the_kernel_continues_and_still_ends(cache):
    with build_lock(cache, timeout=0):
        builder = start(cache, "paused")
        wait_until(lambda: builder.status().get("state") == "waiting for lock", what="the builder waiting")
        builder.pause(True)
        wait_until(lambda: process_state(builder.pid) == "T", what="the builder stopped")
        builder.pause(False)
        wait_until(lambda: process_state(builder.pid) != "T", what="the builder continued")
        builder.pause(True)
        assert builder.stop(grace=30.0) == EXIT_STOPPED  # continued first: a stopped process cannot act on SIGTERM
    assert builder.status()["state"] == "stopped"


def test_the_wait_clock_counts_a_paused_gap_as_one_poll():
    times = iter([100.0, 100.5, 101.0, 131.0, 131.5])  # polls every 0.5 s, then 30 s stopped, then a poll
    clock = WaitClock(poll=0.5, now=lambda: next(times))  # a gap over 2 polls + 1 s counts as 2 s
    assert [clock(), clock(), clock(), clock()] == [0.5, 1.0, 3.0, 3.5]


def test_a_builder_paused_longer_than_its_lock_wait_keeps_waiting(cache):
    with build_lock(cache, timeout=0):
        builder = start(cache, "paused-wait", lock_wait_s=6.0)
        wait_until(lambda: builder.status().get("state") == "waiting for lock", what="the builder waiting")
        builder.pause(True)
        time.sleep(10.0)  # longer than its lock wait: a run decoding for that long
        builder.pause(False)
        time.sleep(1.0)
        state = builder.status().get("state")
        builder.stop()
    assert state == "waiting for lock"  # the paused 10 s counted as one poll's gap, not as 10 s of waiting


def test_a_builder_stopped_while_compiling_leaves_nothing_behind(cache):
    """stop() mid-compile: the builder, its compiler processes and its half-written package are all gone."""
    builder = start(cache, "compiling")
    wait_until(lambda: builder.status().get("state") == "compiling", what="the compile to start")
    wait_until(lambda: descendants(builder.pid), timeout=30, what="a compiler process")
    started = identities(descendants(builder.pid))
    assert builder.stop() == EXIT_STOPPED
    assert builder.status()["state"] == "stopped"
    wait_until(lambda: all(gone(pid, start_time) for pid, start_time in started.items()), timeout=10,
               what="the compiler processes to end")
    assert not list(cache.glob("*.pt2")) and not list(cache.glob(".tmp-*"))


PARENT = textwrap.dedent("""
    import sys, threading, time
    from engine.cli import load_request_pair
    from engine.cpu.builder import build_request, start_builder
    from engine.cpu.aoti import Recipe
    pair = load_request_pair({"target": "tiny-random", "draft": None, "dtype": "float32", "device": "cpu"})
    started = []
    def start():  # in a thread that ends once the builder runs (and has asked for its death signal)
        builder = start_builder(build_request(pair, "tiny-random", None, {"target": [Recipe(1)]}),
                                open(sys.argv[1], "w"))
        while builder.status().get("state") != "waiting for lock":
            time.sleep(0.1)
        started.append(builder)
    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
    print(started[0].pid, flush=True)
    if sys.argv[2] == "killed":
        time.sleep(600)  # the test kills this process
    elif sys.argv[2] == "exits later":
        sys.stdin.readline()  # the test says when
""")


@pytest.mark.parametrize("how", ["exits", "killed", "exits later"])
def test_a_builder_ends_with_the_app_that_started_it(cache, how):
    """A parent starts a builder from a thread that then ends (the builder lives on: its app does), the builder
    waits for the lock the test holds, and the parent ends, normally or by SIGKILL (no atexit, no stop()): the
    builder is gone within seconds and its status says why."""
    with build_lock(cache, timeout=0):
        parent = subprocess.Popen([sys.executable, "-c", PARENT, str(cache.parent / "child.log"), how],
                                  cwd=REPOSITORY, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        pid = int(parent.stdout.readline())
        start_time = proc_stat(pid)[2]
        if how == "exits later":
            time.sleep(2.0)  # the starting thread ended long ago; the parent lives, so does the builder
            assert not gone(pid, start_time)
            assert json.loads((cache.parent / "child.status.json").read_text())["state"] == "waiting for lock"
            parent.stdin.write("end\n")
            parent.stdin.flush()
        if how == "killed":
            parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=60)
        wait_until(lambda: gone(pid, start_time), timeout=15, what="the orphaned builder to end")
    status = json.loads((cache.parent / "child.status.json").read_text())
    assert status["state"] == "stopped" and status["message"] == "the builder stopped: its app ended"


def test_the_watchdog_notices_a_parent_that_is_not_there():
    """The death signal's fallback: a parent pid that is not this process's parent counts as gone."""
    seen = []
    thread = watch_parent(os.getppid() + 1_000_000, seen.append, interval=0.05)
    thread.join(timeout=5)
    assert seen == ["its app ended"]


def test_the_estimate_uses_what_earlier_builds_of_the_model_measured(tmp_path):
    gib = 1 << 30
    assert compile_peak_estimate(4 * gib, []) > 4 * gib + DEFAULT_PEAK_FIXED  # nothing measured: more than the weights
    assert compile_peak_estimate(0, [], layers=28) > 2.9 * gib  # a 28-layer graph: what the fp32 1.5B target grew by
    measured = [(2 * gib, 3 * gib), (1 * gib, 1 * gib)]
    assert compile_peak_estimate(2 * gib, measured) >= 3 * gib  # the largest growth
    assert compile_peak_estimate(4 * gib, measured) >= 6 * gib  # scaled up with the weights
    assert compile_peak_estimate(gib // 2, measured) >= 3 * gib  # never scaled down
    # from the metas of this model and dtype only
    key = {"model": "m", "dtype": "float32"}
    for name, model, dtype, extra in (("a", "m", "float32", {"weight_bytes": 10, "compile_growth_bytes": 30}),
                                      ("b", "other", "float32", {"weight_bytes": 1, "compile_growth_bytes": 99}),
                                      ("c", "m", "bfloat16", {"weight_bytes": 1, "compile_growth_bytes": 98}),
                                      ("d", "m", "float32", {})):  # built before growth was recorded
        file = tmp_path / f"{name}.pt2"
        write_meta(file, {"model": model, "dtype": dtype}, 1.0)
        meta = json.loads(file.with_suffix(".json").read_text())
        file.with_suffix(".json").write_text(json.dumps({**meta, **extra}))
    assert earlier_peaks(tmp_path, key) == [(10, 30)]
