"""The Gradio handlers that touch models: Run and Compare, plus Stop.

One run path: a plain generator handler validates its inputs, waits (on CPU) for the model pair, then hands over to
a generator decorated with `spaces.GPU` that iterates the engine's DecodeRun itself and yields component updates.
Run and Compare share that skeleton (`in_session` around, `reported` inside). The decorated generator takes only
picklable arguments (a RunSpec, the session id, plain strings) and yields only picklable values (tuples of strings,
dicts, plotly figures, RunResults): on a ZeroGPU Space it runs in another process. Stop is Gradio's own
cancellation (`cancels=`) plus the session's cancel flag, checked between iterations. A running decode streams at
the rate treeviz/throttle.py allows; its final view and trace hold every iteration.

Run outputs, in order: views.RUN_OUTPUTS (run state, AR state, scrubber, run status, download, then the views);
Compare outputs: the same followed by COMPARE_EXTRA. Handlers name what they change (`views.outputs`).
"""
from __future__ import annotations

import logging
import time
import traceback
from typing import Any, Callable, Iterator

import gradio as gr

from engine.session import AR, RunSpec
from engine.strategies import STRATEGIES
from treeviz.charts import calibration_figure
from treeviz.charts_teaching import acceptance_histogram_figure
from treeviz.errors import USER_FACING, UserError, friendly_error
from treeviz.gpu import GPU_SECONDS_MAX, gpu, is_zero_gpu_error, zero_gpu_message
from treeviz.html import ar_source_text
from treeviz.runs import BACKEND, Cancel, Status, Step, request_key
from treeviz.throttle import UpdateThrottle
from treeviz.tree_figure import grow_frame, small_multiples
from treeviz.views import (MEASURING_BADGE, PENDING_BADGE, RUN_OUTPUTS, compare_row, compare_table,
                           last_index, outputs, render_views, run_summary, save_trace, status_html, streamed_views)

log = logging.getLogger("treeviz")
N_RUN_OUTPUTS = len(RUN_OUTPUTS)
COMPARE_EXTRA = ("compare_table", "compare_plot", "compare_calibration", "compare_histogram")
COMPARE_OUTPUTS = RUN_OUTPUTS + COMPARE_EXTRA


def status_update(text: str, error: bool = False, names: tuple[str, ...] = RUN_OUTPUTS) -> tuple:
    return outputs({"status": status_html(text, error=error)}, names)


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
                       strategy=strategy, preset=preset or "cpu", params=dict(params or {}),
                       max_new_tokens=int(max_new_tokens), temperature=float(temperature or 0.0),
                       top_p=float(top_p), top_k=int(top_k or 0), seed=int(seed or 0),
                       verifier=str(verifier or "auto"))
    except (TypeError, ValueError) as err:
        raise gr.Error(f"Bad setting: {err}") from None


def wait_for_pair(name: str, cancel: Cancel, names: tuple[str, ...] = RUN_OUTPUTS) -> Iterator[tuple]:
    """Yield loading progress until the pair is ready (on CPU, outside the GPU slot); UserError if it fails."""
    BACKEND.pairs.request(name)
    last = 0.0
    while BACKEND.pairs.ready(name) is None and not cancel.is_set():
        if time.monotonic() - last > 0.5:
            last = time.monotonic()
            frac, msg = BACKEND.pairs.status()["progress"]
            yield outputs({"status": status_html(f"waiting for the models: {msg}", progress=frac)}, names)


# -- the skeleton Run and Compare share ----------------------------------------------------------------------------
def in_session(request: gr.Request, spec: RunSpec, names: tuple[str, ...], opening: tuple,
               work: Callable[[str], Iterator[tuple]], view: str = "run") -> Iterator[tuple]:
    """One request's run in its browser session (a newer one for the same `view` cancels it): the opening update,
    the wait for the pair (CPU side), then `work(key)` (the GPU side; `key` names its cancel flag); its errors as one
    plain status line."""
    key = request_key(request.session_hash or "default", view)
    cancel = BACKEND.begin(key)
    try:
        yield opening
        yield from wait_for_pair(spec.pair, cancel, names)
        if not cancel.is_set():
            yield from work(key)
    except UserError as err:
        yield status_update(str(err), error=True, names=names)
    except gr.Error as err:
        if not is_zero_gpu_error(err):
            raise
        yield status_update(zero_gpu_message(err), error=True, names=names)
    finally:
        BACKEND.end(key, cancel)


def run_view_busy(request: gr.Request) -> bool:
    """Whether a Run or Compare of this browser session is decoding. A step chained after a Run or Compare
    re-renders the views from the session's state; while a newer request decodes, that render shows a moment of
    it and can land after its last update (a Compare then ended on an earlier method's metrics), so the step stands
    aside: the newer request's own updates own the views."""
    return BACKEND.busy(request_key(request.session_hash or "default", "run"))


def rendered_after_run(request: gr.Request, render: Callable[[], Any], skipped: Any) -> Any:
    """`render()` for a step chained after a Run or Compare, or `skipped` (its outputs left alone) while a newer
    Run or Compare of the session decodes now or began while it rendered (run_view_busy)."""
    if run_view_busy(request):
        return skipped
    rendered = render()
    return skipped if run_view_busy(request) else rendered


