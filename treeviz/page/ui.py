"""The Gradio app: a live draft-tree explorer. `build_demo` lays out the page section by section and wires the
events; the handlers that touch models live in treeviz/page/handlers.py, the views in treeviz/page/views.py, the page's
Markdown, CSS and JavaScript in treeviz/page/static/.

API (gradio_client): /run takes prompt, chat, pair (a name ending in " (fp32)" serves it in float32, the exact
mode: the Precision switch), strategy, preset, max_new_tokens, temperature, top_p, top_k,
seed, verifier, params (a dict of the strategy's parameters by name), stage_mode; /compare takes the same plus
methods and stage_mode; /stop, /scrub, /inspect (a node of the shown iteration), /upload, /gallery. The teaching
tabs (treeviz/page/teaching_ui.py): /race takes prompt, chat, pair, strategies, max_new_tokens, temperature, top_p,
top_k, seed, verifier; /sweep takes prompt, chat, pair, strategy, preset, params, max_new_tokens, size_min, size_max,
points and the same sampling settings (treeviz/page/teaching_handlers.py).
"""
from __future__ import annotations

import logging
from pathlib import Path

import gradio as gr

from engine.core.prompts import PROMPT_SETS, load_prompt_set
from engine.strategies import STRATEGIES
from engine.verify import VERIFIERS
from treeviz.figures.charts import calibration_figure, charts_figure, cost_figure, throughput_figure
from treeviz.figures.html import SHORT_DTYPES, badge_html, token_legend_html, tokens_html
from treeviz.figures.inspector import inspect, inspector_figure, inspector_html
from treeviz.figures.tree_figure import tree_figure
from treeviz.page import handlers, teaching_ui
from treeviz.page.components import RUN_RENAMED, SHOWN, Page
from treeviz.page.controls import ParamControls, verifier_options
from treeviz.page.replay import gallery_label, gallery_traces, replay
from treeviz.page.views import RUN_OUTPUTS, VIEW_NAMES, render_views, status_html
from treeviz.serving.errors import UserError
from treeviz.serving.pairs import PRECISIONS, auto_dtype_name, pair_choices, split_precision, with_precision
from treeviz.serving.server import SERVER

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
    """A file of treeviz/page/static: the "How to read this" Markdown, the page's CSS, its JavaScript (node clicks)."""
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
    st = SERVER.pairs.status()
    if st.error:
        return status_html(f"models ({st.name}): {st.error}", error=True)
    if st.loading:
        frac, msg = st.progress
        return status_html(f"loading {st.name}: {msg} — the gallery and uploads work meanwhile; "
                           "the tiny-random pair loads instantly", progress=frac)
    if st.loaded:
        capture = f" — {st.capture}" if st.capture else ""
        return status_html(f"models ready: {st.description}{capture}")
    return status_html("no models loaded (press Run to load the selected pair)")


def serve(pair: str, precision: str) -> tuple[str, str]:
    """Ask for `pair` at `precision`: (the name it serves under, the model status line; a refusal in words)."""
    try:
        served = with_precision(pair, precision)
        SERVER.pairs.request(served)
    except UserError as err:  # e.g. ZeroGPU serves only the pair it loaded at start
        return pair, status_html(str(err), error=True)
    return served, model_status_html()


# -- layout: one function per section ---------------------------------------------------------------------------
def _inputs(page: Page, initial_pair: str, examples: list[dict]) -> None:
    traces = gallery_traces()
    page.gallery = gr.Dropdown([(gallery_label(p), str(p)) for p in traces], value=str(traces[0]) if traces else None,
                               label="Gallery: precomputed runs (no models needed)", elem_id="tv-gallery")
    page.example = gr.Dropdown([example_label(e) for e in examples], value=None,
                               label="Example prompts (code, chat, prose)", elem_id="tv-example")
    first = examples[0]["prompt"] if examples else None
    page.prompt = gr.Textbox(label="Prompt", lines=4, max_lines=8, elem_id="tv-prompt",
                             value=first if isinstance(first, str) else "def fibonacci(n):\n")
    page.chat = gr.Checkbox(value=False, label="send as a chat message (chat template)")
    with gr.Row():
        page.run_btn = gr.Button("Run", variant="primary", elem_id="tv-run")
        page.stop_btn = gr.Button("Stop", variant="stop", elem_id="tv-stop")
        page.compare_btn = gr.Button("Compare", elem_id="tv-compare")
    pairs = pair_choices(SERVER.pairs)
    page.pair = gr.Dropdown(pairs if initial_pair in pairs else [initial_pair] + pairs, value=initial_pair,
                            label="Model pair (target + draft)", allow_custom_value=True, elem_id="tv-pair",
                            info="tiny-random plays instantly; hub pairs need network")
    page.precision = precision_switch(initial_pair)
    page.strategy = gr.Dropdown([(cls.label or s, s) for s, cls in STRATEGIES.items()], value=DEFAULT_STRATEGY,
                                label="Tree strategy", elem_id="tv-strategy")
    page.summary = gr.Markdown(STRATEGIES[DEFAULT_STRATEGY].summary or "")
    page.max_new_tokens = gr.Slider(1, 512, value=48, step=1, label="max new tokens", elem_id="tv-max-new")


