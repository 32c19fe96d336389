"""What the app's run path needs from the engine: a DecodeRun that can be resumed on a different thread at every
step (Gradio runs each step of a sync generator handler in a worker thread) and still decodes exactly, and a partial
RunResult snapshot whose numbers are engine.measure.metrics' over the iterations so far."""
from __future__ import annotations

import threading

import pytest
import torch

from engine.decoder import Decoder
from engine.measure.metrics import compare_outputs, run_metrics
from engine.models import tiny_random_pair
from engine.strategies import make_strategy


@pytest.fixture(scope="module")
def pair():
    return tiny_random_pair(dtype=torch.float32)


def step_on_new_thread(it):
    """One step of the run on a fresh thread; (record or None, was inference mode left on in that thread)."""
    box = []
    worker = threading.Thread(target=lambda: box.append((next(it, None), torch.is_inference_mode_enabled())))
    worker.start()
    worker.join()
    return box[0]


@pytest.mark.parametrize("strategy", ["linear", "dynatree"])
def test_a_run_resumed_on_other_threads_stays_exact(pair, strategy):
    ar = Decoder(pair, make_strategy("ar")).generate("def f(n):", max_new_tokens=32)
    run = Decoder(pair, make_strategy(strategy)).run("def f(n):", max_new_tokens=32)
    it = iter(run)
    steps = 0
    for _ in range(100):
        record, leaked = step_on_new_thread(it)
        assert not leaked  # the step's inference mode ended with the step, not left on in a pooled thread
        if record is None:
            break
        steps += 1
    assert run.result is not None and steps == run.result.metrics.iterations
    assert compare_outputs(run.result, ar).exact_match


def test_snapshot_is_the_run_so_far(pair):
    run = Decoder(pair, make_strategy("dynatree")).run("def f(n):", max_new_tokens=32)
    assert run.snapshot() is None  # before the prefill
    it = iter(run)
    next(it)
    next(it)
    snap = run.snapshot()
    assert len(snap.iterations) == 2 and snap.stop_reason == ""
    assert snap.metrics == run_metrics(snap.iterations, len(snap.output_ids), snap.metrics.total_s, snap.metrics.ttft_s)
    assert len(snap.token_sources) == len(snap.output_ids) and all(s.text is not None for s in snap.token_sources)
    for _ in it:
        pass
    assert len(snap.iterations) == 2  # the snapshot kept its own lists while the run went on
    assert run.snapshot() is run.result and run.result.output_ids[: len(snap.output_ids)] == snap.output_ids


def test_time_the_consumer_holds_the_run_is_not_decoding_time(pair):
    """The app draws figures between steps; that time must not lower the run's tokens/s (AR runs silently)."""
    import time
    run = Decoder(pair, make_strategy("linear")).run("def f(n):", max_new_tokens=12)
    started = time.perf_counter()
    steps = 0
    for _ in run:
        steps += 1
        time.sleep(0.05)  # a consumer's work between steps
        if steps == 1:
            snap = run.snapshot()
    wall = time.perf_counter() - started
    assert steps >= 2 and run.paused_s >= 0.05 * steps
    assert run.result.metrics.total_s <= wall - run.paused_s  # the consumer's time is not in the run's
    assert snap.metrics.total_s <= run.result.metrics.total_s
