"""The Gradio app: live draft-tree explorer. Controls are built from the strategies' declared Params."""
from __future__ import annotations

import json
import logging
import os
import queue
import tempfile
import time
from pathlib import Path
from typing import Any

import gradio as gr

from treeviz import figures as F
from treeviz.backend import Backend, RunSpec, friendly_error, pair_choices, sampling_support

log = logging.getLogger("treeviz")
ROOT = Path(__file__).resolve().parent.parent
PROMPT_DIR = ROOT / "assets" / "prompts"
TRACE_DIR = ROOT / "assets" / "traces"
UPDATE_INTERVAL = 0.25  # seconds between streamed figure updates (coalesced: at most ~4/s)

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
footer {display: none !important;}
"""


# -- data helpers ------------------------------------------------------------------------------------------------------
def load_examples() -> list[dict]:
    entries = []
    for kind in ("code", "chat", "prose"):
        path = PROMPT_DIR / f"{kind}.json"
        try:
            data = json.loads(path.read_text())
            for e in data if isinstance(data, list) else []:
                if isinstance(e, dict) and e.get("prompt"):
                    entries.append({"name": str(e.get("name") or kind), "kind": e.get("kind", kind),
                                    "prompt": e["prompt"]})
        except (OSError, ValueError):
            continue
    return entries or FALLBACK_PROMPTS


def example_label(e: dict) -> str:
    p = e["prompt"]
    text = p if isinstance(p, str) else " / ".join(str(m.get("content", "")) for m in p if m.get("role") == "user")
    text = " ".join(text.split())
    return f"{e['kind']}: {text[:60]}{'…' if len(text) > 60 else ''}"


def gallery_traces() -> list[Path]:
    """Gallery files, a code/DynaTree trace first (the most telling first view)."""
    paths = sorted(TRACE_DIR.glob("*.json")) if TRACE_DIR.exists() else []
    return sorted(paths, key=lambda p: (not ("code" in p.stem and "dynatree" in p.stem), "identical" in p.stem,
                                        p.stem))


def gallery_label(path: Path) -> str:
    return path.stem.replace("_", " ")


def strategy_registry():
    from engine.strategies import STRATEGIES
    return STRATEGIES


def verifier_names() -> list[str]:
    try:
        from engine.verify import VERIFIERS
        return list(VERIFIERS)
    except Exception:  # noqa: BLE001
        return []


def verifier_choices(strategy_name: str) -> list[str]:
    """"auto" plus the rules that can check this strategy's trees (its default child-drawing mode)."""
    try:
        from engine.strategies import make_strategy
        from engine.verify import compatible_verifiers
        return ["auto"] + compatible_verifiers(make_strategy(strategy_name))
    except Exception:  # noqa: BLE001
        return ["auto"] + verifier_names()


FIXED_RUN_INPUTS = 11  # prompt, chat, pair, strategy, preset, max_new, temperature, top_p, top_k, seed, verifier


def param_controls_spec():
    """[(strategy name, Param)] in a fixed order: the flat list of parameter inputs."""
    out = []
    for name, cls in strategy_registry().items():
        for p in cls.params:
            out.append((name, p))
    return out


def preset_values(cls, preset: str) -> dict:
    values = {p.name: p.default for p in cls.params}
    values.update(cls.presets.get(preset, {}))
    return values


def _status_html(text: str, error: bool = False, progress: float | None = None) -> str:
    import html
    bar = ""
    if progress is not None:
        bar = f"<div class='tv-bar'><div style='width:{progress * 100:.0f}%'></div></div>"
    return f"<div class='tv-status{' err' if error else ''}'>{html.escape(text)}{bar}</div>"


