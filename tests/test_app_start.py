"""scripts/app_start.py measures a start of the app from outside and ends every process it started.

The first test runs the script on the tiny pair (the app as a real process, /run through gradio_client, captured
steps off, so the captured-steps line never comes and the short wait for it times out): half a minute, most of it
the app's own start. The others check the log watch on a real stream and the ending on a process tree that
resists it.
"""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from engine.cpu.build_guard import proc_stat
from scripts.app_start import SERVING, UNAVAILABLE, App, LogWatch

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gone(pid: int, start_ticks: int) -> bool:
    stat = proc_stat(pid)
    return stat is None or stat[2] != start_ticks


def test_a_start_of_the_tiny_app_is_measured_and_ended(tmp_path):
    out = tmp_path / "start.json"
    env = {**os.environ, "TREEVIZ_CAPTURE": "off"}
    done = subprocess.run([sys.executable, "-m", "scripts.app_start", "--pair", "tiny-random", "--cache",
                           str(tmp_path / "cache"), "--capture-timeout", "1", "--max-new-tokens", "8",
                           "--log-dir", str(tmp_path / "logs"), "--json", str(out), "--pss"],
                          cwd=REPOSITORY, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    [start] = report["starts"]
    assert 0 < start["page_s"] < start["first_tree_s"] <= start["run_done_s"] and "run_error" not in start
    assert start["captured"]["state"] == "timeout"  # captured steps off: the line never comes
    memory = start["memory"]
    assert memory["peak_total_bytes"] > 0 and memory["samples"] > 0
    assert start["app_pid"] in [p["pid"] for p in memory["peak_processes"]]
    assert memory["hwm_sum_bytes"] >= memory["peak_total_bytes"]
    assert 0 < memory["peak_pss_total_bytes"] <= memory["hwm_sum_bytes"]  # Pss <= Rss <= each process's own peak
    assert start["ended"]["outlived_app"] == [] and start["ended"]["left_alive"] == []
    assert all(gone(p["pid"], p["start_ticks"]) for p in memory["processes"])  # nothing it started lives on
    assert report["emulation"]["TREEVIZ_CAPTURE"] == "off" and "ATEN_CPU_CAPABILITY" in report["emulation"]
    assert report["cpu"]["capability"]
    assert report["cpu"]["model"] and report["date"] and "scripts.app_start" in " ".join(report["command"])
    assert (tmp_path / "cache").is_dir()  # --cache reached the app as TREEVIZ_CACHE
    assert "first start: page" in done.stdout


def test_the_log_watch_finds_the_captured_steps_line(tmp_path):
    for line, state in ((f"2026 treeviz INFO {SERVING} target rows 1-64, draft rows 1-8", "serving"),
                        (f"2026 treeviz WARNING {UNAVAILABLE}, runs stay eager (no memory)", "unavailable")):
        stream = io.StringIO(f"loading\nready in 3.0 s\n{line}\n{SERVING} a later line\n")
        watch = LogWatch(stream, tmp_path / "app.log", time.monotonic()).start()
        watch.join(timeout=5)
        assert watch.seen.is_set() and watch.captured["state"] == state and watch.captured["line"] == line
        assert watch.captured["s"] >= 0
    assert "ready in 3.0 s" in (tmp_path / "app.log").read_text()


TREE = textwrap.dedent("""
    import subprocess, sys, time
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    subprocess.Popen([sys.executable, "-c", stubborn], start_new_session=True)  # leaves the group, ignores SIGTERM
    subprocess.Popen(["sleep", "600"])                                         # stays in the group
    print("started", flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("sigint", ["default", "ignored"])  # ignored: as in a background job of a script
def test_ending_reaches_a_grandchild_that_left_the_group_and_ignores_sigterm(tmp_path, sigint):
    before = signal.getsignal(signal.SIGINT)
    if sigint == "ignored":
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # what the app would inherit
    try:
        app = App([sys.executable, "-c", TREE], dict(os.environ), tmp_path / "tree.log")
    finally:
        signal.signal(signal.SIGINT, before)
    deadline = time.monotonic() + 30
    while len(app.tree.members()) < 3:
        assert time.monotonic() < deadline, "the tree never grew"
        time.sleep(0.1)
    time.sleep(0.5)  # the stubborn child's handler is set
    app.tree.sample()
    ended = app.end(grace=5.0)  # a loaded machine (CI beside other work) takes a while to run the handler
    assert ended["app_ended_by"] == "SIGINT" and ended["left_alive"] == []
    [stubborn] = ended["outlived_app"]
    assert "SIG_IGN" in stubborn["command"] and ended["needed_sigkill"] == [stubborn["pid"]]
    assert all(gone(p["pid"], p["start_ticks"]) for p in app.tree.report()["processes"])
