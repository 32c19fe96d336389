"""The app through gradio_client, launched in-process on 127.0.0.1 with the tiny random pair (no downloads)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

gradio_client = pytest.importorskip("gradio_client")
from gradio_client import Client, handle_file  # noqa: E402

from engine.strategies import STRATEGIES  # noqa: E402
from test_ui_support import app_url, backend  # noqa: E402
from treeviz.page.controls import verifier_choices  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# /run and /upload outputs (views.RUN_OUTPUTS), states excluded by the client; /compare adds three more
(SCRUBBER, STATUS, DOWNLOAD, TREE, TEXT, METRICS, CHARTS, THROUGHPUT, BADGE, NODE, INSPECTOR, INSPECTOR_PLOT,
 CALIBRATION, COSTS, COMPARE_TABLE, COMPARE_PLOT, COMPARE_CALIBRATION) = range(17)


@pytest.fixture(scope="module")
def client():
    return Client(app_url(), verbose=False)


def is_plot(value) -> bool:
    return isinstance(value, dict) and value.get("type") == "plotly"  # not a skipped (unchanged) output


def plot_data(value) -> dict:
    assert isinstance(value, dict) and value.get("type") == "plotly", value
    return json.loads(value["plot"])


def tree_nodes(value) -> int:
    return sum(len(t.get("x", [])) for t in plot_data(value)["data"] if "markers" in t.get("mode", ""))


def latest(outputs: list, index: int):
    """What the page shows in output `index` after a streamed call: its last value that was not "unchanged"."""
    return next(o[index] for o in reversed(outputs) if o[index] != {"__type__": "update"})


def test_run_prompt_gives_tree_and_metrics(client):
    job = client.submit("def fib(n):\n", False, "tiny-random", "dynatree", "cpu", 24, api_name="/run")
    out = job.result(timeout=120)  # the last value holds every view (the scrubber stays where the user left it)
    assert "tokens/s" in out[STATUS] and "Traceback" not in out[STATUS]
    assert tree_nodes(out[TREE]) >= 2
    assert "tokens/s" in out[METRICS] and "L̄" in out[METRICS]
    assert "AR" in out[BADGE]
    assert latest(job.outputs(), SCRUBBER)["maximum"] >= 1
    names = {t.get("name") for t in plot_data(out[CHARTS])["data"]}
    trace = json.loads(Path(out[DOWNLOAD]).read_text())
    assert f"L̄ = {trace['metrics']['mean_tokens_per_iter']:.2f} (run)" in names  # the engine's L̄, not a re-count
    assert len(plot_data(out[THROUGHPUT])["data"][0]["x"]) == 2  # the run beside AR, same session
    trace = json.loads(Path(out[DOWNLOAD]).read_text())  # downloadable trace replays with engine.core.trace
    assert trace["schema_version"] and trace["iterations"] and trace["comparison"]["exact_match"] is True
    assert backend().pairs.loaded_name == "tiny-random"
    # the teaching panels come with every finished run
    assert "why:" in out[INSPECTOR] and plot_data(out[INSPECTOR_PLOT])["data"][0]["type"] == "bar"
    calibration = [t for t in plot_data(out[CALIBRATION])["data"] if t.get("name") == "dynatree"]
    assert calibration and all(0 <= y <= 1 for y in calibration[0]["y"])
    costs = {t.get("name") for t in plot_data(out[COSTS])["data"]}
    assert {"verify, measured", "iteration, measured", "break-even: AR for the same tokens"} <= costs


def test_the_result_shows_before_ar_and_ar_is_cached(client):
    prompt = "def cached_ar(n):\n"
    job = client.submit(prompt, False, "tiny-random", "linear", "cpu", 20, api_name="/run")
    final = job.result(timeout=120)
    outputs = job.outputs()
    early = [o for o in outputs if "measuring AR" in str(o[BADGE])]
    assert early, "the run was not shown before AR was measured"
    assert "tokens/s" in early[0][STATUS] and tree_nodes(early[0][TREE]) >= 2 and "why:" in early[0][INSPECTOR]
    assert "matches AR" in final[BADGE] and "×" in final[METRICS]  # then the baseline filled in
    assert len(plot_data(final[THROUGHPUT])["data"][0]["x"]) == 2
    # same pair, prompt, max new tokens and dtype: AR comes from the cache, with no wait for it
    job = client.submit(prompt, False, "tiny-random", "fixed", "cpu", 20, api_name="/run")
    again = job.result(timeout=120)
    assert not any("measuring AR" in str(o[BADGE]) for o in job.outputs())
    assert "matches AR" in again[BADGE]


def test_the_badge_says_whether_ar_was_measured_now_or_reused_and_when(client):
    """The first run on a prompt measures AR and says so; a later run on it reuses that AR and gives its time."""
    prompt = "def badge_source(n):\n"
    first = client.predict(prompt, False, "tiny-random", "linear", "cpu", 12, api_name="/run")
    trace = json.loads(Path(first[DOWNLOAD]).read_text())
    assert trace["comparison"]["ar_reused"] is False
    measured = re.search(r"AR measured for this run \((\d\d:\d\d:\d\d UTC)\)", first[BADGE])
    assert measured, first[BADGE]
    assert "AR measured for this run" in plot_data(first[THROUGHPUT])["layout"]["title"]["text"]
    again = client.predict(prompt, False, "tiny-random", "fixed", "cpu", 12, api_name="/run")
    reused = re.search(r"AR reused from the cache: measured at (\d\d:\d\d:\d\d UTC), (\d+) s earlier",
                       again[BADGE])
    assert reused and reused.group(1) == measured.group(1), again[BADGE]
    comparison = json.loads(Path(again[DOWNLOAD]).read_text())["comparison"]
    assert comparison["ar_reused"] is True and comparison["ar_measured_at"] == trace["comparison"]["ar_measured_at"]
    assert "AR reused from the cache" in plot_data(again[THROUGHPUT])["layout"]["title"]["text"]
    table = client.predict(prompt, False, "tiny-random", "linear", "cpu", 12, methods=["fixed"],
                           api_name="/compare")
    assert "AR reused from the cache: measured at " + measured.group(1) in table[STATUS]


def test_a_throttled_stream_still_delivers_every_iteration(monkeypatch):
    """However few updates the throttle lets through, the final view and the trace hold every iteration."""
    from functools import partial

    from types import SimpleNamespace

    from engine.core.trace import load_run
    from treeviz.page import handlers
    from treeviz.serving import work
    from treeviz.serving.throttle import UpdateThrottle

    backend()  # the app (and its tiny pair) is up: the handler reads the pair from the process-wide backend
    monkeypatch.setattr(work, "UpdateThrottle", partial(UpdateThrottle, min_interval=3600.0))
    outputs = list(handlers.run("def throttled(n):\n", False, "tiny-random", "dynatree", "cpu", 40, 0.0, 1.0, 0, 0,
                                "auto", {}, "per iteration", SimpleNamespace(session_hash="throttle-session")))
    streamed = [o for o in outputs if "decoding with" in str(o[3])]
    assert len(streamed) == 1  # only the first iteration went out live: the rest were batched
    final = outputs[-1]
    run, n = final[0], final[0].metrics.iterations
    assert n > 3 and [it.index for it in run.iterations] == list(range(n))
    scrubber = next(o[2] for o in reversed(outputs) if "maximum" in o[2])
    assert scrubber["maximum"] == scrubber["value"] == n - 1  # the scrubber reaches every iteration
    assert [it.index for it in load_run(final[4]).iterations] == list(range(n))  # and so does the trace


def test_the_throttle_bounds_the_rate_and_the_share_of_time_updates_take():
    from treeviz.serving.throttle import UpdateThrottle
    now = [0.0]
    throttle = UpdateThrottle(min_interval=1.0, share=0.1, clock=lambda: now[0])
    assert throttle.due()  # the first update goes at once
    throttle.sent(started=0.0)  # a cheap update: the bounded rate decides
    now[0] = 0.9
    assert not throttle.due()
    now[0] = 1.0
    assert throttle.due()
    throttle.sent(started=0.5)  # an update that took 0.5 s: the next waits 9 x 0.5 s (updates <= 10% of the time)
    now[0] = 1.0 + 4.4
    assert not throttle.due()
    now[0] = 1.0 + 4.6
    assert throttle.due()


def test_node_inspector_through_the_api(client):
    out = client.predict("def inspect_me(n):\n", False, "tiny-random", "dynatree", "cpu", 16, api_name="/run")
    trace = json.loads(Path(out[DOWNLOAD]).read_text())
    last = trace["iterations"][-1]
    rejected = [n for n in last["nodes"] if n["status"] == "rejected"]
    target = rejected[0] if rejected else last["nodes"][1]
    shown, summary, plot = client.predict(len(trace["iterations"]) - 1, target["id"], api_name="/inspect")
    assert shown == target["id"] and target["status"] in summary and "why:" in summary
    names = [t["type"] for t in plot_data(plot)["data"]]
    assert names == ["bar", "bar"]  # the parent's draft q and target p side by side


def test_empty_prompt_is_a_clear_message(client):
    with pytest.raises(Exception) as info:
        client.predict("   ", api_name="/run")
    message = str(info.value)
    assert "prompt is empty" in message and "Traceback" not in message


def test_absurd_parameters_are_reported(client):
    out = client.predict("hello", False, "tiny-random", "dynatree", "cpu", 8, params={"d0": 8, "d_max": 8},
                         api_name="/run")
    assert "D0" in out[STATUS] and "err" in out[STATUS] and "Traceback" not in out[STATUS]
    out = client.predict("hello", False, "tiny-random", "dynatree", "cpu", 8, params={"depth": 3}, api_name="/run")
    assert "no parameter" in out[STATUS] and "depth" in out[STATUS] and "err" in out[STATUS]


def test_run_takes_strategy_parameters_by_name(client):
    api = client.view_api(print_info=False, return_format="dict")["named_endpoints"]["/run"]
    names = [p["parameter_name"] for p in api["parameters"]]
    assert names == ["prompt", "chat", "pair", "strategy", "preset", "max_new_tokens", "temperature", "top_p",
                     "top_k", "seed", "verifier", "params", "stage_mode"]
    out = client.predict("def add(a, b):\n", False, "tiny-random", "linear", "cpu", 16,
                         params={"k": 2, "stop_below": 0.0}, api_name="/run")
    trace = json.loads(Path(out[DOWNLOAD]).read_text())
    assert trace["params"]["k"] == 2 and trace["params"]["stop_below"] == 0.0
    assert max(it["drafted"] for it in trace["iterations"]) <= 2  # the named value reached the strategy
    default = json.loads(Path(client.predict("def add(a, b):\n", False, "tiny-random", "linear", "cpu", 16,
                                             api_name="/run")[DOWNLOAD]).read_text())
    assert default["params"]["k"] == STRATEGIES["linear"].presets["cpu"]["k"]  # left out: the preset's value


def test_sweep_size_range_is_optional_in_the_api(client):
    """Blank bounds take the strategy's own range, so the API must not require them."""
    api = client.view_api(print_info=False, return_format="dict")["named_endpoints"]["/sweep"]
    params = {p["parameter_name"]: p for p in api["parameters"]}
    for name in ("size_min", "size_max"):
        assert params[name]["parameter_has_default"] and params[name]["parameter_default"] is None, params[name]


