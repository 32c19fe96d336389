"""The Gradio app: a live draft-tree explorer. `build_demo` lays out the page section by section and wires the
events; the handlers that touch models live in treeviz/handlers.py, the views in treeviz/views.py, the page's Markdown,
CSS and JavaScript in treeviz/static/.

API (gradio_client): /run takes prompt, chat, pair, strategy, preset, max_new_tokens, temperature, top_p, top_k,
seed, verifier, params (a dict of the strategy's parameters by name), stage_mode; /compare takes the same plus
methods and stage_mode; /stop, /scrub, /inspect (a node of the shown iteration), /upload, /gallery. The teaching
tabs (treeviz/teaching_ui.py): /race takes prompt, chat, pair, strategies, max_new_tokens, temperature, top_p, top_k,
seed, verifier; /sweep takes prompt, chat, pair, strategy, preset, params, max_new_tokens, size_min, size_max, points
and the same sampling settings (treeviz/teaching_handlers.py).
"""
from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import gradio as gr

from engine.core.prompts import PROMPT_SETS, load_prompt_set
from engine.strategies import STRATEGIES
from engine.verify import VERIFIERS
from treeviz import handlers, teaching_ui
from treeviz.charts import calibration_figure, charts_figure, cost_figure, throughput_figure
from treeviz.controls import ParamControls, verifier_options
from treeviz.html import badge_html, token_legend_html, tokens_html
from treeviz.inspector import inspect, inspector_figure, inspector_html
from treeviz.pairs import pair_choices
from treeviz.replay import gallery_label, gallery_traces, replay
from treeviz.runs import BACKEND
from treeviz.tree_figure import tree_figure
from treeviz.views import VIEW_NAMES, render_views, status_html

log = logging.getLogger("treeviz")
STATIC_DIR = Path(__file__).resolve().parent / "static"
DEFAULT_STRATEGY = "dynatree"

FALLBACK_PROMPTS = [
    {"name": "code: fibonacci", "kind": "code", "prompt": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"},
    {"name": "chat: explain", "kind": "chat",
     "prompt": [{"role": "user", "content": "Explain speculative decoding in two sentences."}]},
    {"name": "prose: story", "kind": "prose", "prompt": "Once upon a time, in a small village by the sea,"},
]


def static_text(name: str) -> str:
    """A file of treeviz/static: the "How to read this" Markdown, the page's CSS, its JavaScript (node clicks)."""
    return (STATIC_DIR / name).read_text(encoding="utf-8")


# -- data helpers ------------------------------------------------------------------------------------------------------
def load_examples() -> list[dict]:
    """The shipped prompt sets (engine.core.prompts), entries without a prompt left out; a few built-in ones if none load."""
    entries = []
    for kind in PROMPT_SETS:
        try:
            data = load_prompt_set(kind)
        except (OSError, ValueError):
            continue
        for e in data if isinstance(data, list) else []:
            if isinstance(e, dict) and e.get("prompt"):
                entries.append({"name": str(e.get("name") or kind), "kind": e.get("kind", kind), "prompt": e["prompt"]})
    return entries or FALLBACK_PROMPTS


def example_label(e: dict) -> str:
    p = e["prompt"]
    text = p if isinstance(p, str) else " / ".join(str(m.get("content", "")) for m in p if m.get("role") == "user")
    text = " ".join(text.split())
    return f"{e['kind']}: {text[:60]}{'…' if len(text) > 60 else ''}"


def model_status_html() -> str:
    st = BACKEND.pairs.status()
    if st["error"]:
        return status_html(f"models ({st['name']}): {st['error']}", error=True)
    if st["loading"]:
        frac, msg = st["progress"]
        return status_html(f"loading {st['name']}: {msg} — the gallery and uploads work meanwhile; "
                           "the tiny-random pair loads instantly", progress=frac)
    if st["loaded"]:
        capture = f" — {st['capture']}" if st.get("capture") else ""
        return status_html(f"models ready: {st['description']}{capture}")
    return status_html("no models loaded (press Run to load the selected pair)")


# -- layout: one function per section ---------------------------------------------------------------------------
def _inputs(ui: SimpleNamespace, initial_pair: str, examples: list[dict]) -> None:
    traces = gallery_traces()
    ui.gallery = gr.Dropdown([(gallery_label(p), str(p)) for p in traces], value=str(traces[0]) if traces else None,
                             label="Gallery: precomputed runs (no models needed)", elem_id="tv-gallery")
    ui.example = gr.Dropdown([example_label(e) for e in examples], value=None,
                             label="Example prompts (code, chat, prose)", elem_id="tv-example")
    first = examples[0]["prompt"] if examples else None
    ui.prompt = gr.Textbox(label="Prompt", lines=4, max_lines=8, elem_id="tv-prompt",
                           value=first if isinstance(first, str) else "def fibonacci(n):\n")
    ui.chat = gr.Checkbox(value=False, label="send as a chat message (chat template)")
    with gr.Row():
        ui.run_btn = gr.Button("Run", variant="primary", elem_id="tv-run")
        ui.stop_btn = gr.Button("Stop", variant="stop", elem_id="tv-stop")
        ui.compare_btn = gr.Button("Compare", elem_id="tv-compare")
    pairs = pair_choices()
    ui.pair = gr.Dropdown(pairs if initial_pair in pairs else [initial_pair] + pairs, value=initial_pair,
                          label="Model pair (target + draft)", allow_custom_value=True, elem_id="tv-pair",
                          info="tiny-random plays instantly; hub pairs need network")
    ui.strategy = gr.Dropdown([(cls.label or s, s) for s, cls in STRATEGIES.items()], value=DEFAULT_STRATEGY,
                              label="Tree strategy", elem_id="tv-strategy")
    ui.summary = gr.Markdown(STRATEGIES[DEFAULT_STRATEGY].summary or "")
    ui.max_new = gr.Slider(1, 512, value=48, step=1, label="max new tokens", elem_id="tv-max-new")


def _sampling(ui: SimpleNamespace) -> None:
    with gr.Accordion("Sampling", open=False):
        ui.temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="temperature (0 = greedy)")
        ui.top_p = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="top-p")
        ui.top_k = gr.Slider(0, 200, value=0, step=1, label="top-k (0 = off)")
        ui.seed = gr.Number(value=0, precision=0, label="seed")
        # every rule, so /run accepts any (the engine refuses a rule that cannot check the strategy's trees, in one
        # plain line); the page narrows the list to the selected strategy's compatible rules when it loads
        ui.verifier = gr.Dropdown(verifier_options(["auto", *VERIFIERS]), value="auto", label="verification rule",
                                  elem_id="tv-verifier",
                                  info="auto: greedy at temperature 0, else token matching / SpecInfer")


