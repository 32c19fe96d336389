"""The Gradio handlers that touch models, Run and Compare, plus Stop: each turns its RunSession's typed events
(treeviz/serving/events.py) into component updates, in one place per handler (`RunView`, `CompareView`).

A handler validates its inputs, opens a session for its view (a newer one of the same browser session and view
supersedes it) and renders every event the session emits; the model work and the GPU boundary are in
treeviz/serving/work.py. Stop raises the session's flag: the run ends between two iterations and its last event says so.
The last update of a Run or Compare carries every view and the teaching panels, at the iteration the user scrubbed to
meanwhile (the page's state in serving.server.SERVER.page), so nothing re-renders after a run.

Run outputs, in order: RUN_VIEW_OUTPUTS (views.RUN_OUTPUTS, then the teaching panels); Compare outputs:
COMPARE_OUTPUTS (views.RUN_OUTPUTS, COMPARE_EXTRA, then the panels). Handlers name what they change (`views.outputs`).
"""
from __future__ import annotations

from typing import Any, Iterator

import gradio as gr

from engine.recipe import AR, RunSpec
from engine.strategies import STRATEGIES
from treeviz.figures.charts import calibration_figure
from treeviz.figures.charts_teaching import acceptance_histogram_figure
from treeviz.figures.html import ar_source_text
from treeviz.figures.tree_figure import grow_frame, small_multiples
from treeviz.page.views import (MEASURING_BADGE, PANEL_NAMES, PENDING_BADGE, RUN_OUTPUTS, compare_row, compare_table,
                                last_index, outputs, render_views, run_summary, save_trace, shown_run, status_html,
                                streamed_views)
from treeviz.serving.events import BaselineMeasured, Event, Failed, Finished, Iteration, Progress, Started, Stopped
from treeviz.serving.gpu import use_page_error
from treeviz.serving.server import SERVER, PageState
from treeviz.serving.work import compare_events, decode_events

use_page_error(gr.Error)  # the serving room's errors reach the page as gradio's (the only kind ZeroGPU's worker keeps)

RUN_VIEW_OUTPUTS = RUN_OUTPUTS + PANEL_NAMES
COMPARE_EXTRA = ("compare_table", "compare_plot", "compare_calibration", "compare_histogram")
COMPARE_OUTPUTS = RUN_OUTPUTS + COMPARE_EXTRA + PANEL_NAMES
STOPPED_VIEWS = {"run": "the run (the views show it up to the last streamed iteration)", "race": "the race",
                 "sweep": "the sweep"}


def browser_of(request: gr.Request | None) -> str:
    """The browser session a request comes from ("default" for a caller without one)."""
    return getattr(request, "session_hash", None) or "default"


def status_update(text: str, error: bool = False, names: tuple[str, ...] = RUN_VIEW_OUTPUTS,
                  progress: float | None = None) -> tuple:
    return outputs({"status": status_html(text, error=error, progress=progress)}, names)


def ending(event: Stopped | Failed, names: tuple[str, ...], stopped: str) -> tuple:
    """The update a request ends on when it stopped or failed: its own `stopped` line; nothing when a newer request
    of its view superseded it (that one's updates own the views); or the error as one plain line."""
    if isinstance(event, Failed):
        return status_update(event.message, error=True, names=names)
    return outputs({}, names) if event.superseded else status_update(stopped, names=names)