def test_a_run_streams_several_updates(client, monkeypatch):
    """The tree streams while decoding (the tiny pair decodes 256 tokens in about a second: the throttle's interval
    is lowered here so that several updates fall inside the run; the app serves in this process)."""
    from functools import partial

    from treeviz.serving import work
    from treeviz.serving.throttle import UpdateThrottle
    # share 0.9: on a loaded machine one update may take 0.1 s, and the default 10 % rule would then wait ~1 s
    monkeypatch.setattr(work, "UpdateThrottle", partial(UpdateThrottle, min_interval=0.02, share=0.9))
    job = client.submit("def stream(n):\n", False, "tiny-random", "dynatree", "cpu", 256, api_name="/run")
    job.result(timeout=120)
    trees = [o for o in job.outputs() if is_plot(o[TREE]) and tree_nodes(o[TREE]) >= 2]
    assert len(trees) >= 3, len(trees)  # the tree streamed while decoding, not only at the end
    titles = [plot_data(o[TREE])["layout"]["title"]["text"] for o in trees]
    assert len(set(titles)) >= 3


def test_unloadable_pair_is_reported(client):
    out = client.predict("hello", False, "no-such-org/no-such-model + other", "linear", "cpu", 8, api_name="/run")
    assert "load" in out[STATUS].lower() and "err" in out[STATUS] and "Traceback" not in out[STATUS]
    # the pair in use switches back without harm
    out = client.predict("hello", False, "tiny-random", "linear", "cpu", 8, api_name="/run")
    assert "tokens/s" in out[STATUS]