def loaded_pair(spec: RunSpec, button: str):
    pair = BACKEND.pairs.ready(spec.pair, timeout=0)
    if pair is None:
        raise UserError(f"the model pair is not loaded yet: press {button} again")
    return pair


def reported(updates: Iterator[tuple], names: tuple[str, ...], what: str) -> Iterator[tuple]:
    """`updates`, with any error as one plain status line (the traceback goes to the log)."""
    try:
        yield from updates
    except Exception as err:  # noqa: BLE001 - engine errors become one plain line, the traceback goes to the log
        if not isinstance(err, USER_FACING):
            log.warning("%s failed:\n%s", what, traceback.format_exc())
        yield status_update(friendly_error(err), error=True, names=names)


# -- Run ---------------------------------------------------------------------------------------------------------------
def run(prompt: str, chat: bool, pair: str, strategy: str, preset: str, max_new_tokens: float, temperature: float,
        top_p: float, top_k: float, seed: float, verifier: str, params: dict, stage_mode: str,
        request: gr.Request) -> Iterator[tuple]:
    """Decode the prompt with the strategy, streaming the tree as it grows; AR runs beside it."""
    spec = spec_from_inputs(prompt, chat, pair, strategy, preset, max_new_tokens, temperature, top_p, top_k, seed,
                            verifier, params)
    # a fresh run: clear the previous run's views that would otherwise look current (the tree and the text stay
    # until the first streamed iteration replaces them)
    empty = render_views(None, None, None)
    opening = outputs({"run": None, "ar": None, "scrubber": gr.update(value=0, maximum=1),
                       "status": status_html(f"starting {spec.strategy} on {spec.pair}…"), "download": None,
                       **{name: view for name, view in empty.items() if name not in ("tree", "text")},
                       "badge": PENDING_BADGE})
    yield from in_session(request, spec, RUN_OUTPUTS, opening,
                          lambda session: decode_views(spec, session, stage_mode))