def spec_from_inputs(prompt: str, chat: bool, pair: str, strategy: str, preset: str, max_new_tokens: float,
                     temperature: float, top_p: float, top_k: float, seed: float, verifier: str,
                     params: dict | None) -> RunSpec:
    """Validate the named inputs of /run and /compare; gr.Error (a plain message) on nonsense."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise gr.Error("The prompt is empty: type some text or pick an example prompt.")
    if not isinstance(pair, str) or not pair.strip():
        raise gr.Error("Choose a model pair (e.g. tiny-random) or type 'target + draft' hub ids.")
    if strategy not in STRATEGIES:
        raise gr.Error(f"Unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}.")
    if params is not None and not isinstance(params, dict):
        raise gr.Error("params must be a JSON object of strategy parameter names and values, e.g. {\"d0\": 3}.")
    missing = [name for name, value in (params or {}).items() if value is None]
    if missing:
        raise gr.Error(f"{', '.join(missing)} needs a value.")
    try:
        return RunSpec(pair=str(pair), prompt=[{"role": "user", "content": prompt}] if chat else prompt,
                       strategy=strategy, preset=preset or "auto", params=dict(params or {}),
                       max_new_tokens=int(max_new_tokens), temperature=float(temperature or 0.0),
                       top_p=float(top_p), top_k=int(top_k or 0), seed=int(seed or 0),
                       verifier=str(verifier or "auto"))
    except (TypeError, ValueError) as err:
        raise gr.Error(f"Bad setting: {err}") from None


# -- Run ---------------------------------------------------------------------------------------------------------------
def run(prompt: str, chat: bool, pair: str, strategy: str, preset: str, max_new_tokens: float, temperature: float,
        top_p: float, top_k: float, seed: float, verifier: str, params: dict, stage_mode: str,
        request: gr.Request) -> Iterator[tuple]:
    """Decode the prompt with the strategy, streaming the tree as it grows; AR runs beside it."""
    spec = spec_from_inputs(prompt, chat, pair, strategy, preset, max_new_tokens, temperature, top_p, top_k, seed,
                            verifier, params)
    browser = browser_of(request)
    session, view = SERVER.open(browser, "run"), RunView(spec, stage_mode, SERVER.page(browser))
    for event in session.events(f"starting {spec.strategy} on {spec.pair}…", spec.pair, decode_events, spec,
                                baseline_for=spec):
        yield view.update(event)


class RunView:
    """A Run's events as RUN_VIEW_OUTPUTS updates: live trees on a frame grown to fit every tree so far, the whole run
    when it ends, AR's figures when they arrive."""

    def __init__(self, spec: RunSpec, stage_mode: str, page: PageState):
        self.spec, self.stage_mode, self.page = spec, stage_mode, page
        self.frame, self.framed = None, 0

    def update(self, event: Event) -> tuple:
        match event:
            case Started(text):
                return self.opening(text)
            case Progress(text, fraction):
                return status_update(text, progress=fraction)
            case Iteration(snap, batched):
                return self.streamed(snap, batched)
            case Finished(result, ar):
                return self.finished(result, ar)
            case BaselineMeasured(result, ar):
                return self.baseline(result, ar)
            case Stopped() | Failed():
                return ending(event, RUN_VIEW_OUTPUTS, "stopped: the views show the run up to the last streamed "
                                                       "iteration")
        raise TypeError(f"not a run event: {event!r}")

    def opening(self, text: str) -> tuple:
        """A fresh run: the previous run's views that would otherwise look current are cleared (the tree and the
        text stay until the first streamed iteration replaces them)."""
        self.page.shown = self.page.node = None
        empty = render_views(None, None, None)
        return outputs({"run": None, "ar": None, "scrubber": gr.update(value=0, maximum=1),
                        "status": status_html(text), "download": None, "badge": PENDING_BADGE,
                        **{name: view for name, view in empty.items() if name not in ("tree", "text")}},
                       RUN_VIEW_OUTPUTS)

    def streamed(self, snap, batched: int) -> tuple:
        """One live update: the run so far, the newest tree (the scrubber reaches every iteration so far; the
        snapshot goes to the run state too, so after a Stop the views scrub what was streamed)."""
        for iteration in snap.iterations[self.framed:]:
            self.frame = grow_frame(self.frame, iteration)
        n, self.framed = len(snap.iterations), len(snap.iterations)
        since = f" ({batched} iterations since the last update)" if batched > 1 else ""
        status = status_html(f"decoding with {self.spec.strategy}: iteration {n - 1}, "
                             f"{snap.metrics.new_tokens} tokens, {snap.metrics.total_s:.1f}s{since}")
        return outputs({"run": snap, "ar": None, "scrubber": gr.update(maximum=max(1, n - 1), value=n - 1),
                        "status": status, **streamed_views(snap, self.frame)}, RUN_VIEW_OUTPUTS)

    def finished(self, result, ar) -> tuple:
        """The run as soon as it ends, every view at its last iteration (AR's figures follow in `baseline` when AR
        was not cached)."""
        self.page.shown = self.page.node = None
        n = last_index(result)
        status = run_status(result) + ("" if ar is not None else " — measuring AR on the same prompt…")
        return outputs({"run": result, "ar": ar, "scrubber": gr.update(maximum=max(1, n or 0), value=n or 0),
                        "status": status_html(status), "download": save_trace(result),
                        **shown_run(result, ar, n, self.stage_mode, self.page.entropy),
                        **({"badge": MEASURING_BADGE} if ar is None else {})}, RUN_VIEW_OUTPUTS)

    def baseline(self, result, ar) -> tuple:
        """AR's measurement arrived: every view again, with AR beside the run, at the iteration and node the user
        chose meanwhile (the scrubber is left alone): the last value of /run is complete for an API caller."""
        page = self.page
        views = shown_run(result, ar, page.shown, self.stage_mode, page.entropy, page.node)
        return outputs({"run": result, "ar": ar, "status": status_html(run_status(result)),
                        "download": save_trace(result), **views}, RUN_VIEW_OUTPUTS)