def _strategy_params(ui: SimpleNamespace) -> None:
    with gr.Accordion("Strategy parameters", open=True):
        ui.preset = gr.Dropdown(STRATEGIES[DEFAULT_STRATEGY].preset_names(), value="cpu", label="preset",
                                info="cpu: tuned for a 2-core CPU; paper: the paper's values; "
                                     "auto: sized every iteration from this machine's measured costs")
        ui.controls = ParamControls.build(DEFAULT_STRATEGY)
        # the selected strategy's values by name, collected before every run: what /run's `params` receives
        ui.params = gr.JSON({}, visible=False, elem_id="tv-params")


def _views(ui: SimpleNamespace) -> None:
    with gr.Row(equal_height=True):
        ui.model_status = gr.HTML(status_html("starting…"), elem_id="tv-model-status")
        ui.run_status = gr.HTML(status_html("Pick a gallery trace or press Run."), elem_id="tv-run-status")
    ui.badge = gr.HTML(badge_html(None), elem_id="tv-badge")
    ui.tree = gr.Plot(tree_figure(None), label="Draft tree", show_label=False, elem_id="tv-tree")
    ui.scrubber = gr.Slider(0, 1, value=0, step=1, label="iteration (drag to replay the run; no models needed)",
                            elem_id="tv-scrubber")
    teaching_ui.entropy_box(ui)
    with gr.Row(equal_height=False):
        # a click on a tree node writes its id here (static/script.js); typing an id works too
        ui.node = gr.Number(None, precision=0, minimum=0, label="inspect node (click one in the tree)",
                            elem_id="tv-node", scale=0, min_width=170)
        ui.inspector = gr.HTML(inspector_html(None, None, None), elem_id="tv-inspector")
    ui.inspector_plot = gr.Plot(inspector_figure(None, None), show_label=False, elem_id="tv-inspector-plot")
    gr.HTML(token_legend_html())
    ui.text = gr.HTML(tokens_html(None), elem_id="tv-text")
    ui.metrics = gr.HTML("", elem_id="tv-metrics")


