"""A measurement made beside other work is never cached (engine/measure/quiet.py): the verdict on exact numbers, then
real busy processes around the format probe, the cost table and the bandwidth probe, through their production code."""
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from engine.cpu import formats as formats_mod
from engine.measure import costs as costs_mod
from engine.measure import quiet
from engine.measure.quiet import Sharing, watch_cpu
from engine.models import tiny_random_pair

linux = pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="reads /proc (Linux)")


@pytest.fixture(autouse=True)
def private_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TREEVIZ_CACHE", str(tmp_path))


@contextmanager
def busy_cores():
    """One spinning process per core this process may use, for the length of the block."""
    cores = len(os.sched_getaffinity(0))
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
    try:
        time.sleep(0.5)  # every burner running before the window opens
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


def test_the_verdict_counts_only_work_that_takes_a_core_from_the_threads():
    # 2 cores, 2 threads: nothing is spare, 0.15 cores of other work is tolerated (plus 3 ticks of rounding)
    assert not Sharing(others_s=1.0, wall_s=10.0, threads=2, cores=2).disturbed
    assert Sharing(others_s=2.0, wall_s=10.0, threads=2, cores=2).disturbed
    # 16 cores, 2 threads: 10 cores of other work leave the threads theirs
    assert not Sharing(others_s=100.0, wall_s=10.0, threads=2, cores=16).disturbed
    assert Sharing(others_s=150.0, wall_s=10.0, threads=2, cores=16).disturbed
    # a window shorter than SHORTEST is not judged: the 10 ms tick cannot tell
    assert not Sharing(others_s=5.0, wall_s=quiet.SHORTEST / 2, threads=2, cores=2).disturbed
    assert Sharing(others_s=3.0, wall_s=1.5, threads=1, cores=2).others_cores == 2.0


@linux
def test_a_window_beside_spinning_processes_is_disturbed():
    with busy_cores(), watch_cpu() as watch:
        time.sleep(1.5)
    assert watch.sharing is not None and watch.disturbed, watch.sharing


def slowed(function, seconds: float = 1.5):
    """`function`, taking at least `seconds` longer: a window SHORTEST can judge, on a tiny model."""
    def call(*args, **kwargs):
        time.sleep(seconds)
        return function(*args, **kwargs)
    return call


@linux
def test_a_format_probe_beside_other_work_serves_its_load_and_is_not_cached(monkeypatch):
    model = tiny_random_pair(None, seed=0, packed=True).target
    from engine.cpu.kernels import route_linears
    route_linears(model)
    monkeypatch.setattr(formats_mod, "_probe", slowed(formats_mod._probe))
    with busy_cores():
        first = formats_mod.choose_formats(model, "tiny", ["plain", "mkl", "packed"])
    assert first.measured and first.disturbed and first.groups  # its verdict still routes this load
    pair = tiny_random_pair(None, seed=0)
    pair.formats["target"] = first
    assert "target's format probe" in pair.describe() and "measured again at the next start" in pair.describe()
    key = formats_mod.probe_key(model, "tiny", model.dtype, [p for p in ["plain", "mkl", "packed"]
                                                            if formats_mod.format_unavailable(p, torch.device("cpu"),
                                                                                              model.dtype) is None])
    assert costs_mod.read_cached(key) is None
    assert formats_mod.choose_formats(model, "tiny", ["plain", "mkl", "packed"]).measured  # probed again


@linux
def test_a_cost_table_beside_other_work_is_measured_again_next_time():
    model = tiny_random_pair(None, seed=0).target
    calls = []

    def measure(model, paths, prefix=costs_mod.PREFIX):
        calls.append(prefix)
        time.sleep(1.5)
        return {p: {r: 1e-3 * r for r in costs_mod.LADDER} for p in paths}

    with busy_cores():
        first = costs_mod.model_costs(model, "tiny", torch.float32, torch.device("cpu"), measure_fn=measure)
    assert first.measured and first.disturbed
    report = costs_mod.format_costs(costs_mod.PairCosts(first, None))
    assert "measured beside other work" in report
    fresh = len(calls)
    second = costs_mod.model_costs(model, "tiny", torch.float32, torch.device("cpu"), measure_fn=measure)
    assert second.measured and len(calls) == 2 * fresh


@linux
def test_the_bandwidth_probe_beside_other_work_is_not_cached(monkeypatch):
    monkeypatch.setattr(costs_mod, "stream_bandwidth", slowed(lambda device: 1e10))
    cpu = torch.device("cpu")
    with busy_cores():
        assert costs_mod.machine_bandwidth(cpu) == 1e10
    monkeypatch.setattr(costs_mod, "stream_bandwidth", lambda device: 2e10)
    assert costs_mod.machine_bandwidth(cpu) == 2e10  # measured again, not read from a cache
