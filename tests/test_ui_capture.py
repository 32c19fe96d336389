"""The app's first start with captured steps: the pair serves eager runs at once, its packages are compiled by
another process in the background, then loaded and measured between runs, and runs switch to them; a second start
finds them built and loads them before its first run. (Minutes of compiling on a fresh cache: the tiny pair's packages;
how many depends on which of its draft's row counts this machine routes to quantised kernels.)"""
from __future__ import annotations

import re
import time

from engine.recipe import RunSpec, generate
from procs import process_state, wait_until
from treeviz.serving.ar_cache import ARCache
from treeviz.serving.pairs import PairManager
from treeviz.serving.server import Server

SPEC = RunSpec(pair="tiny-random", prompt="def tree(n):", strategy="dynatree", max_new_tokens=12,
               stop_on_eos=False)


def wait_for_capture(pairs: PairManager, timeout: float = 900.0) -> None:
    deadline = time.monotonic() + timeout
    while pairs.status().capture and time.monotonic() < deadline:
        time.sleep(1.0)
    assert not pairs.status().capture, pairs.status().capture


def test_first_start_serves_eagerly_then_switches_to_captured_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("TREEVIZ_CACHE", str(tmp_path))
    pairs = PairManager(capture="auto")
    pairs.load("tiny-random")  # this thread: load, then the builder process starts in the background
    pair = pairs.pair
    assert pair.capture == "aoti" and not pair.capture_ready
    assert re.search(r"compiling \d+ captured step\(s\) in the background", pairs.status().capture)
    eager = generate(pair, SPEC)
    assert eager.config.steps == "eager"  # a run while the packages compile: eager, and says so
    with pairs.run_lock:  # a run decoding: the builder and its compilers are paused, and the page says so
        wait_until(lambda: process_state(pairs.builder.pid) == "T", 10.0, "the builder paused")
        wait_until(lambda: "paused while a run decodes" in pairs.status().capture, 10.0, "the page told")
    wait_until(lambda: process_state(pairs.builder.pid) != "T", 10.0, "the builder continued")

    wait_for_capture(pairs)
    loaded = {role: len(c.packages) for role, c in pair.captured.items()}
    assert loaded.get("target") and loaded.get("draft"), loaded  # built by the other process, loaded here
    assert "captured (AOTInductor)" in pairs.status().description
    # which row counts the packages serve is the measurement's call (only where faster than eager; on a tiny model
    # that is machine noise); what a run takes must say which, and a captured run must match the eager one
    assert generate(pair, SPEC).config.steps == ("captured (AOTInductor)" if pair.capture_ready else "eager")
    for captured in pair.captured.values():
        captured.serve_all()  # every row count through its package: the captured path, whatever it measured
    captured_run = generate(pair, SPEC)
    assert captured_run.config.steps.startswith("captured (AOTInductor)")
    assert captured_run.output_ids == eager.output_ids
    assert list((tmp_path / "captured").glob("*.pt2")), "the packages are on disk for the next start"

    # an AR measured eagerly never stands in for the captured one (and the other way round)
    backend = Server()
    backend.pairs.loaded_name = "tiny-random"
    off = RunSpec(**{**SPEC.__dict__, "capture": "off"})
    assert backend.ar_key(pair, SPEC) != backend.ar_key(pair, off)
    assert ARCache.key("p", "bf16", SPEC, "eager") != ARCache.key("p", "bf16", SPEC, "captured")

    again = PairManager(capture="auto")  # a second start: everything built, loaded before the first run
    again.load("tiny-random")
    assert not again.status().capture  # no builder started
    assert all(c.packages for c in again.pair.captured.values())
    info = again.pair.capture_info
    assert all(p["compile_s"] is None for role in info.values() for p in role["packages"])  # nothing compiled
    expected = "captured (AOTInductor)" if again.pair.capture_ready else "eager"
    assert generate(again.pair, SPEC).config.steps == expected
