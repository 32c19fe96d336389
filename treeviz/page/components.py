"""The page's components, declared once, by name and type, in one object (`Page`).

The section builders (treeviz/page/ui.py, treeviz/page/teaching_ui.py) fill in its fields while they lay the page out;
the wiring runs after the whole layout, so no builder depends on another's order. A handler's inputs are named by its
own parameters (`Page.inputs`: the API keeps those names), and its outputs by the names its module declares
(`Page.outputs`). Nothing is matched by hand. A misspelt name fails when the page is built, not when it is clicked
(slots).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, fields
from typing import Any, Callable

import gradio as gr

from treeviz.page.controls import ParamControls


@dataclass(slots=True)
class Page:
    demo: gr.Blocks | None = None
    # what the page holds between events
    run_state: gr.State | None = None           # the RunResult shown now (a partial snapshot while streaming)
    ar_state: gr.State | None = None            # AR's RunResult for the same prompt
    race_runs: gr.State | None = None           # the last race's [(label, RunResult)], AR first
    # inputs
    gallery: gr.Dropdown | None = None
    example: gr.Dropdown | None = None
    prompt: gr.Textbox | None = None
    chat: gr.Checkbox | None = None
    run_btn: gr.Button | None = None
    stop_btn: gr.Button | None = None
    compare_btn: gr.Button | None = None
    pair: gr.Dropdown | None = None
    precision: gr.Radio | None = None           # auto | fp32: folded into the pair's name ("default (fp32)")
    strategy: gr.Dropdown | None = None
    summary: gr.Markdown | None = None
    max_new_tokens: gr.Slider | None = None
    temperature: gr.Slider | None = None
    top_p: gr.Slider | None = None
    top_k: gr.Slider | None = None
    seed: gr.Number | None = None
    verifier: gr.Dropdown | None = None
    preset: gr.Dropdown | None = None
    controls: ParamControls | None = None       # the strategies' parameter controls, one group per strategy
    params: gr.JSON | None = None               # the selected strategy's values by name: what /run's params receives
    # the views of the shown run
    model_status: gr.HTML | None = None
    run_status: gr.HTML | None = None
    badge: gr.HTML | None = None
    tree: gr.Plot | None = None
    scrubber: gr.Slider | None = None
    entropy: gr.Checkbox | None = None
    node: gr.Number | None = None
    inspector: gr.HTML | None = None
    inspector_plot: gr.Plot | None = None
    text: gr.HTML | None = None
    metrics: gr.HTML | None = None
    stage_mode: gr.Radio | None = None
    charts: gr.Plot | None = None
    throughput: gr.Plot | None = None
    acceptance: gr.Plot | None = None
    calibration: gr.Plot | None = None
    costs: gr.Plot | None = None
    step_plot: gr.Plot | None = None
    # Compare
    compare_methods: gr.CheckboxGroup | None = None
    compare_table: gr.Dataframe | None = None
    compare_plot: gr.Plot | None = None
    compare_calibration: gr.Plot | None = None
    compare_histogram: gr.Plot | None = None
    # Race
    race_strategies: gr.Dropdown | None = None
    race_btn: gr.Button | None = None
    race_status: gr.HTML | None = None
    race_plot: gr.Plot | None = None
    race_summary: gr.JSON | None = None
    # Sweep
    sweep_knob: gr.Markdown | None = None
    size_min: gr.Number | None = None
    size_max: gr.Number | None = None
    points: gr.Slider | None = None
    sweep_btn: gr.Button | None = None
    sweep_status: gr.HTML | None = None
    sweep_plot: gr.Plot | None = None
    sweep_summary: gr.JSON | None = None
    # Traces
    download: gr.File | None = None
    upload: gr.File | None = None
    html_btn: gr.Button | None = None
    html_file: gr.File | None = None

    def component(self, name: str) -> Any:
        """The component `name`; LookupError if the page has no such field or the layout has not made it."""
        value = getattr(self, name, None) if name in self.names() else None
        if value is None:
            raise LookupError(f"the page has no component {name!r}")
        return value

    def inputs(self, handler: Callable, **renamed: str) -> list:
        """The components named by `handler`'s parameters, in order (`request` is Gradio's, not a component);
        `renamed`: parameter name -> component name where the API's name differs from the page's."""
        names = [name for name in inspect.signature(handler).parameters if name != "request"]
        return [self.component(renamed.get(name, name)) for name in names]

    def outputs(self, names: tuple[str, ...], **renamed: str) -> list:
        """The components of a handler's output names (its module's tuple, e.g. handlers.RUN_VIEW_OUTPUTS);
        `renamed`: output name -> component name."""
        return [self.component(renamed.get(name, name)) for name in names]

    def collect(self) -> dict[str, Any]:
        """The event that copies the selected strategy's parameter values by name into `params`, run before every
        handler that reads them (so /run and /sweep take them by name too)."""
        return dict(fn=self.controls.collect, inputs=[self.strategy, *self.controls.components], outputs=self.params,
                    queue=False, show_progress="hidden", api_visibility="private")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


# the run views' output names (treeviz/page/views.py) whose component has a longer name on the page
RUN_RENAMED = {"run": "run_state", "ar": "ar_state", "status": "run_status"}
# the parameter names of the functions that show the run on the page (scrub, inspect, panels) -> their components
SHOWN = {"run": "run_state", "ar": "ar_state", "index": "scrubber", "node_id": "node"}
