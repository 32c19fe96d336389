"""The teaching tabs through gradio_client on the tiny random pair: /race (AR measured fresh, lane times = the runs'
measured decode times), /sweep (progress, values, errors, Stop), and the record-only panels (step-through,
histograms, entropy sizes, the HTML download) on a gallery trace with no model involved."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

gradio_client = pytest.importorskip("gradio_client")
from gradio_client import Client  # noqa: E402

from test_ui_support import app_url, backend  # noqa: E402

RACE_PLOT, RACE_STATUS, RACE_SUMMARY = range(3)     # /race outputs (the runs' state is not sent to API callers)
SWEEP_PLOT, SWEEP_STATUS, SWEEP_SUMMARY = range(3)  # /sweep outputs
GALLERY = Path(__file__).resolve().parent.parent / "assets" / "traces" / "default_code_dynatree_cpu.json"


@pytest.fixture(scope="module")
def client():
    return Client(app_url(), verbose=False)


def plot_data(value) -> dict:
    assert isinstance(value, dict) and value.get("type") == "plotly", value
    return json.loads(value["plot"])


def race_args(prompt: str, **kw) -> dict:
    return {"prompt": prompt, "chat": False, "pair": "tiny-random", "strategies": ["dynatree"],
            "max_new_tokens": 64, **kw}


def sweep_args(prompt: str, **kw) -> dict:
    return {"prompt": prompt, "chat": False, "pair": "tiny-random", "strategy": "dynatree", "preset": "cpu",
            "params": {}, "max_new_tokens": 16, "size_min": 2, "size_max": 8, "points": 3, **kw}


# -- the race --------------------------------------------------------------------------------------------------------
def test_race_two_lanes_winner_and_lane_times_are_decode_times(client):
    prompt = "def race_me(n):\n"
    client.predict(prompt, False, "tiny-random", "linear", "cpu", 64, api_name="/run")  # AR now in the cache
    job = client.submit(**race_args(prompt), api_name="/race")
    plot, status, summary = job.result(timeout=180)
    statuses = " ".join(str(o[RACE_STATUS]) for o in job.outputs())
    assert "decoding AR unobserved (1 of 2)" in statuses  # measured fresh though the cache had it
    assert statuses.index("warming up 2 lanes") < statuses.index("decoding AR unobserved")  # untimed warm-up first
    assert not any(o[RACE_PLOT] not in (None, {"__type__": "update"}) for o in job.outputs()[:-1]), \
        "a race draws nothing while its lanes decode"
    lanes = summary["lanes"]
    assert [lane["label"] for lane in lanes] == ["AR", "dynatree"]
    assert summary["winner"] in ("AR", "dynatree") and summary["ar_reused"] is False
    ar, tree = lanes
    for lane in lanes:  # the lane times shown are the runs' measured decode times (engine.measure.metrics's total_s)
        assert lane["tokens"] == ar["tokens"] > 1 and lane["matches_ar"] is True
        assert lane["decode_s"] == pytest.approx(lane["tokens"] / lane["tokens_per_s"], rel=0.05)
        # the replay's last token lands at the measured decode time (engine.measure.timeline spreads the loop's
        # bookkeeping)
        assert lane["finish_s"] == pytest.approx(lane["decode_s"], rel=0.05), lane
    assert tree["speedup_vs_ar"] == pytest.approx(ar["decode_s"] / tree["decode_s"], rel=0.05)
    assert "fair measurement" in status and "AR measured fresh" in status and "winner" in status
    assert f"{tree['speedup_vs_ar']:.2f}× AR" in status
    fig = plot_data(plot)
    assert len(fig["frames"]) >= 10 and "dynatree" in json.dumps(fig["data"])
    assert not backend().pairs.run_lock.locked()


def test_race_refuses_bad_input_in_plain_words(client):
    cases = [(race_args("def f():\n", strategies=["warp-drive"]), "Unknown strategy 'warp-drive'"),
             (race_args("   "), "The prompt is empty"),
             (race_args("def f():\n", strategies=[]), "Tick at least one strategy"),
             (race_args("def f():\n", strategies=["dynatree@turbo"]), "no preset 'turbo'")]
    for args, message in cases:
        with pytest.raises(Exception) as err:
            client.predict(**args, api_name="/race")
        assert message in str(err.value) and "Traceback" not in str(err.value), str(err.value)


# -- the sweep -------------------------------------------------------------------------------------------------------
def test_sweep_values_and_progress(client):
    job = client.submit(**sweep_args("def sweep_me(n):\n"), api_name="/sweep")
    plot, status, sweep = job.result(timeout=300)
    progress = [str(o[SWEEP_STATUS]) for o in job.outputs() if "runs done" in str(o[SWEEP_STATUS])]
    assert any("1 of 4 runs done" in s for s in progress) and any("3 of 4 runs done" in s for s in progress)
    assert sweep["complete"] is True and sweep["param"] == "budget" and sweep["values"] == [2, 4, 8]
    assert [p["size"] for p in sweep["points"]] == [2, 4, 8] and sweep["ar"]["tokens_per_s"] > 0
    assert all(p["new_tokens"] == 16 and 0 <= p["acceptance_rate"] <= 1 for p in sweep["points"])
    assert sweep["peak"] in (2, 4, 8) and f"budget = {sweep['peak']}" in status and "sweep done" in status
    names = {t.get("name") for t in plot_data(plot)["data"]}
    assert {"L̄", "acceptance", "measured tokens/s"} <= names
    again = client.predict(**sweep_args("def sweep_me(n):\n"), api_name="/sweep")  # the same sweep: from the cache
    assert again[SWEEP_SUMMARY]["cached"] is True and again[SWEEP_SUMMARY]["points"] == sweep["points"]


def test_sweep_refuses_bad_ranges_in_plain_words(client):
    from treeviz.page.teaching_handlers import SWEEP_TOKEN_BUDGET
    cases = [(sweep_args("def f():\n", size_min=8, size_max=8), "empty range"),
             (sweep_args("def f():\n", size_min=0, size_max=8), "must stay within"),
             (sweep_args("def f():\n", max_new_tokens=512, size_min=2, size_max=64, points=12),
              f"the limit is {SWEEP_TOKEN_BUDGET}"),
             (sweep_args("def f():\n", points=40), "greater than maximum value 12"),  # the slider's bound
             (sweep_args("def f():\n", strategy="nope"), "nope is not in the list of choices"),  # the dropdown's check
             (sweep_args("def f():\n", strategy="delayed"), "no size knob"),
             (sweep_args(""), "The prompt is empty")]
    for args, message in cases:
        with pytest.raises(Exception) as err:
            client.predict(**args, api_name="/sweep")
        assert message in str(err.value) and "Traceback" not in str(err.value), (message, str(err.value))


def test_stop_ends_a_sweep_and_the_pair_stays_usable(client):
    job = client.submit(**sweep_args("def stop_my_sweep(n):\n", max_new_tokens=400, size_min=2, size_max=64,
                                     points=6), api_name="/sweep")
    deadline = time.time() + 120
    while time.time() < deadline and not any("1 of 7 runs done" in str(o[SWEEP_STATUS]) for o in job.outputs()):
        time.sleep(0.05)
    assert not job.done(), "the sweep ended before Stop: make it longer"
    assert "stopped" in client.predict(api_name="/stop")
    while not job.done() and time.time() < deadline:
        time.sleep(0.05)
    assert job.done()
    statuses = [str(o[SWEEP_STATUS]) for o in job.outputs()]
    assert not any("sweep done" in s for s in statuses), statuses[-1]
    for _ in range(40):  # the cancelled sweep lets go of the pair at its next iteration
        if not backend().pairs.run_lock.locked():
            break
        time.sleep(0.05)
    assert not backend().pairs.run_lock.locked()
    out = client.predict(**sweep_args("def after_stop(n):\n", max_new_tokens=8, points=2), api_name="/sweep")
    assert out[SWEEP_SUMMARY]["complete"] is True


# -- the record-only panels: a gallery trace, no model -------------------------------------------------------------
def test_step_through_histogram_entropy_and_html_from_a_gallery_trace(tmp_path):
    from engine.core.trace import load_run
    from treeviz.page.teaching_ui import download_html
    from treeviz.page.views import iteration_panels, shown_tree
    run = load_run(GALLERY)
    index = next(i for i, it in enumerate(run.iterations) if it.accepted and it.drafted > it.accepted)
    step, histogram, tree = iteration_panels(run, index, False)
    labels = [s["label"] for s in step.layout.sliders[0].steps]
    assert labels[0] == "root" and labels[1].startswith("draft") and labels[-1] == "commit"
    assert any(label.startswith("verify") for label in labels)
    assert f"iteration {run.iterations[index].index}," in step.layout.title.text
    counts = histogram.data[0].customdata
    assert sum(counts) == len(run.iterations) and counts[run.iterations[index].accepted] >= 1
    sized = shown_tree(run, index, True)
    sizes = [s for t in sized.data if t.mode and "markers" in t.mode and isinstance(t.marker.size, tuple)
             for s in t.marker.size]
    assert len(set(sizes)) > 1 and "entropy" in sized.layout.title.text  # per-node sizes, not one per outcome
    plain = shown_tree(run, index, False)
    assert all(not isinstance(t.marker.size, tuple) for t in plain.data if t.mode and "markers" in t.mode)
    path = Path(download_html(None, run, index))
    page = path.read_text(encoding="utf-8")
    assert path.suffix == ".html" and "tv-step" in page and "tv-replay" in page and "tv-race" not in page


def test_a_runs_last_update_carries_the_panels_at_the_scrubbed_iteration():
    """Nothing re-renders after a Run: its last event carries every view and both teaching panels, at the iteration
    the user scrubbed to while AR was measured (the page's state), with the tree sized by entropy when the switch is
    on; a fresh Finished shows the last iteration."""
    from engine.core.trace import load_run
    from treeviz.page.handlers import RUN_VIEW_OUTPUTS, RunView
    from treeviz.serving.events import BaselineMeasured, Finished
    from treeviz.serving.server import PageState
    run, page = load_run(GALLERY), PageState()
    view = RunView(None, "per iteration", page)
    named = dict(zip(RUN_VIEW_OUTPUTS, view.update(Finished(run, None))))
    last = len(run.iterations) - 1
    assert f"iteration {last}," in named["step_plot"].layout.title.text and named["scrubber"]["value"] == last
    page.shown, page.node, page.entropy = 1, 1, True  # what scrubbing, a node click, the entropy switch write
    named = dict(zip(RUN_VIEW_OUTPUTS, view.update(BaselineMeasured(run, run))))
    assert "iteration 1," in named["step_plot"].layout.title.text and "entropy" in named["tree"].layout.title.text
    assert named["node"] == 1
    assert named["scrubber"] == {"__type__": "update"}  # left where the user put it
    assert sum(named["acceptance"].data[0].customdata) == len(run.iterations)


def test_compare_shows_acceptance_histograms(client):
    out = client.predict("def compare_hist(n):\n", False, "tiny-random", "dynatree", "cpu", 12,
                         methods=["dynatree", "linear"], api_name="/compare")
    bars = [t for t in plot_data(out[17])["data"] if t["type"] == "bar"]
    assert {t["name"] for t in bars} == {"dynatree", "linear"}


# -- in a real headless Chromium -------------------------------------------------------------------------------------