def test_downloaded_trace_upload_replays_and_scrubs(client):
    download = client.predict("def replay_me(n):\n", False, "tiny-random", "dynatree", "cpu", 24,
                              api_name="/run")[DOWNLOAD]
    out = client.predict(handle_file(download), "per iteration", api_name="/upload")
    assert "replaying" in out[STATUS] and "no models" in out[STATUS]
    assert tree_nodes(out[TREE]) >= 2
    assert "why:" in out[INSPECTOR] and plot_data(out[CALIBRATION])["data"][1:]  # panels from the trace alone
    last = out[SCRUBBER]["maximum"]
    first = client.predict(0, "per iteration", None, api_name="/scrub")
    assert "iteration 0:" in plot_data(first[0])["layout"]["title"]["text"]
    assert plot_data(first[0])["layout"]["xaxis"]["range"] == plot_data(out[TREE])["layout"]["xaxis"]["range"]
    assert f"iteration {last}" in plot_data(out[TREE])["layout"]["title"]["text"]


def test_bad_trace_upload_is_a_clear_message(client, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1, "prompt": "x"}')
    out = client.predict(handle_file(str(bad)), "per iteration", api_name="/upload")
    assert "Cannot replay" in out[STATUS] and "Traceback" not in out[STATUS]
    junk = tmp_path / "junk.json"
    junk.write_text("not json at all")
    out = client.predict(handle_file(str(junk)), "per iteration", api_name="/upload")
    assert "Cannot replay" in out[STATUS]


