"""The teaching sections of the page: the Race, Step through and Sweep tabs, the acceptance-length
histograms, the "size nodes by draft entropy" switch and the Download HTML button; each builder adds its components
to the page (treeviz/page/components.py's `Page`; treeviz/page/ui.py calls them inside its layout), `wire` connects
them.

Models are touched only by the Race and Sweep handlers (treeviz/page/teaching_handlers.py); everything else here reads
the shown run's records, so a gallery trace shows it with no model loaded.
"""
from __future__ import annotations

import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import gradio as gr
import plotly.graph_objects as go

from engine.bench.sweep import DEFAULT_POINTS, MAX_POINTS
from engine.strategies import STRATEGIES
from treeviz.figures.charts_teaching import ENTROPY_NOTE, acceptance_histogram_figure
from treeviz.figures.export import export_html
from treeviz.figures.sweep_figure import sweep_figure
from treeviz.page import teaching_handlers
from treeviz.page.components import SHOWN, Page
from treeviz.page.handlers import browser_of
from treeviz.page.replay import TRACE_DIR
from treeviz.page.views import empty_figure, iteration_panels, shown_tree, status_html
from treeviz.serving.server import SERVER

log = logging.getLogger("treeviz")
SWEEP_DIR = TRACE_DIR / "sweeps"
RACE_HINT = ("Pick strategies and press Race: AR and each strategy decode the prompt one after the other, unobserved "
             "(only this status line while they run), then replay side by side at their measured pace.")


def default_sweep() -> tuple[dict | None, str]:
    """The first precomputed sweep (assets/traces/sweeps/*.json, written by scripts/make_sweep.py) and a line
    saying so; (None, a hint) when there is none or it does not read."""
    for path in sorted(SWEEP_DIR.glob("*.json")) if SWEEP_DIR.is_dir() else []:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(data, dict) and data.get("points"):
                where = data.get("machine") or "a machine it does not name"
                return data, (f"precomputed sweep ({path.stem}), measured on {where}: press Sweep to measure one "
                              "on this machine")
        except (OSError, ValueError) as err:
            log.info("skipping precomputed sweep %s: %s", path, err)
    return None, "Set a range (blank: the default) and press Sweep."


# -- layout --------------------------------------------------------------------------------------------------------
def entropy_box(page: Page) -> None:
    """Beside the tree: node sizes from the draft's entropy at each node's parent."""
    page.entropy = gr.Checkbox(False, label="size nodes by draft entropy", elem_id="tv-entropy", info=ENTROPY_NOTE)


def run_histogram(page: Page) -> None:
    """In the Charts tab: the shown run's acceptance-length histogram."""
    page.acceptance = gr.Plot(acceptance_histogram_figure([]), show_label=False, elem_id="tv-acceptance")


def compare_histogram(page: Page) -> None:
    """In the Compare tab: every compared run's acceptance-length histogram, side by side."""
    page.compare_histogram = gr.Plot(acceptance_histogram_figure([]), show_label=False, elem_id="tv-compare-histogram")


def race_tab(page: Page) -> None:
    with gr.Tab("Race", elem_id="tv-race-tab"):
        methods = [s for s in STRATEGIES if s != "ar"]
        with gr.Row(equal_height=True):
            # a multiselect that takes typed values too: "dynatree@paper" races another preset
            page.race_strategies = gr.Dropdown(methods, value=list(teaching_handlers.DEFAULT_RACE), multiselect=True,
                                               allow_custom_value=True, scale=4, elem_id="tv-race-strategies",
                                               label="Strategies to race against AR (auto preset each: sized by this machine's costs; type "
                                                   "name@preset for another preset)")
            page.race_btn = gr.Button("Race", variant="primary", scale=1, elem_id="tv-race-btn")
        page.race_status = gr.HTML(status_html(RACE_HINT), elem_id="tv-race-status")
        page.race_plot = gr.Plot(empty_figure("no race yet"), show_label=False, elem_id="tv-race")
        with gr.Accordion("Race data (what /race returns)", open=False):
            page.race_summary = gr.JSON(None, elem_id="tv-race-summary")


def step_tab(page: Page) -> None:
    with gr.Tab("Step through", elem_id="tv-step-tab"):
        gr.Markdown("The iteration the scrubber selects, step by step: the draft grows the tree, the target "
                    "judges it node by node, the accepted path and the bonus are committed. Press play or drag.")
        page.step_plot = gr.Plot(empty_figure("pick a gallery trace or run a prompt"), show_label=False,
                                 elem_id="tv-step")


def sweep_tab(page: Page) -> None:
    sweep, hint = default_sweep()
    with gr.Tab("Sweep", elem_id="tv-sweep-tab"):
        page.sweep_knob = gr.Markdown(knob_text("dynatree"))
        with gr.Row(equal_height=True):
            page.size_min = gr.Number(None, precision=0, label="size from (blank: default)", elem_id="tv-sweep-min")
            page.size_max = gr.Number(None, precision=0, label="size to (blank: default)", elem_id="tv-sweep-max")
            page.points = gr.Slider(2, MAX_POINTS, value=DEFAULT_POINTS, step=1, label="points",
                                        elem_id="tv-sweep-points")
            page.sweep_btn = gr.Button("Sweep", variant="primary", elem_id="tv-sweep-btn")
        page.sweep_status = gr.HTML(status_html(hint), elem_id="tv-sweep-status")
        page.sweep_plot = gr.Plot(sweep_figure(sweep), show_label=False, elem_id="tv-sweep")
        with gr.Accordion("Sweep data (what /sweep returns)", open=False):
            page.sweep_summary = gr.JSON(sweep, elem_id="tv-sweep-summary")