def _partial_run(records: list, spec: RunSpec | None) -> dict:
    """A run-like dict for records streamed so far (figures read dicts and records alike)."""
    n_tokens = 1 + sum(len(r.new_tokens) for r in records)
    sources = [{"iteration": -1, "kind": "prefill", "margin": None}]
    for r in records:
        for i in range(len(r.new_tokens)):
            sources.append({"iteration": r.index, "kind": "accepted" if i < r.accepted else "bonus",
                            "margin": None})
    drafted = sum(r.drafted for r in records)
    acc = sum(r.accepted for r in records)
    total = sum(r.times.get("total", 0.0) for r in records)
    return {"prompt": _prompt_text(spec.prompt) if spec else "", "iterations": records,
            "strategy": spec.strategy if spec else "", "token_sources": sources,
            "output_ids": [0] * n_tokens, "output_text": "",
            "metrics": {"iterations": len(records), "new_tokens": n_tokens,
                        "mean_tokens_per_iter": (n_tokens - 1) / len(records) if records else None,
                        "mean_accepted_len": acc / len(records) if records else None,
                        "acceptance_rate": acc / drafted if drafted else None,
                        "tokens_per_s": n_tokens / total if total else None}}


def _prompt_text(prompt) -> str:
    if isinstance(prompt, list):
        return "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in prompt)
    return str(prompt or "")


def _get(obj, key, default=None):
    return obj.get(key, default) if isinstance(obj, dict) else getattr(obj, key, default)


# -- views (cheap: no models) ---------------------------------------------------------------------------------------
def render_views(run, ar_run, index: int | None, stage_mode: str = "per iteration"):
    """(tree fig, text html, metrics html, charts fig, throughput fig, badge html) for iteration `index`."""
    if run is None:
        return (F.tree_figure(None), F.tokens_html(None), "", F.charts_figure(None), F.throughput_figure(None, None),
                F.badge_html(None))
    its = list(_get(run, "iterations") or [])
    if its:
        index = len(its) - 1 if index is None else max(0, min(int(index), len(its) - 1))
        tree = F.tree_figure(its[index], frame=F.run_frame(its))
    else:
        index = None
        tree = F.tree_figure(None)
    comparison = _get(run, "comparison")
    div = comparison.get("first_divergence") if comparison and not comparison.get("exact_match") else None
    return (tree, F.tokens_html(run, selected=index, divergence=div), F.metrics_html(run, ar_run, index),
            F.charts_figure(run, selected=index, stage_mode=stage_mode), F.throughput_figure(run, ar_run),
            F.badge_html(comparison, sampled=_sampled(run)))


def _sampled(run) -> bool:
    sampling = (_get(run, "config") or {}).get("sampling") or {}
    return bool(sampling.get("temperature"))


def save_trace(run) -> str | None:
    if run is None or not hasattr(run, "save"):
        return None
    directory = Path(tempfile.gettempdir()) / "treeviz-traces"
    directory.mkdir(exist_ok=True)
    path = directory / f"treeviz-{run.strategy}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.json"
    run.save(path)
    return str(path)