def test_compare_table_and_the_views_follow_it(client):
    client.predict("def other(n):\n", False, "tiny-random", "dynatree", "cpu", 12, api_name="/run")
    job = client.submit("def add(a, b):\n", False, "tiny-random", "linear", "cpu", 16, methods=["linear", "fixed"],
                        api_name="/compare")
    out = job.result(timeout=180)
    table, plot = out[COMPARE_TABLE], out[COMPARE_PLOT]
    rows = {row[0]: row for row in table["data"]}
    assert set(rows) == {"ar", "linear", "fixed"}
    assert table["headers"][:3] == ["strategy", "tokens/s", "speedup"]
    assert tree_nodes(plot) >= 2
    # the metrics row follows each compared method (no longer the previous run's figures)
    metrics = [o[METRICS] for o in job.outputs() if isinstance(o[METRICS], str) and "tokens/s" in o[METRICS]]
    assert any(">linear<" in m for m in metrics) and ">fixed<" in metrics[-1] and "×" in metrics[-1]
    lines = {t.get("name") for t in plot_data(out[COMPARE_CALIBRATION])["data"]}
    assert {"linear", "fixed"} <= lines


def test_stop_cancels_a_run_in_flight_and_the_pair_stays_usable(client):
    import time
    job = client.submit("def long(n):\n", False, "tiny-random", "dynatree", "cpu", 512, api_name="/run")
    deadline = time.time() + 60
    while time.time() < deadline and not any("decoding with" in str(o[STATUS]) for o in job.outputs()):
        time.sleep(0.05)
    assert not job.done(), "the run ended before Stop: make it longer"
    stopped = client.predict(api_name="/stop")
    assert "stopped" in stopped
    while not job.done() and time.time() < deadline:
        time.sleep(0.05)
    assert job.done()
    outputs = job.outputs()
    assert any(is_plot(o[TREE]) and tree_nodes(o[TREE]) >= 1 for o in outputs)  # what streamed before Stop
    assert not any("tokens/s (" in str(o[STATUS]) for o in outputs)  # it did not run to the end
    assert not backend().pairs.run_lock.locked()  # the cancelled handler let go of the pair
    out = client.predict("def again(n):\n", False, "tiny-random", "dynatree", "cpu", 12, api_name="/run")
    assert "12 tokens in" in out[STATUS]