def _run_seconds(spec: RunSpec, session: str, stage_mode: str) -> int:
    """The GPU slot to ask ZeroGPU for: generous per token, capped (longer asks wait longer in its queue)."""
    return min(GPU_SECONDS_MAX, 20 + spec.max_new_tokens // 4)


@gpu(duration=_run_seconds)
def decode_views(spec: RunSpec, session: str, stage_mode: str) -> Iterator[tuple]:
    """Iterate the decoding loop under the pair's lock; yield run outputs (picklable: see the module docstring)."""
    yield from reported(_decode_updates(spec, session, stage_mode), RUN_OUTPUTS, "run")


def _decode_updates(spec: RunSpec, session: str, stage_mode: str) -> Iterator[tuple]:
    cancel = BACKEND.cancel_of(session)
    live, shown = LiveUpdates(spec), False
    for item in BACKEND.decode(loaded_pair(spec, "Run"), spec, cancel):
        if isinstance(item, Status):
            yield status_update(item.text)
        elif isinstance(item, Step):
            if not cancel.is_set():
                yield from live.after_iteration(item.run)
        elif item.result is not None and not shown:
            shown = True
            yield _finished(item.result, item.ar, stage_mode)
        elif item.result is not None:
            yield _baseline(item.result, item.ar, stage_mode)
        elif not cancel.superseded:  # a newer run of this session owns the views: leave them alone
            yield status_update("stopped")


class LiveUpdates:
    """The streamed updates of one decode, sent when its throttle allows: each shows the run so far (the iterations
    since the last update batched in), the newest tree on a frame grown to fit every tree so far."""

    def __init__(self, spec: RunSpec):
        self.spec, self.throttle = spec, UpdateThrottle()
        self.frame, self.framed = None, 0

    def after_iteration(self, run) -> Iterator[tuple]:
        """The update after one more iteration of `run` (a DecodeRun), or nothing if none is due yet."""
        if not self.throttle.due():
            return
        started = self.throttle.clock()
        snap = run.snapshot()  # only when shown: it re-decodes the text and recomputes metrics
        for iteration in snap.iterations[self.framed:]:
            self.frame = grow_frame(self.frame, iteration)
        batched, self.framed = len(snap.iterations) - self.framed, len(snap.iterations)
        yield _streamed(self.spec, snap, self.frame, batched)
        self.throttle.sent(started)  # resumed: Gradio has serialised and sent the update meanwhile


def _streamed(spec: RunSpec, snap, frame: dict, batched: int = 1) -> tuple:
    """One live update: the run so far (`batched` iterations since the last update; the scrubber reaches them all)."""
    n = len(snap.iterations)
    since = f" ({batched} iterations since the last update)" if batched > 1 else ""
    status = status_html(f"decoding with {spec.strategy}: iteration {n - 1}, {snap.metrics['new_tokens']} tokens, "
                         f"{snap.metrics['total_s']:.1f}s{since}")
    # the snapshot goes to the run state too: after a Stop the views scrub what was streamed
    return outputs({"run": snap, "ar": None, "scrubber": gr.update(maximum=max(1, n - 1), value=n - 1),
                    "status": status, **streamed_views(snap, frame)})


def _finished(result, ar, stage_mode: str) -> tuple:
    """The run as soon as it ends, every view at its last iteration; without AR (not measured yet) its baseline
    follows in `_baseline`."""
    n = last_index(result)
    views = render_views(result, ar, n, stage_mode)
    status = run_status(result) + ("" if ar is not None else " — measuring AR on the same prompt…")
    return outputs({"run": result, "ar": ar, "scrubber": gr.update(maximum=max(1, n or 0), value=n or 0),
                    "status": status_html(status), "download": save_trace(result), **views,
                    **({"badge": MEASURING_BADGE} if ar is None else {})})


def _baseline(result, ar, stage_mode: str) -> tuple:
    """AR's measurement arrived: every view again at the last iteration, now with AR beside the run (the last value
    of /run is complete for an API caller). The scrubber is left where the user put it meanwhile: the page puts the
    views back at its position right after (ui._wire_runs)."""
    views = render_views(result, ar, last_index(result), stage_mode)
    return outputs({"run": result, "ar": ar, "status": status_html(run_status(result)),
                    "download": save_trace(result), **views})


def run_status(result) -> str:
    """The finished run's line, with its speedup and how it was measured: a streamed run against AR measured
    for it or reused from the cache (the race is the fair side-by-side measurement)."""
    comparison = result.comparison or {}
    speedup = comparison.get("speedup_vs_ar")
    if not speedup or result.strategy == AR:
        return run_summary(result)
    return (f"{run_summary(result)} — speedup {speedup:.2f}× vs AR: this run was streamed (drawn while it decoded) "
            f"against {ar_source_text(comparison) or 'AR'}; the Race tab measures both unobserved, back to back")


def stop(request: gr.Request) -> str:
    """Stop button: raise the session's cancel flags, every view's (Gradio's `cancels=` ends the handlers)."""
    if not BACKEND.stop(request.session_hash or "default"):
        gr.Info("Nothing is running.")
        return gr.skip()
    return status_html("stopped: the views show the run up to the last streamed iteration")


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
    opening = status_update("comparing: measuring AR first…", names=COMPARE_OUTPUTS)
    yield from in_session(request, spec, COMPARE_OUTPUTS, opening,
                          lambda session: compare_views(spec, session, methods, stage_mode))


def _compare_seconds(spec: RunSpec, session: str, methods: list[str], stage_mode: str) -> int:
    return min(GPU_SECONDS_MAX, 20 + (1 + len(methods)) * spec.max_new_tokens // 4)


@gpu(duration=_compare_seconds)
def compare_views(spec: RunSpec, session: str, methods: list[str], stage_mode: str) -> Iterator[tuple]:
    """Compare outputs after each method: the table, first trees and calibration so far, and the main views (metrics
    row included) showing the method just finished; picklable like decode_views."""
    yield from reported(_compare_updates(spec, session, methods, stage_mode), COMPARE_OUTPUTS, "compare")


def _compare_updates(spec: RunSpec, session: str, methods: list[str], stage_mode: str) -> Iterator[tuple]:
    cancel, names = BACKEND.cancel_of(session), COMPARE_OUTPUTS
    rows, trees, runs, ar_note, last_shown = [], [], [], "", {}
    for item in BACKEND.compare(loaded_pair(spec, "Compare"), spec, methods, cancel):
        if isinstance(item, Status):
            yield status_update(item.text, names=names)
            continue
        result, ar = item.result, item.ar
        rows.append(compare_row(result, ar))
        shown = {}
        if result is ar:
            ar_note = ar_source_text(ar.comparison)
        else:
            runs.append((result.strategy, result))
            if result.iterations:
                trees.append((result.strategy, result.iterations[0]))
            n = last_index(result)
            shown = {"run": result, "ar": ar, "scrubber": gr.update(maximum=max(1, n or 0), value=n or 0),
                     "download": save_trace(result), **render_views(result, ar, n, stage_mode)}
        last_shown = shown or last_shown
        yield outputs({**shown, "status": status_html(f"compare: {result.strategy} done"),
                       **_compare_extra(rows, trees, runs)}, names)
    if cancel.is_set():
        if not cancel.superseded:
            yield status_update("comparison stopped", names=names)
    elif rows:  # the last value carries the comparison: an API caller reads only the last
        summary = f"compared {len(rows)} methods on the same prompt" + (f" ({ar_note})" if ar_note else "")
        # the last method's views again: a page that coalesced the streamed updates still ends on them
        yield outputs({**last_shown, "status": status_html(summary), **_compare_extra(rows, trees, runs)}, names)


def _compare_extra(rows: list[dict], trees: list, runs: list) -> dict:
    return {"compare_table": compare_table(rows), "compare_calibration": calibration_figure(runs),
            "compare_histogram": acceptance_histogram_figure(runs),
            **({"compare_plot": small_multiples(trees)} if trees else {})}