def html_download(page: Page) -> None:
    """In the Traces tab: the race, the selected iteration step by step and the run's trees as one HTML page."""
    with gr.Row(equal_height=True):
        page.html_btn = gr.Button("Download HTML (race + step-through + trees, opens offline)", elem_id="tv-html-btn")
        page.html_file = gr.File(label="Teaching page (.html)", interactive=False, elem_id="tv-html-file")


def knob_text(strategy: str) -> str:
    cls = STRATEGIES.get(strategy)
    if cls is None or cls.auto_param is None:
        knobs = ", ".join(n for n, c in STRATEGIES.items() if c.auto_param)
        return f"**{strategy}** has no size knob to sweep; strategies with one: {knobs}."
    return (f"Sweeps **{strategy}**'s size knob **{cls.auto_param}** (the selected strategy, preset and parameters), "
            "plus AR once, on the prompt: L̄, acceptance and tokens/s against the size.")


def download_html(race_runs, run, index: Any) -> Any:
    """export_html of the race (if any), the shown run and its selected iteration, as a file to download."""
    iteration = None
    if run is not None and run.iterations:
        iteration = run.iterations[max(0, min(int(index or 0), len(run.iterations) - 1))]
    if not race_runs and iteration is None:
        gr.Warning("Nothing to export yet: run a race, run a prompt or pick a gallery trace first.")
        return gr.skip()
    directory = Path(tempfile.gettempdir()) / "treeviz-html"
    directory.mkdir(exist_ok=True)
    path = directory / f"treeviz-class-{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns()}.html"
    return str(export_html(path, race_runs or None, run if iteration is not None else None, iteration))


# -- wiring ----------------------------------------------------------------------------------------------------------
# gr.Plot draws a figure with Plotly.react(data, layout) and drops its animation frames; the race and the step-through
# play frames, so the page adds them to the drawn plot itself (waiting for the plot to be drawn first).
FRAMES_JS = """(value) => {
  const fig = value && value.plot ? (typeof value.plot === 'string' ? JSON.parse(value.plot) : value.plot) : null;
  if (!fig) return;
  let tries = 0;
  const attach = () => {
    const gd = document.querySelector('#ELEM .js-plotly-plot');
    if (!gd || !window.Plotly || !gd._fullLayout) { if (tries++ < 100) setTimeout(attach, 100); return; }
    // one index a call: deleteFrames sorts its list as strings, so [0..10] would delete the wrong frames
    const old = (gd._transitionData && gd._transitionData._frames) || [];
    for (let i = old.length - 1; i >= 0; i--) window.Plotly.deleteFrames(gd, [i]);
    if (fig.frames && fig.frames.length) window.Plotly.addFrames(gd, fig.frames);
  };
  attach();
}"""


def with_frames(event, plot, elem_id: str) -> Any:
    """After `event` updates `plot`: its animation frames added to the drawn figure (FRAMES_JS)."""
    return event.then(None, [plot], None, js=FRAMES_JS.replace("ELEM", elem_id), api_visibility="private")


def follow(page: Page, event) -> Any:
    """After `event` shows another iteration or a replayed run (no models): the step-through, the histogram, the
    entropy tree. A Run or Compare carries these panels in its own last update (treeviz/page/handlers.py)."""
    panels = event.then(iteration_panels, page.inputs(iteration_panels, **SHOWN),
                        [page.step_plot, page.acceptance, page.tree], show_progress="hidden", queue=False,
                        api_visibility="private")
    return with_frames(panels, page.step_plot, "tv-step")


def entropy_switched(run, index: Any, entropy: bool, request: gr.Request) -> go.Figure:
    """The entropy switch: the shown tree re-drawn, and the switch kept as the page's state (a running Run's last
    update draws its tree the same way)."""
    SERVER.page(browser_of(request)).entropy = bool(entropy)
    return shown_tree(run, index, entropy)


def wire(page: Page) -> None:
    """Race, Sweep (both on the API, their inputs named by the handlers' parameters), the entropy switch and the HTML
    download."""
    race = page.race_btn.click(
        teaching_handlers.race, page.inputs(teaching_handlers.race, strategies="race_strategies"),
        page.outputs(teaching_handlers.RACE_OUTPUTS, status="race_status"), api_name="race", concurrency_limit=None,
        show_progress="minimal")
    with_frames(race, page.race_plot, "tv-race")
    page.sweep_btn.click(**page.collect()).then(
        teaching_handlers.sweep, page.inputs(teaching_handlers.sweep),
        page.outputs(teaching_handlers.SWEEP_OUTPUTS, status="sweep_status"), api_name="sweep",
        concurrency_limit=None, show_progress="minimal")
    page.entropy.input(entropy_switched, page.inputs(entropy_switched, **SHOWN), page.tree, show_progress="hidden",
                       queue=False, api_visibility="private")
    page.strategy.change(knob_text, page.strategy, page.sweep_knob, show_progress="hidden", queue=False,
                         api_visibility="private")
    page.html_btn.click(download_html, page.inputs(download_html, **SHOWN), page.html_file, api_visibility="private")