def test_a_newer_request_supersedes_only_its_own_view_and_stop_cancels_every_view():
    """A slider released while a race decodes starts a Run: it must not cancel the race (it did, and the race's
    status then stayed at "warming up" for good); a newer race does. Stop cancels everything the session runs."""
    from treeviz.serving.server import Server
    backend = Server()
    race, run, other = backend.open("s1", "race"), backend.open("s1", "run"), backend.open("s2", "run")
    assert not race.cancelled and not run.cancelled and sorted(backend.running("s1")) == ["race", "run"]
    newer_race = backend.open("s1", "race")
    assert race.cancelled and race.superseded and not newer_race.cancelled
    assert backend.stop("s1")
    assert run.cancelled and newer_race.cancelled and not run.superseded and not other.cancelled
    assert backend.running("s1") == [] and backend.running("s2") == ["run"]
    assert not backend.stop("s1")  # nothing left running: the Stop button says so
    backend.close(run)
    assert backend.session_of("s1/run") is not run


def test_a_stopped_session_says_so_and_lets_go_of_the_pair():
    """Stop is the session's flag and nothing else: raised while the work runs, the work sees it between two
    iterations (or the session between two events), the last event is Stopped and the pair's lock is free."""
    from treeviz.serving.events import Progress, Stopped
    from treeviz.serving.server import Server
    backend = Server()
    backend.pairs.load("tiny-random")
    session = backend.open("s", "run")

    def work(key):
        for k in range(100):
            if k == 2:
                backend.stop("s")
            yield Progress(str(k))
    events = list(session.events("go", "tiny-random", work))
    assert events[-1] == Stopped(superseded=False) and len(events) == 1 + 3 + 1  # Started, 0, 1, 2, Stopped
    assert not backend.pairs.run_lock.locked() and backend.running("s") == []


def test_preset_and_example_update_controls(client):
    entries = [(s, p) for s, cls in STRATEGIES.items() for p in cls.params]  # the controls, in page order
    out = client.predict("dynatree", "paper", api_name="/on_preset")
    values = {p.name: v for (s, p), v in zip(entries, out) if s == "dynatree"}
    paper = STRATEGIES["dynatree"].presets["paper"]
    for name, value in paper.items():
        got = values[name]["value"] if isinstance(values[name], dict) else values[name]
        assert got == value, name
    from treeviz.page.ui import example_label, load_examples
    chat = next(e for e in load_examples() if e["kind"] == "chat")
    text, use_chat = client.predict(example_label(chat), api_name="/on_example")
    assert use_chat in (True, {"value": True, "__type__": "update"})


def test_examples_fall_back_when_prompt_files_are_missing(tmp_path, monkeypatch):
    import engine.core.prompts
    import treeviz.page.ui as ui
    monkeypatch.setattr(engine.core.prompts, "PROMPT_DIR", tmp_path)
    assert ui.load_examples() == ui.FALLBACK_PROMPTS
    (tmp_path / "code.json").write_text("{broken")
    assert ui.load_examples() == ui.FALLBACK_PROMPTS