# -- the app -----------------------------------------------------------------------------------------------------------
def build_demo(initial_pair: str = "default", backend: Backend | None = None, load_on_start: bool = True) -> gr.Blocks:
    backend = backend or Backend()
    registry = strategy_registry()
    strategies = list(registry)
    default_strategy = "dynatree" if "dynatree" in registry else strategies[0]
    controls_spec = param_controls_spec()
    examples = load_examples()
    example_labels = [example_label(e) for e in examples]
    traces = gallery_traces()
    can_sample = sampling_support()
    pairs = pair_choices()
    if initial_pair not in pairs:
        pairs = [initial_pair] + pairs
    if load_on_start:
        backend.pairs.request(initial_pair)

    with gr.Blocks(title="treeviz: speculative decoding draft trees") as demo:
        run_state = gr.State(None)      # RunResult (or partial run dict) shown now
        ar_state = gr.State(None)       # AR RunResult for the same prompt
        gr.Markdown("## treeviz — watch a draft model's token tree get verified by the target, live")
        with gr.Row(equal_height=False):
            # ---------------- left column: inputs ----------------
            with gr.Column(scale=1, min_width=330):
                gallery = gr.Dropdown([(gallery_label(p), str(p)) for p in traces],
                                      value=str(traces[0]) if traces else None,
                                      label="Gallery: precomputed runs (no models needed)", elem_id="tv-gallery")
                example = gr.Dropdown(example_labels, value=None, label="Example prompts (code, chat, prose)",
                                      elem_id="tv-example")
                first = examples[0] if examples else None
                prompt = gr.Textbox(label="Prompt", lines=4, max_lines=8, elem_id="tv-prompt",
                                    value=(first["prompt"] if first and isinstance(first["prompt"], str) else
                                           "def fibonacci(n):\n"))
                chat = gr.Checkbox(value=False, label="send as a chat message (chat template)")
                with gr.Row():
                    run_btn = gr.Button("Run", variant="primary", elem_id="tv-run")
                    stop_btn = gr.Button("Stop", variant="stop", elem_id="tv-stop")
                    compare_btn = gr.Button("Compare", elem_id="tv-compare")
                pair = gr.Dropdown(pairs, value=initial_pair, label="Model pair (target + draft)",
                                   allow_custom_value=True, elem_id="tv-pair",
                                   info="tiny-random plays instantly; hub pairs need network")
                strategy = gr.Dropdown([(registry[s].label or s, s) for s in strategies], value=default_strategy,
                                       label="Tree strategy", elem_id="tv-strategy")
                summary = gr.Markdown(registry[default_strategy].summary or "")
                max_new = gr.Slider(1, 512, value=48, step=1, label="max new tokens", elem_id="tv-max-new")
                with gr.Accordion("Sampling", open=False):
                    temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="temperature (0 = greedy)",
                                            interactive=can_sample,
                                            info=None if can_sample else "this engine decodes greedily only")
                    top_p = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="top-p", interactive=can_sample)
                    top_k = gr.Slider(0, 200, value=0, step=1, label="top-k (0 = off)", interactive=can_sample)
                    seed = gr.Number(value=0, precision=0, label="seed", interactive=can_sample)
                    verifier = gr.Dropdown(verifier_choices(default_strategy), value="auto",
                                           label="verification rule",
                                           info="auto: greedy at temperature 0, else token matching / SpecInfer",
                                           interactive=can_sample, elem_id="tv-verifier")
                with gr.Accordion("Strategy parameters", open=True) as params_acc:
                    preset = gr.Dropdown(sorted(registry[default_strategy].presets) or ["cpu"], value="cpu",
                                         label="preset", info="cpu: tuned for a 2-core CPU; paper: the paper's values")
                    param_components = []
                    groups = []
                    for name in strategies:
                        cls = registry[name]
                        values = preset_values(cls, "cpu")
                        with gr.Group(visible=(name == default_strategy)) as grp:
                            if not cls.params:
                                gr.Markdown("_No parameters._")
                            for s_name, p in controls_spec:
                                if s_name != name:
                                    continue
                                label = p.label or p.name
                                value = values.get(p.name, p.default)
                                if p.kind is bool:
                                    comp = gr.Checkbox(value=bool(value), label=label, info=p.help or None)
                                elif p.minimum is not None and p.maximum is not None:
                                    step = p.step or (1 if p.kind is int else 0.01)
                                    comp = gr.Slider(p.minimum, p.maximum, value=value, step=step, label=label,
                                                     info=p.help or None)
                                else:
                                    comp = gr.Number(value=value, label=label, info=p.help or None,
                                                     precision=0 if p.kind is int else None)
                                param_components.append(comp)
                        groups.append(grp)
            # ---------------- right column: views ----------------
            with gr.Column(scale=3):
                with gr.Row(equal_height=True):
                    model_status = gr.HTML(_status_html("starting…"), elem_id="tv-model-status")
                    run_status = gr.HTML(_status_html("Pick a gallery trace or press Run."),
                                         elem_id="tv-run-status")
                badge = gr.HTML(F.badge_html(None), elem_id="tv-badge")
                tree_plot = gr.Plot(F.tree_figure(None), label="Draft tree", show_label=False, elem_id="tv-tree")
                scrubber = gr.Slider(0, 1, value=0, step=1, label="iteration (drag to replay the run; no models needed)",
                                     elem_id="tv-scrubber")
                gr.HTML(F.token_legend_html())
                text_html = gr.HTML(F.tokens_html(None), elem_id="tv-text")
                metrics = gr.HTML("", elem_id="tv-metrics")
                with gr.Tabs():
                    with gr.Tab("Charts"):
                        stage_mode = gr.Radio(["per iteration", "total"], value="per iteration",
                                              label="stage times", elem_id="tv-stage-mode")
                        charts = gr.Plot(F.charts_figure(None), label="Run charts", show_label=False, elem_id="tv-charts")
                        throughput = gr.Plot(F.throughput_figure(None, None), label="Throughput vs AR",
                                             show_label=False, elem_id="tv-throughput")
                    with gr.Tab("Compare"):
                        compare_methods = gr.CheckboxGroup(
                            [s for s in strategies if s != "ar"], value=[s for s in strategies if s != "ar"][:4],
                            label="Strategies to compare with AR (each with its preset; the selected strategy "
                                  "with your slider values)", elem_id="tv-compare-methods")
                        compare_table = gr.Dataframe(label="Same prompt, same session", interactive=False,
                                                     elem_id="tv-compare-table")
                        compare_plot = gr.Plot(label="First tree of each strategy", show_label=False,
                                               elem_id="tv-compare-plot")
                    with gr.Tab("Traces"):
                        with gr.Row():
                            download = gr.File(label="Download this run (JSON trace)", interactive=False,
                                               elem_id="tv-download")
                            upload = gr.File(label="Replay a trace (.json): no models needed", file_types=[".json"],
                                             type="filepath", elem_id="tv-upload")
                    with gr.Tab("How to read this"):
                        gr.Markdown(HOW_TO_READ)

        view_outputs = [tree_plot, text_html, metrics, charts, throughput, badge]
        run_outputs = [run_state, ar_state, scrubber, run_status, download] + view_outputs

        # ---------------- handlers ----------------
        def gather(prompt_v, chat_v, pair_v, strategy_v, preset_v, max_new_v, temp_v, top_p_v, top_k_v, seed_v,
                   verifier_v, *param_values) -> RunSpec:
            if not isinstance(prompt_v, str) or not prompt_v.strip():
                raise gr.Error("The prompt is empty: type some text or pick an example prompt.")
            if strategy_v not in registry:
                raise gr.Error(f"Unknown strategy {strategy_v!r}.")
            params = {}
            for (s_name, p), value in zip(controls_spec, param_values):
                if s_name == strategy_v:
                    if value is None:
                        raise gr.Error(f"{p.label or p.name} needs a value.")
                    params[p.name] = value
            text = prompt_v
            spec_prompt: Any = [{"role": "user", "content": text}] if chat_v else text
            try:
                return RunSpec(pair=str(pair_v or initial_pair), prompt=spec_prompt, strategy=strategy_v,
                               preset=preset_v or "cpu", params=params, max_new_tokens=int(max_new_v or 48),
                               temperature=float(temp_v or 0.0), top_p=float(top_p_v or 1.0),
                               top_k=int(top_k_v or 0), seed=int(seed_v or 0),
                               verifier=str(verifier_v or "auto"))
            except (TypeError, ValueError) as err:
                raise gr.Error(f"Bad setting: {err}") from None

        def on_run(request: gr.Request, *args):
            *inputs, stage_v = args
            spec = gather(*inputs)
            session = getattr(request, "session_hash", None) or "default"
            log.debug("run for session %s", session)
            job = backend.start(session, backend.decode_job, spec)
            records: list = []
            frame = None
            last_emit, dirty = 0.0, False
            started = time.time()
            skip = gr.skip()
            # a fresh run: clear the previous run's views that would otherwise look current
            yield (None, None, gr.update(value=0, maximum=1), _status_html(f"starting {spec.strategy} on {spec.pair}…"),
                   None, skip, skip, "", F.charts_figure(None), F.throughput_figure(None, None),
                   "<span class='tv-badge tv-na'>output vs AR: measured when the run ends</span>")
            try:
                while True:
                    try:
                        event = job.events.get(timeout=0.1)
                    except queue.Empty:
                        event = None
                    kind = event[0] if event else None
                    if kind == "iter":
                        records.append(event[1])
                        frame = F.grow_frame(frame, event[1])
                        dirty = True
                    elif kind == "loading":
                        st = event[1]
                        frac, msg = st["progress"]
                        yield (skip, skip, skip, _status_html(f"waiting for the models: {msg}", progress=frac),
                               skip, skip, skip, skip, skip, skip, skip)
                    elif kind == "status":
                        yield (skip, skip, skip, _status_html(event[1]), skip, skip, skip, skip, skip, skip, skip)
                    elif kind == "error":
                        gr.Warning(event[1])
                        yield (skip, skip, skip, _status_html(event[1], error=True), skip,
                               skip, skip, skip, skip, skip, skip)
                        return
                    elif kind == "cancelled":
                        if job.superseded:
                            return  # a newer run of this session took over the views: leave them to it
                        partial = _partial_run(records, spec) if records else None
                        n = len(records)
                        views = render_views(partial, None, n - 1 if n else None, stage_v)
                        yield (partial, None, gr.update(maximum=max(1, n - 1), value=max(0, n - 1)),
                               _status_html(f"stopped after {n} iterations"), None, *views)
                        return
                    elif kind == "done":
                        result, ar = event[1], event[2]
                        n = len(result.iterations)
                        views = render_views(result, ar, n - 1 if n else None, stage_v)
                        m = result.metrics
                        tps = m.get("tokens_per_s") or 0
                        msg = (f"{result.strategy}: {m.get('new_tokens')} tokens in {n} iterations, "
                               f"{tps:.1f} tokens/s ({result.stop_reason or 'done'}; {result.config.get('dtype')} "
                               f"on {result.config.get('device')})")
                        yield (result, ar, gr.update(maximum=max(1, n - 1), value=max(0, n - 1)),
                               _status_html(msg), save_trace(result), *views)
                        return
                    now = time.time()
                    if dirty and now - last_emit >= UPDATE_INTERVAL:
                        last_emit, dirty = now, False
                        partial = _partial_run(records, spec)
                        it = records[-1]
                        yield (skip, skip, skip,
                               _status_html(f"decoding with {spec.strategy}: iteration {it.index}, "
                                            f"{partial['metrics']['new_tokens']} tokens, "
                                            f"{now - started:.1f}s"), skip,
                               F.tree_figure(it, frame=frame), F.tokens_html(partial, selected=it.index),
                               F.metrics_html(partial, None, len(records) - 1), skip, skip, skip)
            finally:
                job.cancel.set()
                backend.finished(session, job)

        def on_stop(request: gr.Request):
            # the run's own handler reports "stopped after N iterations" (no race on the status line)
            session = getattr(request, "session_hash", None) or "default"
            log.debug("stop for session %s", session)
            if not backend.stop(session):
                gr.Info("Nothing is running.")
            return None

        def on_scrub(run, ar, index, stage_v):
            if run is None:  # nothing to scrub yet (e.g. a run is streaming): leave the live views alone
                return [gr.skip()] * len(view_outputs)
            return render_views(run, ar, index, stage_v)

        def on_stage(run, ar, index, stage_v):
            its = _get(run, "iterations") if run is not None else None
            sel = int(index) if its else None
            return F.charts_figure(run, selected=sel, stage_mode=stage_v)

        def on_strategy(name, verifier_v):
            cls = registry.get(name)
            if cls is None:
                return [gr.skip()] * (3 + len(groups))
            presets = sorted(cls.presets) or ["cpu"]
            rules = verifier_choices(name)  # only rules that can check this strategy's trees are offered
            return ([gr.update(value=cls.summary or ""),
                     gr.update(choices=presets, value="cpu" if "cpu" in presets else presets[0]),
                     gr.update(choices=rules, value=verifier_v if verifier_v in rules else "auto")] +
                    [gr.update(visible=(s == name)) for s in strategies])

        def on_preset(name, preset_v):
            cls = registry.get(name)
            if cls is None or preset_v not in cls.presets:
                return [gr.skip()] * len(param_components)
            values = preset_values(cls, preset_v)
            return [gr.update(value=values[p.name]) if s == name else gr.skip() for s, p in controls_spec]

        def on_example(label):
            if label not in example_labels:
                return gr.skip(), gr.skip()
            e = examples[example_labels.index(label)]
            p = e["prompt"]
            if isinstance(p, list):
                user = [m.get("content", "") for m in p if m.get("role") == "user"]
                return gr.update(value=user[-1] if user else ""), gr.update(value=True)
            return gr.update(value=p), gr.update(value=False)

        def replay(path, stage_v, source="trace"):
            from engine.trace import TraceError, load_run
            if not path:
                return [gr.skip()] * len(run_outputs)
            try:
                run = load_run(path)
                if not run.iterations and not run.output_ids:
                    raise TraceError("the trace holds no iterations")
            except TraceError as err:
                gr.Warning(f"Cannot replay this file: {err}")
                return ([gr.skip(), gr.skip(), gr.skip(),
                         _status_html(f"Cannot replay this file: {err}", error=True), gr.skip()]
                        + [gr.skip()] * len(view_outputs))
            except Exception as err:  # noqa: BLE001
                msg = f"Cannot replay this file: {friendly_error(err)}"
                gr.Warning(msg)
                return ([gr.skip(), gr.skip(), gr.skip(), _status_html(msg, error=True), gr.skip()]
                        + [gr.skip()] * len(view_outputs))
            n = len(run.iterations)
            views = render_views(run, None, n - 1 if n else None, stage_v)
            cfg = run.config or {}
            msg = (f"replaying {source}: {run.strategy} on {cfg.get('target')} + {cfg.get('draft')} "
                   f"({cfg.get('dtype')}), {n} iterations, {len(run.output_ids)} tokens — no models used")
            return [run, None, gr.update(maximum=max(1, n - 1), value=max(0, n - 1)), _status_html(msg),
                    gr.skip()] + list(views)

        def on_upload(path, stage_v):
            return replay(path, stage_v, "uploaded trace")

        def on_gallery(path, stage_v):
            return replay(path, stage_v, f"gallery trace '{Path(path).stem}'" if path else "gallery")

        def on_pair(name):
            if name:
                backend.pairs.request(str(name))
            return model_status_html()

        def model_status_html():
            st = backend.pairs.status()
            if st["error"]:
                return _status_html(f"models ({st['name']}): {st['error']}", error=True)
            if st["loading"]:
                frac, msg = st["progress"]
                return _status_html(f"loading {st['name']}: {msg} — the gallery and uploads work meanwhile; "
                                    "the tiny-random pair loads instantly", progress=frac)
            if st["loaded"]:
                return _status_html(f"models ready: {st['description']}")
            return _status_html("no models loaded (press Run to load the selected pair)")

        def on_compare(request: gr.Request, *args):
            *inputs, methods = args
            spec = gather(*inputs)
            methods = [m for m in (methods or []) if m in registry and m != "ar"]
            if not methods:
                raise gr.Error("Tick at least one strategy to compare with AR.")
            params_by = {spec.strategy: spec.params}
            session = getattr(request, "session_hash", None) or "default"
            job = backend.start(session, backend.compare_job, (spec, methods, params_by))
            rows, trees = [], []
            ar = None
            yield _status_html("comparing: measuring AR first…"), gr.skip(), gr.skip()
            try:
                while True:
                    try:
                        event = job.events.get(timeout=0.2)
                    except queue.Empty:
                        continue
                    kind = event[0]
                    if kind == "method":
                        name, result = event[1], event[2]
                        if name == "ar":
                            ar = result
                        row = F.metrics_rows(result, ar)
                        if name == "ar":
                            row["speedup"] = 1.0
                        row["matches AR"] = ("yes" if (result.comparison or {}).get("exact_match", name == "ar")
                                             else f"from token {(result.comparison or {}).get('first_divergence')}")
                        rows.append(row)
                        if result.iterations and name != "ar":
                            trees.append((name, result.iterations[0]))
                        yield (_status_html(f"compare: {name} done"), _table(rows),
                               F.small_multiples(trees) if trees else gr.skip())
                    elif kind in ("loading", "status"):
                        msg = event[1] if kind == "status" else f"waiting for the models: {event[1]['progress'][1]}"
                        yield _status_html(msg), gr.skip(), gr.skip()
                    elif kind == "error":
                        gr.Warning(event[1])
                        yield _status_html(event[1], error=True), gr.skip(), gr.skip()
                        return
                    elif kind == "cancelled":
                        if not job.superseded:
                            yield _status_html("comparison stopped"), gr.skip(), gr.skip()
                        return
                    elif kind == "done":
                        yield (_status_html(f"compared {len(rows)} methods on the same prompt"), _table(rows),
                               F.small_multiples(trees) if trees else F.tree_figure(None))
                        return
            finally:
                job.cancel.set()
                backend.finished(session, job)

        def _table(rows):
            cols = ["strategy", "tokens/s", "speedup", "L̄", "ℓ̄", "acceptance", "#iterations", "new tokens",
                    "matches AR"]
            data = [[_round(r.get(c)) for c in cols] for r in rows]
            return {"headers": cols, "data": data}

        def _round(v):
            return round(v, 3) if isinstance(v, float) else ("–" if v is None else v)

        # ---------------- wiring ----------------
        run_inputs = [prompt, chat, pair, strategy, preset, max_new, temperature, top_p, top_k, seed, verifier,
                      *param_components]
        run_event = run_btn.click(on_run, run_inputs + [stage_mode], run_outputs, concurrency_limit=None,
                                  api_name="run", show_progress="minimal")
        # A new run of a session cancels that session's run in flight in the backend (Backend.start): its worker
        # stops at the next iteration and its handler exits without touching the views. (Gradio's `cancels=` is
        # not used for this: it races with a Run click that lands just before it and can kill the newer run.)
        prompt.submit(on_run, run_inputs + [stage_mode], run_outputs, concurrency_limit=None,
                      api_visibility="private", show_progress="minimal")
        # live tuning: releasing a slider (or ticking a box) re-runs with the new value
        live = [c for c in param_components + [max_new, temperature, top_p, top_k]]
        for comp in live:
            trigger = comp.release if isinstance(comp, gr.Slider) else (
                comp.input if isinstance(comp, gr.Checkbox) else comp.submit)
            trigger(on_run, run_inputs + [stage_mode], run_outputs, concurrency_limit=None,
                    show_progress="hidden", api_visibility="private")
        stop_btn.click(on_stop, None, None, api_name="stop", concurrency_limit=None, queue=False)
        scrubber.input(on_scrub, [run_state, ar_state, scrubber, stage_mode], view_outputs, show_progress="hidden",
                        api_name="scrub", concurrency_limit=None)
        stage_mode.change(on_stage, [run_state, ar_state, scrubber, stage_mode], charts, show_progress="hidden")
        strategy.change(on_strategy, [strategy, verifier], [summary, preset, verifier] + groups)
        preset.input(on_preset, [strategy, preset], param_components)
        example.input(on_example, example, [prompt, chat])
        upload.upload(on_upload, [upload, stage_mode], run_outputs, api_name="upload")
        gallery.input(on_gallery, [gallery, stage_mode], run_outputs, api_name="gallery")
        pair.input(on_pair, pair, model_status)
        compare_btn.click(on_compare, run_inputs + [compare_methods], [run_status, compare_table, compare_plot],
                          concurrency_limit=None, api_name="compare")
        timer = gr.Timer(1.0)
        timer.tick(model_status_html, None, model_status, show_progress="hidden", queue=False,
                   api_visibility="private")
        demo.load(model_status_html, None, model_status, queue=False, api_visibility="private")
        if traces:
            demo.load(on_gallery, [gallery, stage_mode], run_outputs)
    demo._treeviz_backend = backend  # for tests
    return demo


def launch_kwargs() -> dict:
    return {"css": CSS, "theme": gr.themes.Soft()}
