"""The Gradio app: a live draft-tree explorer. `build_demo` lays out the page section by section and wires the
events; the handlers that touch models live in treeviz/handlers.py, the views in treeviz/views.py.

API (gradio_client): /run takes prompt, chat, pair, strategy, preset, max_new_tokens, temperature, top_p, top_k,
seed, verifier, params (a dict of the strategy's parameters by name), stage_mode; /compare takes the same plus
methods and stage_mode; /stop, /scrub, /inspect (a node of the shown iteration), /upload, /gallery.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import gradio as gr

from engine.strategies import STRATEGIES
from engine.verify import VERIFIERS
from treeviz import figures as F
from treeviz import handlers
from treeviz.backend import BACKEND, pair_choices
from treeviz.controls import ParamControls, verifier_options
from treeviz.inspector import inspect, inspector_figure, inspector_html
from treeviz.panels import calibration_figure, cost_figure
from treeviz.replay import gallery_label, gallery_traces, replay
from treeviz.views import VIEW_NAMES, render_views, status_html

log = logging.getLogger("treeviz")
ROOT = Path(__file__).resolve().parent.parent
PROMPT_DIR = ROOT / "assets" / "prompts"
DEFAULT_STRATEGY = "dynatree"

FALLBACK_PROMPTS = [
    {"name": "code: fibonacci", "kind": "code", "prompt": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"},
    {"name": "chat: explain", "kind": "chat",
     "prompt": [{"role": "user", "content": "Explain speculative decoding in two sentences."}]},
    {"name": "prose: story", "kind": "prose", "prompt": "Once upon a time, in a small village by the sea,"},
]

HOW_TO_READ = """
**The tree.** Each iteration the small *draft* model proposes a tree of candidate next tokens; the large *target*
model checks every node in one forward pass. The **root** (◆, left) is the last committed token; depth grows to the
right; siblings are ordered by draft probability, most likely on top.

* **Fill colour** = the draft's probability *q* of that token given its parent, on a fixed 0–1 scale (colour bar).
* **Shape / outline** = outcome, so it reads without colour:
  ● thick black outline — **accepted** (the target agreed); ★ orange outline — **bonus** token (the target's own
  next token after the accepted path; it becomes the next root); ✕ — **rejected** (a sibling the target did not
  pick); ○ open, faded — **unreached** (below a rejected node, never checked); ✦ purple — bonus **resampled** from
  the residual distribution (sampling only).
* Thick black edges = the accepted path. Hover a node for its token (␣ space, ⏎ newline, ⇥ tab), *q*, cumulative
  *q* of its path, the target's *p*, depth, rank and outcome.
* **Click a node** (or type its id under the tree) to open the **node inspector**: the draft's *q* and the target's
  *p* at its parent over their top 10 tokens side by side, the node's acceptance probability under the run's rule
  and why it was accepted, rejected or never looked at.

**Calibration** (tab): every node the verification tested, binned by its draft probability *q*, against the
fraction accepted. DySpec's trees assume a token's chance of acceptance is about its *q* (the diagonal); a curve
below it means the draft is over-confident.