def precision_switch(initial_pair: str) -> gr.Radio:
    """auto (this machine's dtype: bf16 where it has fast bf16) or fp32, the exact mode; hidden on ZeroGPU, where only
    the pair loaded at start serves. Its value rides in the pair's name, so /run, /race and /sweep take it there."""
    auto = auto_dtype_name()
    return gr.Radio([(f"auto ({SHORT_DTYPES.get(auto, auto)} here)", "auto"), ("fp32: exact", "fp32")],
                    value=split_precision(initial_pair)[1], label="Precision", elem_id="tv-precision",
                    visible=SERVER.pairs.pinned is None,
                    info="fp32 is the exact mode: a run equals AR token for token. bf16 is faster, and parts from AR "
                         "only where two tokens nearly tie in rounding. Switching loads the pair again.")


def _sampling(page: Page) -> None:
    with gr.Accordion("Sampling", open=False):
        page.temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="temperature (0 = greedy)")
        page.top_p = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="top-p")
        page.top_k = gr.Slider(0, 200, value=0, step=1, label="top-k (0 = off)")
        page.seed = gr.Number(value=0, precision=0, label="seed")
        # every rule, so /run accepts any (the engine refuses a rule that cannot check the strategy's trees, in one
        # plain line); the page narrows the list to the selected strategy's compatible rules when it loads
        page.verifier = gr.Dropdown(verifier_options(["auto", *VERIFIERS]), value="auto", label="verification rule",
                                    elem_id="tv-verifier",
                                    info="auto: greedy at temperature 0, else token matching / SpecInfer")


def _strategy_params(page: Page) -> None:
    with gr.Accordion("Strategy parameters", open=True):
        page.preset = gr.Dropdown(STRATEGIES[DEFAULT_STRATEGY].preset_names(), value="auto", label="preset",
                                  info="cpu: tuned for a 2-core CPU; paper: the paper's values; "
                                     "auto: sized every iteration from this machine's measured costs")
        page.controls = ParamControls.build(DEFAULT_STRATEGY)
        # the selected strategy's values by name, collected before every run: what /run's `params` receives
        page.params = gr.JSON({}, visible=False, elem_id="tv-params")


def _views(page: Page) -> None:
    with gr.Row(equal_height=True):
        page.model_status = gr.HTML(status_html("starting…"), elem_id="tv-model-status")
        page.run_status = gr.HTML(status_html("Pick a gallery trace or press Run."), elem_id="tv-run-status")
    page.badge = gr.HTML(badge_html(None), elem_id="tv-badge")
    page.tree = gr.Plot(tree_figure(None), label="Draft tree", show_label=False, elem_id="tv-tree")
    page.scrubber = gr.Slider(0, 1, value=0, step=1, label="iteration (drag to replay the run; no models needed)",
                              elem_id="tv-scrubber")
    teaching_ui.entropy_box(page)
    with gr.Row(equal_height=False):
        # a click on a tree node writes its id here (static/script.js); typing an id works too
        page.node = gr.Number(None, precision=0, minimum=0, label="inspect node (click one in the tree)",
                              elem_id="tv-node", scale=0, min_width=170)
        page.inspector = gr.HTML(inspector_html(None, None, None), elem_id="tv-inspector")
    page.inspector_plot = gr.Plot(inspector_figure(None, None), show_label=False, elem_id="tv-inspector-plot")
    gr.HTML(token_legend_html())
    page.text = gr.HTML(tokens_html(None), elem_id="tv-text")
    page.metrics = gr.HTML("", elem_id="tv-metrics")