def run_status(result) -> str:
    """The finished run's line, with its speedup and how it was measured: a streamed run against AR measured
    for it or reused from the cache (the race is the fair side-by-side measurement)."""
    comparison = result.comparison
    speedup = comparison.speedup_vs_ar if comparison is not None else None
    if not speedup or result.strategy == AR:
        return run_summary(result)
    return (f"{run_summary(result)} — speedup {speedup:.2f}× vs AR: this run was streamed (drawn while it decoded) "
            f"against {ar_source_text(comparison) or 'AR'}; the Race tab measures both unobserved, back to back")


def stop(request: gr.Request) -> str:
    """Stop button: raise the flag of every session this browser session runs (Run, Compare, race, sweep); each
    ends between two iterations and says so in its own status line."""
    views = SERVER.stop(browser_of(request))
    if not views:
        gr.Info("Nothing is running.")
        return gr.skip()
    return status_html("stopped: " + ", ".join(STOPPED_VIEWS.get(view, view) for view in views))


# -- Compare -------------------------------------------------------------------------------------------------------
def compare(prompt: str, chat: bool, pair: str, strategy: str, preset: str, max_new_tokens: float,
            temperature: float, top_p: float, top_k: float, seed: float, verifier: str, params: dict,
            methods: list[str], stage_mode: str, request: gr.Request) -> Iterator[tuple]:
    """AR and each ticked strategy on the same prompt: a table row, a first tree and a calibration line per method;
    the main views follow each method as it finishes."""
    spec = spec_from_inputs(prompt, chat, pair, strategy, preset, max_new_tokens, temperature, top_p, top_k, seed,
                            verifier, params)
    methods = [m for m in (methods or []) if m in STRATEGIES and m != AR]
    if not methods:
        raise gr.Error("Tick at least one strategy to compare with AR.")
    browser = browser_of(request)
    session, view = SERVER.open(browser, "run"), CompareView(stage_mode, SERVER.page(browser))
    for event in session.events("comparing: measuring AR first…", spec.pair, compare_events, spec, methods,
                                baseline_for=spec):
        yield view.update(event)
    if view.complete:  # the last value carries the comparison: an API caller reads only the last
        yield view.summary()


class CompareView:
    """A Compare's events as COMPARE_OUTPUTS updates: the table, first trees, calibration and histograms so far, and
    the main views showing the method just finished."""

    def __init__(self, stage_mode: str, page: PageState):
        self.stage_mode, self.page = stage_mode, page
        self.rows, self.trees, self.runs, self.ar_note, self.last_shown = [], [], [], "", {}
        self.complete = False

    def update(self, event: Event) -> tuple:
        self.complete = False
        match event:
            case Started(text) | Progress(text, _):
                return status_update(text, names=COMPARE_OUTPUTS)
            case Finished(result, ar):
                self.complete = True
                return self.finished(result, ar)
            case Stopped() | Failed():
                return ending(event, COMPARE_OUTPUTS, "comparison stopped")
        raise TypeError(f"not a compare event: {event!r}")

    def finished(self, result, ar) -> tuple:
        self.rows.append(compare_row(result, ar))
        shown = {}
        if result is ar:
            self.ar_note = ar_source_text(ar.comparison)
        else:
            self.runs.append((result.strategy, result))
            if result.iterations:
                self.trees.append((result.strategy, result.iterations[0]))
            self.page.shown, n = None, last_index(result)
            shown = {"run": result, "ar": ar, "scrubber": gr.update(maximum=max(1, n or 0), value=n or 0),
                     "download": save_trace(result), **shown_run(result, ar, n, self.stage_mode, self.page.entropy)}
        self.last_shown = shown or self.last_shown
        return outputs({**shown, "status": status_html(f"compare: {result.strategy} done"), **self.extra()},
                       COMPARE_OUTPUTS)

    def summary(self) -> tuple:
        """The last value: the comparison, and the last method's views again (a page that coalesced the streamed
        updates still ends on them)."""
        summary = f"compared {len(self.rows)} methods on the same prompt" + (
            f" ({self.ar_note})" if self.ar_note else "")
        return outputs({**self.last_shown, "status": status_html(summary), **self.extra()}, COMPARE_OUTPUTS)

    def extra(self) -> dict[str, Any]:
        return {"compare_table": compare_table(self.rows), "compare_calibration": calibration_figure(self.runs),
                "compare_histogram": acceptance_histogram_figure(self.runs),
                **({"compare_plot": small_multiples(self.trees)} if self.trees else {})}