def test_a_slow_pair_load_does_not_block_a_quick_pair(monkeypatch):
    """While the default pair converts (minutes), the tiny pair must load and run; progress is reported."""
    import threading
    import time

    import engine.models as models
    from treeviz.serving.errors import UserError
    import treeviz.serving.pairs as pairs_module
    from treeviz.serving.pairs import PairManager

    release = threading.Event()
    real = models.load_pair

    def fake_load(target, draft, progress=None, **kw):
        if target.startswith("default"):
            progress(0.3, "converting GGUF")
            release.wait(30)
            raise models.ModelLoadError("fake: not today")
        return real(target, draft, progress=progress, **kw)

    monkeypatch.setattr(pairs_module, "load_pair", fake_load)
    pm = PairManager()
    pm.request("default")
    deadline = time.time() + 10
    while pm.status().progress[0] < 0.3 and time.time() < deadline:
        time.sleep(0.05)
    st = pm.status()
    assert st.loading and st.progress == (0.3, "converting GGUF")
    pm.request("tiny-random")
    pair = next((p for _ in range(240) if (p := pm.ready("tiny-random")) is not None), None)  # <= 60 s
    assert pair is not None and pm.status().loaded == "tiny-random"
    release.set()
    time.sleep(0.3)
    assert pm.status().loaded == "tiny-random" and not pm.status().error  # the stale load is ignored
    pm.request("default")
    with pytest.raises(UserError) as info:
        for _ in range(240):  # each ready() waits up to 0.25 s for the load to finish or fail
            pm.ready("default")
    assert "fake: not today" in str(info.value)


def test_the_precision_switch_serves_the_pair_in_float32_and_runs_equal_ar(client):
    """/on_precision folds the switch into the pair's name; a run on it is float32 and equals AR token for token;
    /on_pair keeps a precision the name says, and auto brings the pair's own name back."""
    from treeviz.serving.pairs import with_precision
    exact = with_precision("tiny-random", "fp32")  # its own name where this CPU's auto is already fp32
    served, status = client.predict("tiny-random", "fp32", api_name="/on_precision")
    assert served == exact and "Traceback" not in status
    out = client.predict("def fib(n):\n", False, served, "dynatree", "cpu", 16, api_name="/run")
    trace = json.loads(Path(out[DOWNLOAD]).read_text())
    assert trace["config"]["dtype"] == "float32" and "float32 on" in out[STATUS]
    assert trace["comparison"]["exact_match"] is True
    assert backend().pairs.loaded_name == exact
    pair, precision, _ = client.predict("tiny-random (fp32)", "auto", api_name="/on_pair")  # the name says fp32
    assert (pair, precision) == (exact, "fp32")
    pair, _ = client.predict(exact, "auto", api_name="/on_precision")
    assert pair == "tiny-random"
    out = client.predict("def fib(n):\n", False, pair, "dynatree", "cpu", 4, api_name="/run")
    assert backend().pairs.loaded_name == "tiny-random"


def test_only_compatible_rules_are_offered():
    iid = verifier_choices("delayed")  # i.i.d. branches: no chain-only rules
    assert {"auto", "specinfer", "spectr", "khisti", "traversal"} <= set(iid)
    assert not {"naive", "block"} & set(iid)
    topk = verifier_choices("dynatree")  # deterministic top-k children: no SpecTr / Khisti
    assert {"auto", "token_matching", "traversal"} <= set(topk)
    assert not {"spectr", "khisti", "naive", "block"} & set(topk)
    assert {"naive", "block"} <= set(verifier_choices("linear"))


