"""Hosting shape and bad input: the ZeroGPU-decorated handlers pickle, Space errors read plainly, oversized and
deeply nested uploads are refused plainly, and 8 clients at once all complete (tiny random pair, 127.0.0.1 only)."""
from __future__ import annotations

import concurrent.futures
import pickle

import gradio as gr
import pytest

gradio_client = pytest.importorskip("gradio_client")
spaces = pytest.importorskip("spaces")
from gradio_client import Client, handle_file  # noqa: E402
from spaces.zero.gradio import error as zero_gpu_error  # noqa: E402  (how `spaces` builds its errors)

from test_ui_support import app_url, backend  # noqa: E402
from engine.recipe import RunSpec  # noqa: E402
from treeviz.page import handlers  # noqa: E402
from treeviz.page.replay import MAX_TRACE_MB  # noqa: E402
from treeviz.serving import work  # noqa: E402
from treeviz.serving.events import BaselineMeasured, Finished, Iteration  # noqa: E402
from treeviz.serving.gpu import is_zero_gpu_error, zero_gpu_message  # noqa: E402

STATUS, TREE = 1, 3


def test_decorated_run_work_arguments_and_events_pickle():
    """On ZeroGPU, decode_events runs in a forked worker: its arguments and every event cross by pickle, and the
    handler renders them on this side."""
    backend().pairs.load("tiny-random")  # the pair the work reads from the process-wide backend
    spec = RunSpec(pair="tiny-random", prompt="def f(n):\n", strategy="dynatree", max_new_tokens=40)
    args = (spec, backend().open("pickle-session", "run").ticket())
    pickle.loads(pickle.dumps(args))
    events = list(work.decode_events(*args))
    for event in events:
        assert type(pickle.loads(pickle.dumps(event))) is type(event)
    assert isinstance(events[-1], (Finished, BaselineMeasured))
    assert events[-1].result.iterations and events[-1].ar.strategy == "ar"  # the run and its AR baseline
    assert any(isinstance(e, Iteration) for e in events[:-1])  # trees streamed before the end


def test_decorated_compare_work_arguments_and_events_pickle():
    backend().pairs.load("tiny-random")
    args = (RunSpec(pair="tiny-random", prompt="hello", strategy="linear", max_new_tokens=12), ["linear", "fixed"],
            backend().open("pickle-compare", "run").ticket())
    pickle.loads(pickle.dumps(args))
    events = list(work.compare_events(*args))
    for event in events:
        pickle.loads(pickle.dumps(event))
    finished = [e for e in events if isinstance(e, Finished)]
    assert [e.result.strategy for e in finished] == ["ar", "linear", "fixed"]


def test_zero_gpu_errors_read_plainly():
    quota = zero_gpu_error("ZeroGPU quota exceeded", "You have exceeded your GPU quota (60s requested vs. 12s left). "
                           "<a href='https://huggingface.co/join'>Sign up</a> for more.", html=True)
    aborted = zero_gpu_error("ZeroGPU worker error", "GPU task aborted")
    assert is_zero_gpu_error(quota) and is_zero_gpu_error(aborted)
    assert not is_zero_gpu_error(gr.Error("The prompt is empty"))
    text = zero_gpu_message(quota)
    assert text.startswith("ZeroGPU quota exceeded: You have exceeded") and "<a" not in text and "Sign up" in text
    assert "GPU time slot" in zero_gpu_message(aborted)


def test_run_shows_a_zero_gpu_error_as_a_status_line(monkeypatch):
    """ZeroGPU's scheduler raises from the decorated call (here: its own error, raised where it would be)."""
    def refused(spec, ticket):
        raise zero_gpu_error("ZeroGPU quota exceeded", "You have exceeded your GPU quota (60s requested vs. 12s left).")
        yield  # a generator, like the decorated work

    monkeypatch.setattr(handlers, "decode_events", refused)
    backend().pairs.load("tiny-random")
    request = gr.Request(username=None)
    request.session_hash = "quota-session"
    outputs = list(handlers.run("hi", False, "tiny-random", "linear", "cpu", 8, 0.0, 1.0, 0, 0, "auto", {},
                                "per iteration", request))
    assert "ZeroGPU quota exceeded" in outputs[-1][3] and "err" in outputs[-1][3]


@pytest.fixture(scope="module")
def client():
    return Client(app_url(), verbose=False)


def test_oversized_trace_upload_is_refused_plainly(client, tmp_path):
    big = tmp_path / "big.json"
    with big.open("w") as f:
        f.write('{"schema_version": 1, "pad": "')
        f.write("x" * (MAX_TRACE_MB * 1024 * 1024 + 1))
        f.write('"}')
    out = client.predict(handle_file(str(big)), "per iteration", api_name="/upload")
    assert "Cannot replay" in out[STATUS] and f"up to {MAX_TRACE_MB} MB" in out[STATUS]


def test_deeply_nested_json_upload_is_a_plain_message(client, tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    out = client.predict(handle_file(str(deep)), "per iteration", api_name="/upload")
    assert "nested too deeply" in out[STATUS] and "Recursion" not in out[STATUS]


def test_eight_clients_at_once_all_complete():
    """Eight sessions run at once on the tiny pair: they queue on the pair's lock and all finish."""
    url = app_url()

    def one(i: int) -> str:
        c = Client(url, verbose=False)
        return c.predict(f"def f{i}(n):\n", False, "tiny-random", "linear", "cpu", 16, api_name="/run")[STATUS]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(one, range(8), timeout=300))
    assert all("16 tokens in" in s for s in statuses), statuses