def _tabs(ui: SimpleNamespace) -> None:
    with gr.Tabs():
        with gr.Tab("Charts"):
            ui.stage_mode = gr.Radio(["per iteration", "total"], value="per iteration", label="stage times",
                                     elem_id="tv-stage-mode")
            ui.charts = gr.Plot(charts_figure(None), label="Run charts", show_label=False, elem_id="tv-charts")
            ui.throughput = gr.Plot(throughput_figure(None, None), label="Throughput vs AR", show_label=False,
                                    elem_id="tv-throughput")
            teaching_ui.run_histogram(ui)
        with gr.Tab("Calibration"):
            ui.calibration = gr.Plot(calibration_figure([]), show_label=False, elem_id="tv-calibration")
        with gr.Tab("Costs"):
            ui.costs = gr.Plot(cost_figure(None), show_label=False, elem_id="tv-costs")
        with gr.Tab("Compare"):
            methods = [s for s in STRATEGIES if s != "ar"]
            ui.compare_methods = gr.CheckboxGroup(
                methods, value=methods[:4], elem_id="tv-compare-methods",
                label="Strategies to compare with AR (each with its cpu preset; the selected strategy with your "
                      "slider values)")
            ui.compare_table = gr.Dataframe(label="Same prompt, same session", interactive=False,
                                            elem_id="tv-compare-table")
            ui.compare_plot = gr.Plot(label="First tree of each strategy", show_label=False, elem_id="tv-compare-plot")
            ui.compare_calibration = gr.Plot(calibration_figure([]), show_label=False,
                                             elem_id="tv-compare-calibration")
            teaching_ui.compare_histogram(ui)
        teaching_ui.race_tab(ui)
        teaching_ui.step_tab(ui)
        teaching_ui.sweep_tab(ui)
        with gr.Tab("Traces"):
            with gr.Row():
                ui.download = gr.File(label="Download this run (JSON trace)", interactive=False, elem_id="tv-download")
                ui.upload = gr.File(label="Replay a trace (.json): no models needed", file_types=[".json"],
                                    type="filepath", elem_id="tv-upload")
            teaching_ui.html_download(ui)
        with gr.Tab("How to read this"):
            gr.Markdown(static_text("how_to_read.md"))


# -- wiring ------------------------------------------------------------------------------------------------------------
def _wire_runs(ui: SimpleNamespace) -> None:
    """Run (button, Enter, releasing a slider), Compare. Each run trigger first collects the strategy's parameters by
    name into ui.params (ui.collect), then calls the run handler with them (so /run takes them by name too); the
    handler's last update carries every view and the teaching panels (the step-through's animation frames are added
    by the page's script after it)."""
    settings = [ui.prompt, ui.chat, ui.pair, ui.strategy, ui.preset, ui.max_new, ui.temperature, ui.top_p, ui.top_k,
                ui.seed, ui.verifier, ui.params]
    ui.view_outputs = [getattr(ui, name) for name in VIEW_NAMES]
    ui.run_outputs = [ui.run_state, ui.ar_state, ui.scrubber, ui.run_status, ui.download] + ui.view_outputs
    panels = [ui.step_plot, ui.acceptance]
    ui.collect = collect = dict(fn=ui.controls.collect, inputs=[ui.strategy, *ui.controls.components],
                                outputs=ui.params, queue=False, show_progress="hidden", api_visibility="private")
    live = ui.controls.components + [ui.max_new, ui.temperature, ui.top_p, ui.top_k]
    triggers = [(ui.run_btn.click, "run"), (ui.prompt.submit, None)] + [
        (c.release if isinstance(c, gr.Slider) else c.input if isinstance(c, gr.Checkbox) else c.submit, None)
        for c in live]  # live tuning: committing a new value re-runs (superseding the older Run, not a race or sweep)
    for trigger, api_name in triggers:
        run = trigger(**collect).then(
            handlers.run, settings + [ui.stage_mode], ui.run_outputs + panels, concurrency_limit=None,
            show_progress="minimal" if api_name else "hidden",
            **({"api_name": api_name} if api_name else {"api_visibility": "private"}))
        teaching_ui.with_frames(run, ui.step_plot, "tv-step")
    compare = ui.compare_btn.click(**collect).then(
        handlers.compare, settings + [ui.compare_methods, ui.stage_mode],
        ui.run_outputs + [ui.compare_table, ui.compare_plot, ui.compare_calibration, ui.compare_histogram] + panels,
        concurrency_limit=None, api_name="compare")
    teaching_ui.with_frames(compare, ui.step_plot, "tv-step")


def _wire_stop(ui: SimpleNamespace) -> None:
    """Stop raises the flag of everything this browser session runs; each run says it stopped in its own line."""
    ui.stop_btn.click(handlers.stop, None, ui.run_status, api_name="stop", concurrency_limit=None, queue=False)