def test_any_rule_by_name_through_the_api(client):
    """/run accepts every rule by name; the engine refuses one that cannot check the strategy's trees, plainly."""
    out = client.predict("hello", False, "tiny-random", "delayed", "cpu", 8, temperature=1.0, verifier="spectr",
                         api_name="/run")
    assert "8 tokens in" in out[STATUS]
    out = client.predict("hello", False, "tiny-random", "dynatree", "cpu", 8, temperature=1.0, verifier="spectr",
                         api_name="/run")
    assert "cannot check trees" in out[STATUS] and "err" in out[STATUS] and "Traceback" not in out[STATUS]


def test_ar_cache_keys_on_what_changes_ar_and_stays_bounded():
    from engine.recipe import RunSpec
    from treeviz.serving.ar_cache import ARCache
    greedy = RunSpec(pair="tiny-random", prompt="p", strategy="linear", max_new_tokens=8)
    same = RunSpec(pair="tiny-random", prompt="p", strategy="dynatree", max_new_tokens=8, top_p=0.5, seed=7)
    assert ARCache.key("tiny-random", "float32", greedy) == ARCache.key("tiny-random", "float32", same)  # greedy AR
    for other in (RunSpec(pair="x", prompt="q", strategy="linear", max_new_tokens=8),
                  RunSpec(pair="x", prompt="p", strategy="linear", max_new_tokens=9)):
        assert ARCache.key("tiny-random", "float32", other) != ARCache.key("tiny-random", "float32", greedy)
    assert ARCache.key("tiny-random", "bfloat16", greedy) != ARCache.key("tiny-random", "float32", greedy)
    hot = RunSpec(pair="x", prompt="p", strategy="linear", max_new_tokens=8, temperature=0.8)
    assert ARCache.key("t", "f", hot) != ARCache.key("t", "f", RunSpec(**{**hot.__dict__, "seed": 1}))
    cache = ARCache(size=2)
    for i in range(3):
        cache.put(("k", i), f"result {i}")
    assert len(cache) == 2 and cache.get(("k", 0)) is None and cache.get(("k", 2)) == "result 2"


def test_a_run_reaches_the_decoder_through_at_most_four_generator_frames(monkeypatch):
    """The house's rule for the run path: from the handler to DecodeRun at most 4 generator frames, counted on the
    handler's thread and on the compute thread together, for a Run and for a Compare measuring AR."""
    import inspect
    import sys
    from types import SimpleNamespace

    from treeviz.page import handlers
    from treeviz.serving import work
    backend()  # the app (and its tiny pair) is up
    seen = {}

    def generator_frames(frame) -> list[str]:
        names = []
        while frame is not None:
            if frame.f_code.co_flags & inspect.CO_GENERATOR:
                names.append(frame.f_code.co_name)
            frame = frame.f_back
        return names

    def watched(run, strategy):
        """`run` (a DecodeRun) noting, at its first iteration, the generator frames above its own loop (the latest
        run of each strategy is the one kept)."""
        iterate, done = run.iterate, []

        def first():
            if not done:
                done.append(True)
                stacks = [generator_frames(f) for f in sys._current_frames().values()]
                handler = next(s for s in stacks if s and s[-1] in ("run", "compare"))
                loop = sys._getframe(1)  # DecodeRun.__iter__, which calls iterate
                seen[strategy] = handler + generator_frames(loop.f_back)
            return iterate()

        run.iterate = first
        return run

    plain = work.start_run
    monkeypatch.setattr(work, "start_run", lambda pair, spec, *rest: watched(plain(pair, spec, *rest), spec.strategy))
    request = SimpleNamespace(session_hash="frames-test")
    list(handlers.run("def frames(n):\n", False, "tiny-random", "linear", "cpu", 6, 0.0, 1.0, 0, 0, "auto", {},
                      "per iteration", request))
    assert seen["linear"] == ["events", "run", "decode_events", "bounded"], seen
    list(handlers.compare("def frames_compared(n):\n", False, "tiny-random", "linear", "cpu", 6, 0.0, 1.0, 0, 0,
                          "auto", {}, ["fixed"], "per iteration", request))
    assert seen["ar"] == ["events", "compare", "compare_events", "bounded"], seen  # AR measured first
    assert all(len(frames) <= 4 for frames in seen.values())