def _tabs(page: Page) -> None:
    with gr.Tabs():
        with gr.Tab("Charts"):
            page.stage_mode = gr.Radio(["per iteration", "total"], value="per iteration", label="stage times",
                                       elem_id="tv-stage-mode")
            page.charts = gr.Plot(charts_figure(None), label="Run charts", show_label=False, elem_id="tv-charts")
            page.throughput = gr.Plot(throughput_figure(None, None), label="Throughput vs AR", show_label=False,
                                      elem_id="tv-throughput")
            teaching_ui.run_histogram(page)
        with gr.Tab("Calibration"):
            page.calibration = gr.Plot(calibration_figure([]), show_label=False, elem_id="tv-calibration")
        with gr.Tab("Costs"):
            page.costs = gr.Plot(cost_figure(None), show_label=False, elem_id="tv-costs")
        with gr.Tab("Compare"):
            methods = [s for s in STRATEGIES if s != "ar"]
            page.compare_methods = gr.CheckboxGroup(
                methods, value=methods[:4], elem_id="tv-compare-methods",
                label="Strategies to compare with AR (each with its auto preset; the selected strategy with your "
                      "slider values)")
            page.compare_table = gr.Dataframe(label="Same prompt, same session", interactive=False,
                                              elem_id="tv-compare-table")
            page.compare_plot = gr.Plot(label="First tree of each strategy", show_label=False,
                                        elem_id="tv-compare-plot")
            page.compare_calibration = gr.Plot(calibration_figure([]), show_label=False,
                                               elem_id="tv-compare-calibration")
            teaching_ui.compare_histogram(page)
        teaching_ui.race_tab(page)
        teaching_ui.step_tab(page)
        teaching_ui.sweep_tab(page)
        with gr.Tab("Traces"):
            with gr.Row():
                page.download = gr.File(label="Download this run (JSON trace)", interactive=False,
                                        elem_id="tv-download")
                page.upload = gr.File(label="Replay a trace (.json): no models needed", file_types=[".json"],
                                      type="filepath", elem_id="tv-upload")
            teaching_ui.html_download(page)
        with gr.Tab("How to read this"):
            gr.Markdown(static_text("how_to_read.md"))


# -- wiring ------------------------------------------------------------------------------------------------------------
def _wire_runs(page: Page) -> None:
    """Run (button, Enter, releasing a slider), Compare. Each run trigger first collects the strategy's parameters by
    name into page.params (Page.collect), then calls the handler, its inputs named by its own parameters (so /run
    takes them by name too); the handler's last update carries every view and the teaching panels (the
    step-through's animation frames are added by the page's script after it)."""
    live = page.controls.components + [page.max_new_tokens, page.temperature, page.top_p, page.top_k]
    triggers = [(page.run_btn.click, "run"), (page.prompt.submit, None)] + [
        (c.release if isinstance(c, gr.Slider) else c.input if isinstance(c, gr.Checkbox) else c.submit, None)
        for c in live]  # live tuning: committing a new value re-runs (superseding the older Run, not a race or sweep)
    for trigger, api_name in triggers:
        run = trigger(**page.collect()).then(
            handlers.run, page.inputs(handlers.run), page.outputs(handlers.RUN_VIEW_OUTPUTS, **RUN_RENAMED),
            concurrency_limit=None, show_progress="minimal" if api_name else "hidden",
            **({"api_name": api_name} if api_name else {"api_visibility": "private"}))
        teaching_ui.with_frames(run, page.step_plot, "tv-step")
    compare = page.compare_btn.click(**page.collect()).then(
        handlers.compare, page.inputs(handlers.compare, methods="compare_methods"),
        page.outputs(handlers.COMPARE_OUTPUTS, **RUN_RENAMED), concurrency_limit=None, api_name="compare")
    teaching_ui.with_frames(compare, page.step_plot, "tv-step")


def _wire_stop(page: Page) -> None:
    """Stop raises the flag of everything this browser session runs; each run says it stopped in its own line."""
    page.stop_btn.click(handlers.stop, None, page.run_status, api_name="stop", concurrency_limit=None, queue=False)


def _wire_views(page: Page) -> None:
    """Scrubbing, stage mode, the node inspector, trace replays: no models involved."""

    def on_stage(run, index, stage_mode):
        return charts_figure(run, selected=int(index) if run is not None and run.iterations else None,
                             stage_mode=stage_mode)

    teaching_ui.follow(page, page.scrubber.input(
        show_iteration, page.inputs(show_iteration, **SHOWN), page.outputs(VIEW_NAMES), show_progress="hidden",
        api_name="scrub", concurrency_limit=None))
    page.stage_mode.change(on_stage, [page.run_state, page.scrubber, page.stage_mode], page.charts,
                           show_progress="hidden")
    page.node.input(inspect_node, page.inputs(inspect_node, **SHOWN), [page.node, page.inspector, page.inspector_plot],
                    show_progress="hidden", api_name="inspect", concurrency_limit=None)
    shown_run = page.outputs(RUN_OUTPUTS, **RUN_RENAMED)
    teaching_ui.follow(page, page.upload.upload(lambda path, stage_mode: replay(path, stage_mode, "uploaded trace"),
                                                [page.upload, page.stage_mode], shown_run, api_name="upload"))
    teaching_ui.follow(page, page.gallery.input(on_gallery, [page.gallery, page.stage_mode], shown_run,
                                                api_name="gallery"))