def _wire_views(ui: SimpleNamespace) -> None:
    """Scrubbing, stage mode, the node inspector, trace replays: no models involved."""

    def on_stage(run, index, stage_mode):
        return charts_figure(run, selected=int(index) if run is not None and run.iterations else None,
                             stage_mode=stage_mode)

    teaching_ui.follow(ui, ui.scrubber.input(
        show_iteration, [ui.run_state, ui.ar_state, ui.scrubber, ui.stage_mode, ui.node], ui.view_outputs,
        show_progress="hidden", api_name="scrub", concurrency_limit=None))
    ui.stage_mode.change(on_stage, [ui.run_state, ui.scrubber, ui.stage_mode], ui.charts, show_progress="hidden")
    ui.node.input(inspect, [ui.run_state, ui.scrubber, ui.node], [ui.node, ui.inspector, ui.inspector_plot],
                  show_progress="hidden", api_name="inspect", concurrency_limit=None)
    teaching_ui.follow(ui, ui.upload.upload(lambda path, stage_mode: replay(path, stage_mode, "uploaded trace"),
                                            [ui.upload, ui.stage_mode], ui.run_outputs, api_name="upload"))
    teaching_ui.follow(ui, ui.gallery.input(on_gallery, [ui.gallery, ui.stage_mode], ui.run_outputs,
                                            api_name="gallery"))


def show_iteration(run, ar, index, stage_mode, node, request: gr.Request = None):
    """Every view at iteration `index` (node `node` inspected): scrubbing, no models involved. The index is kept as
    the page's state: a Run whose AR is still being measured ends on it."""
    if run is None:  # nothing to show yet: leave the views alone
        return [gr.skip()] * len(VIEW_NAMES)
    BACKEND.page(handlers.browser_of(request)).shown = None if index is None else int(index)
    views = render_views(run, ar, index, stage_mode, node)
    return [views[name] for name in VIEW_NAMES]


def on_gallery(path, stage_mode):
    return replay(path, stage_mode, f"gallery trace '{Path(path).stem}'" if path else "gallery")


def _wire_controls(ui: SimpleNamespace, examples: list[dict]) -> None:
    """Controls that change other controls, and the model status line."""
    labels = [example_label(e) for e in examples]

    def on_example(label):
        if label not in labels:
            return gr.skip(), gr.skip()
        p = examples[labels.index(label)]["prompt"]
        if isinstance(p, list):
            user = [m.get("content", "") for m in p if m.get("role") == "user"]
            return gr.update(value=user[-1] if user else ""), gr.update(value=True)
        return gr.update(value=p), gr.update(value=False)

    def on_pair(name):
        if name:
            BACKEND.pairs.request(str(name))
        return model_status_html()

    groups = list(ui.controls.groups.values())
    ui.strategy.change(ui.controls.strategy_updates, [ui.strategy, ui.verifier],
                       [ui.summary, ui.preset, ui.verifier] + groups)
    ui.demo.load(lambda verifier: ui.controls.strategy_updates(DEFAULT_STRATEGY, verifier)[2], ui.verifier,
                 ui.verifier, queue=False, api_visibility="private")
    ui.preset.input(ui.controls.preset_updates, [ui.strategy, ui.preset], ui.controls.components, api_name="on_preset")
    ui.example.input(on_example, ui.example, [ui.prompt, ui.chat], api_name="on_example")
    ui.pair.input(on_pair, ui.pair, ui.model_status)
    gr.Timer(1.0).tick(model_status_html, None, ui.model_status, show_progress="hidden", queue=False,
                       api_visibility="private")


def build_demo(initial_pair: str = "default", load_on_start: bool = True) -> gr.Blocks:
    examples = load_examples()
    if load_on_start:
        BACKEND.pairs.request(initial_pair)
    ui = SimpleNamespace()
    with gr.Blocks(title="treeviz: speculative decoding draft trees") as demo:
        ui.demo = demo
        ui.run_state = gr.State(None)  # RunResult shown now (a partial snapshot while streaming)
        ui.ar_state = gr.State(None)   # AR RunResult for the same prompt
        ui.race_runs = gr.State(None)  # the last race's [(label, RunResult)], AR first
        gr.Markdown("## treeviz — watch a draft model's token tree get verified by the target, live")
        with gr.Row(equal_height=False):
            with gr.Column(scale=1, min_width=330):
                _inputs(ui, initial_pair, examples)
                _sampling(ui)
                _strategy_params(ui)
            with gr.Column(scale=3):
                _views(ui)
                _tabs(ui)
        _wire_runs(ui)
        teaching_ui.wire(ui)
        _wire_stop(ui)
        _wire_views(ui)
        _wire_controls(ui, examples)
        demo.load(model_status_html, None, ui.model_status, queue=False, api_visibility="private")
        if ui.gallery.value:
            teaching_ui.follow(ui, demo.load(on_gallery, [ui.gallery, ui.stage_mode], ui.run_outputs))
    return demo


def launch_kwargs() -> dict:
    # Gradio refuses uploads over this at the transport; replay.MAX_TRACE_MB gives the plain message below it
    return {"css": static_text("style.css"), "js": static_text("script.js"), "theme": gr.themes.Soft(),
            "max_file_size": "64mb"}