RUN_STAGES = {"engine/decoder.py": {"start", "prefill", "draft", "verify", "commit", "record"},
              "engine/core/tree.py": {"add"}, "engine/records.py": {"iteration_record"},
              "engine/core/attention.py": {"tree_sdpa"}, "engine/cpu/kernels.py": {"forward"}}


def run_stage(path: str, name: str) -> bool:
    """Where a Run does its work: an iteration's stages, what they make (a tree node, a record), a strategy's build,
    a verification, and inside each model forward its attention and linears."""
    return (name in RUN_STAGES.get(path, ()) or path.startswith("engine/strategies/") and name == "build"
            or path.startswith("engine/verify/") and name == "verify")


def walkthrough_files() -> set[str]:
    """The files ARCHITECTURE.md's "One Run click, file by file" names, one numbered line each."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    section = text.split("## One Run click, file by file", 1)[1].split("\n## ", 1)[0]
    return {m.group(1) for m in re.finditer(r"^\d+\. `([\w/]+\.py)`", section, re.MULTILINE)}


def test_a_run_click_passes_through_at_most_15_files_and_architecture_names_them():
    """The house's rule for the run path, counted like the generator frames: every file on the stack (the handler's
    thread and the compute thread together) whenever a default Run (DynaTree, `auto`) is at work, and the file the
    work is in. ARCHITECTURE.md's walk-through names exactly these."""
    import sys
    from types import SimpleNamespace

    from treeviz.page import handlers
    from treeviz.serving.compute_thread import COMPUTE
    backend()  # the app (and its tiny pair) is up
    ours = re.compile(r"/((?:engine|treeviz)/.*\.py|app\.py)$")
    passed: set[str] = set()

    def files(frame) -> list[str]:
        out = []
        while frame is not None:
            match = ours.search(frame.f_code.co_filename)
            out += [match.group(1)] if match else []
            frame = frame.f_back
        return out

    def watch(frame, event, arg):
        match = ours.search(frame.f_code.co_filename) if event == "call" else None
        if match and run_stage(match.group(1), frame.f_code.co_name):
            stacks = [files(f) for f in sys._current_frames().values()]
            passed.update(files(frame), *(s for s in stacks if "treeviz/page/handlers.py" in s))

    COMPUTE.call(sys.setprofile, watch)
    try:
        list(handlers.run("def walk(n):\n", False, "tiny-random", "dynatree", "auto", 12, 0.0, 1.0, 0, 0, "auto",
                          {}, "per iteration", SimpleNamespace(session_hash="walk-test")))
    finally:
        COMPUTE.call(sys.setprofile, None)
    assert {"treeviz/page/handlers.py", "engine/decoder.py", "engine/strategies/dynatree.py",
            "engine/verify/greedy.py"} <= passed  # the trace saw the handler, the loop, the strategy and the rule
    assert len(passed) <= 15, sorted(passed)
    assert passed == walkthrough_files(), sorted(passed)


def test_the_page_names_each_handlers_inputs_by_its_parameters():
    """Components are declared once, by name (Page's fields): a handler's inputs are the components named by its own
    parameters, a misspelt name fails while the page is built, and an undeclared one says which it is."""
    from treeviz.page.components import Page
    page = Page(prompt="the prompt box", chat="the chat switch", scrubber="the scrubber")

    def handler(prompt, chat, request=None):
        return prompt, chat
    assert page.inputs(handler) == ["the prompt box", "the chat switch"]  # `request` is Gradio's, not a component

    def scrub(chat, index):
        return chat, index
    assert page.inputs(scrub, index="scrubber") == ["the chat switch", "the scrubber"]
    with pytest.raises(AttributeError):
        page.max_new = 48  # a misspelt field (max_new_tokens) cannot be written
    with pytest.raises(LookupError, match="'tree'"):
        page.component("tree")  # declared, not made yet
    with pytest.raises(LookupError, match="'trees'"):
        page.outputs(("prompt", "trees"))