def show_iteration(run, ar, index, stage_mode, node, request: gr.Request = None):
    """Every view at iteration `index` (node `node` inspected): scrubbing, no models involved. The index is kept as
    the page's state: a Run whose AR is still being measured ends on it."""
    if run is None:  # nothing to show yet: leave the views alone
        return [gr.skip()] * len(VIEW_NAMES)
    SERVER.page(handlers.browser_of(request)).shown = None if index is None else int(index)
    views = render_views(run, ar, index, stage_mode, node)
    return [views[name] for name in VIEW_NAMES]


def inspect_node(run, index, node_id, request: gr.Request = None):
    """The node inspector (treeviz/figures/inspector.py `inspect`), the node kept as the page's state like the scrubbed
    iteration."""
    shown = inspect(run, index, node_id)
    SERVER.page(handlers.browser_of(request)).node = shown[0]
    return shown


def on_gallery(path, stage_mode):
    return replay(path, stage_mode, f"gallery trace '{Path(path).stem}'" if path else "gallery")


def _wire_controls(page: Page, examples: list[dict]) -> None:
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

    def on_pair(name, precision):
        """A pair picked or typed: served at the switch's precision, unless its name says one ("default (fp32)")."""
        if not name:
            return gr.skip(), gr.skip(), model_status_html()
        base, named = split_precision(str(name))
        precision = named if named != "auto" else precision if precision in PRECISIONS else "auto"
        served, status = serve(base, precision)
        return served, precision, status

    def on_precision(pair, precision):
        """The switch: the pair shown is loaded again at this precision (the one serving serves until then)."""
        if not pair:
            return gr.skip(), model_status_html()
        return serve(str(pair), precision)

    groups = list(page.controls.groups.values())
    page.strategy.change(page.controls.strategy_updates, [page.strategy, page.verifier],
                         [page.summary, page.preset, page.verifier] + groups)
    page.demo.load(lambda verifier: page.controls.strategy_updates(DEFAULT_STRATEGY, verifier)[2], page.verifier,
                   page.verifier, queue=False, api_visibility="private")
    page.preset.input(page.controls.preset_updates, [page.strategy, page.preset], page.controls.components,
                      api_name="on_preset")
    page.example.input(on_example, page.example, [page.prompt, page.chat], api_name="on_example")
    page.pair.input(on_pair, [page.pair, page.precision], [page.pair, page.precision, page.model_status],
                    api_name="on_pair")
    page.precision.input(on_precision, [page.pair, page.precision], [page.pair, page.model_status],
                         api_name="on_precision")
    gr.Timer(1.0).tick(model_status_html, None, page.model_status, show_progress="hidden", queue=False,
                       api_visibility="private")


def build_demo(initial_pair: str = "default", load_on_start: bool = True) -> gr.Blocks:
    examples = load_examples()
    if load_on_start:
        SERVER.pairs.request(initial_pair)
    page = Page()
    with gr.Blocks(title="treeviz: speculative decoding draft trees") as demo:
        page.demo = demo
        page.run_state, page.ar_state, page.race_runs = gr.State(None), gr.State(None), gr.State(None)
        gr.Markdown("## treeviz — watch a draft model's token tree get verified by the target, live")
        with gr.Row(equal_height=False):
            with gr.Column(scale=1, min_width=330):
                _inputs(page, initial_pair, examples)
                _sampling(page)
                _strategy_params(page)
            with gr.Column(scale=3):
                _views(page)
                _tabs(page)
        _wire_runs(page)
        teaching_ui.wire(page)
        _wire_stop(page)
        _wire_views(page)
        _wire_controls(page, examples)
        demo.load(model_status_html, None, page.model_status, queue=False, api_visibility="private")
        if page.gallery.value:
            teaching_ui.follow(page, demo.load(on_gallery, [page.gallery, page.stage_mode],
                                               page.outputs(RUN_OUTPUTS, **RUN_RENAMED)))
    return demo


def launch_kwargs() -> dict:
    # Gradio refuses uploads over this at the transport; replay.MAX_TRACE_MB gives the plain message below it
    return {"css": static_text("style.css"), "js": static_text("script.js"), "theme": gr.themes.Soft(),
            "max_file_size": "64mb"}