**Costs** (tab): what verifying *n* tree nodes in one target forward, and the draft's forwards, cost on this machine
(measured points beside the engine's cost-table prediction), and per iteration the draft + verify time against the
break-even: the time AR would take for the tokens the iteration committed. Below the line the iteration beat AR.

**The numbers.** *L̄* = tokens committed per target pass (accepted + bonus; AR has L̄ = 1). *ℓ̄* = mean accepted
draft length. *Acceptance* = accepted draft tokens / drafted nodes. *Per-depth acceptance* = share of iterations
that accepted at least *d* tokens. *Speedup* = tokens/s ÷ plain autoregressive (AR) tokens/s, measured here on the
same prompt, pair and dtype.

**Text colours.** Blue: first token (prefill); green: accepted draft token; orange: bonus token. Hover a token for
its iteration and the target's top-2 logit margin. The selected iteration's tokens are outlined in red.

**Is the output exact?** With greedy decoding (temperature 0) speculative decoding must reproduce AR token for
token. In float32 it does in every test and benchmark we ran: a verification pass over many tokens uses different
kernels than a one-token step, but float32 rounding differences are far below the target's top-2 gaps. In bf16/fp16
they are not, so a near-tie between the target's top two tokens can flip: the badge then shows the first
position where the output departs from AR and how close the tie was. With sampling, outputs are equal in
distribution, not token for token.

**Pairs.** `tiny-random` runs instantly (tiny random models: trees and text are nonsense, speedups meaningless — it
is for play and tests). `default` is Qwen2.5-Coder 1.5B + 0.5B, offline; the first load converts the weights
(about two minutes), later loads take seconds. Hub pairs need network access.
"""

CSS = F.TEXT_CSS + """
.tv-status {font-size: 13px; padding: 6px 10px; border-radius: 6px; background: #f4f6f7; color: #1b2631;}
.tv-status.err {background: #fdedec; color: #78281f;}
.tv-bar {height: 8px; background: #e5e8e8; border-radius: 4px; overflow: hidden; margin-top: 4px;}
.tv-bar > div {height: 100%; background: #2e86c1; transition: width 0.4s;}
#tv-tree {min-height: 380px;}
#tv-tree .js-plotly-plot .scatterlayer .points path {cursor: pointer;}
.tv-inspector {font-size: 13px; padding: 6px 10px; border: 1px solid #e5e7eb; border-radius: 6px;}
footer {display: none !important;}
"""


# gr.Plot has no click event (Gradio 6: only `change`), so a click on a tree node is caught in the page: Plotly's
# plotly_click on the tree's plot div (Gradio re-draws it with Plotly.react, which keeps listeners) writes the
# node's id (customdata[0], set by figures.tree_traces) into the node picker and fires its input event, the same
# event typing an id fires.
NODE_CLICK_JS = """
() => {
  const hook = (plot) => {
    if (plot.__treevizClick || typeof plot.on !== "function") return;
    plot.__treevizClick = true;
    plot.on("plotly_click", (event) => {
      const point = event && event.points && event.points[0];
      const id = point && point.customdata ? point.customdata[0] : null;
      const box = document.querySelector("#tv-node input");
      if (id === null || id === undefined || !box) return;
      box.value = String(id);
      box.dispatchEvent(new Event("input", {bubbles: true}));
    });
  };
  const scan = () => document.querySelectorAll("#tv-tree .js-plotly-plot").forEach(hook);
  new MutationObserver(scan).observe(document.body, {childList: true, subtree: true});
  scan();
}
"""


# -- data helpers ------------------------------------------------------------------------------------------------------
def load_examples() -> list[dict]:
    entries = []
    for kind in ("code", "chat", "prose"):
        try:
            data = json.loads((PROMPT_DIR / f"{kind}.json").read_text())
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
        return status_html(f"models ready: {st['description']}")
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
    ui.badge = gr.HTML(F.badge_html(None), elem_id="tv-badge")
    ui.tree = gr.Plot(F.tree_figure(None), label="Draft tree", show_label=False, elem_id="tv-tree")
    ui.scrubber = gr.Slider(0, 1, value=0, step=1, label="iteration (drag to replay the run; no models needed)",
                            elem_id="tv-scrubber")
    with gr.Row(equal_height=False):
        # a click on a tree node writes its id here (NODE_CLICK_JS); typing an id works too
        ui.node = gr.Number(None, precision=0, minimum=0, label="inspect node (click one in the tree)",
                            elem_id="tv-node", scale=0, min_width=170)
        ui.inspector = gr.HTML(inspector_html(None, None, None), elem_id="tv-inspector")
    ui.inspector_plot = gr.Plot(inspector_figure(None, None), show_label=False, elem_id="tv-inspector-plot")
    gr.HTML(F.token_legend_html())
    ui.text = gr.HTML(F.tokens_html(None), elem_id="tv-text")
    ui.metrics = gr.HTML("", elem_id="tv-metrics")


def _tabs(ui: SimpleNamespace) -> None:
    with gr.Tabs():
        with gr.Tab("Charts"):
            ui.stage_mode = gr.Radio(["per iteration", "total"], value="per iteration", label="stage times",
                                     elem_id="tv-stage-mode")
            ui.charts = gr.Plot(F.charts_figure(None), label="Run charts", show_label=False, elem_id="tv-charts")
            ui.throughput = gr.Plot(F.throughput_figure(None, None), label="Throughput vs AR", show_label=False,
                                    elem_id="tv-throughput")
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
        with gr.Tab("Traces"):
            with gr.Row():
                ui.download = gr.File(label="Download this run (JSON trace)", interactive=False, elem_id="tv-download")
                ui.upload = gr.File(label="Replay a trace (.json): no models needed", file_types=[".json"],
                                    type="filepath", elem_id="tv-upload")
        with gr.Tab("How to read this"):
            gr.Markdown(HOW_TO_READ)


# -- wiring ------------------------------------------------------------------------------------------------------------
def _wire_runs(ui: SimpleNamespace) -> None:
    """Run (button, Enter, releasing a slider), Stop, Compare. Each run trigger first collects the strategy's
    parameters by name into ui.params, then calls the run handler with them (so /run takes them by name too)."""
    settings = [ui.prompt, ui.chat, ui.pair, ui.strategy, ui.preset, ui.max_new, ui.temperature, ui.top_p, ui.top_k,
                ui.seed, ui.verifier, ui.params]
    ui.view_outputs = [getattr(ui, name) for name in VIEW_NAMES]
    ui.run_outputs = [ui.run_state, ui.ar_state, ui.scrubber, ui.run_status, ui.download] + ui.view_outputs
    collect = dict(fn=ui.controls.collect, inputs=[ui.strategy, *ui.controls.components], outputs=ui.params,
                   queue=False, show_progress="hidden", api_visibility="private")
    live = ui.controls.components + [ui.max_new, ui.temperature, ui.top_p, ui.top_k]
    triggers = [(ui.run_btn.click, "run"), (ui.prompt.submit, None)] + [
        (c.release if isinstance(c, gr.Slider) else c.input if isinstance(c, gr.Checkbox) else c.submit, None)
        for c in live]  # live tuning: committing a new value re-runs (a newer run of a session cancels the older)
    runs = []
    for trigger, api_name in triggers:
        run = trigger(**collect).then(
            handlers.run, settings + [ui.stage_mode], ui.run_outputs, concurrency_limit=None,
            show_progress="minimal" if api_name else "hidden",
            **({"api_name": api_name} if api_name else {"api_visibility": "private"}))
        runs.append(run)
        # the run's last value shows its last iteration; a user who scrubbed while AR was measured gets that
        # iteration back
        run.then(show_iteration, [ui.run_state, ui.ar_state, ui.scrubber, ui.stage_mode, ui.node], ui.view_outputs,
                 show_progress="hidden", queue=False, api_visibility="private")
    compare = ui.compare_btn.click(**collect).then(
        handlers.compare, settings + [ui.compare_methods, ui.stage_mode],
        ui.run_outputs + [ui.compare_table, ui.compare_plot, ui.compare_calibration],
        concurrency_limit=None, api_name="compare")
    ui.stop_btn.click(handlers.stop, None, ui.run_status, api_name="stop", concurrency_limit=None, queue=False,
                      cancels=runs + [compare])


def _wire_views(ui: SimpleNamespace) -> None:
    """Scrubbing, stage mode, the node inspector, trace replays: no models involved."""

    def on_stage(run, index, stage_mode):
        return F.charts_figure(run, selected=int(index) if run is not None and run.iterations else None,
                               stage_mode=stage_mode)

    ui.scrubber.input(show_iteration, [ui.run_state, ui.ar_state, ui.scrubber, ui.stage_mode, ui.node], ui.view_outputs,
                      show_progress="hidden", api_name="scrub", concurrency_limit=None)
    ui.stage_mode.change(on_stage, [ui.run_state, ui.scrubber, ui.stage_mode], ui.charts, show_progress="hidden")
    ui.node.input(inspect, [ui.run_state, ui.scrubber, ui.node], [ui.node, ui.inspector, ui.inspector_plot],
                  show_progress="hidden", api_name="inspect", concurrency_limit=None)
    ui.upload.upload(lambda path, stage_mode: replay(path, stage_mode, "uploaded trace"), [ui.upload, ui.stage_mode],
                     ui.run_outputs, api_name="upload")
    ui.gallery.input(on_gallery, [ui.gallery, ui.stage_mode], ui.run_outputs, api_name="gallery")


def show_iteration(run, ar, index, stage_mode, node):
    """Every view at iteration `index` (node `node` inspected): scrubbing, no models involved."""
    if run is None:  # nothing to show yet: leave the views alone
        return [gr.skip()] * len(VIEW_NAMES)
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
        _wire_views(ui)
        _wire_controls(ui, examples)
        demo.load(model_status_html, None, ui.model_status, queue=False, api_visibility="private")
        if ui.gallery.value:
            demo.load(on_gallery, [ui.gallery, ui.stage_mode], ui.run_outputs)
    demo._treeviz_backend = BACKEND  # for tests
    return demo


def launch_kwargs() -> dict:
    # Gradio refuses uploads over this at the transport; replay.MAX_TRACE_MB gives the plain message below it
    return {"css": CSS, "js": NODE_CLICK_JS, "theme": gr.themes.Soft(), "max_file_size": "64mb"}
