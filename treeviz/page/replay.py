"""Replaying trace files (gallery and uploads) with no models: a file becomes run outputs, or one plain message."""
from __future__ import annotations

import json
from pathlib import Path

import gradio as gr

from engine.core.trace import Comparison, RunConfig, RunResult, TraceError, known, load_run
from treeviz.page.views import last_index, outputs, render_views, status_html

ROOT = Path(__file__).resolve().parents[2]
TRACE_DIR = ROOT / "assets" / "traces"
MAX_TRACE_MB = 20  # a 512-token run with 256-node trees is ~15 MB; anything larger is not worth parsing


def gallery_traces() -> list[Path]:
    """Gallery files, best first: real models before tiny random ones, greedy runs that equal AR before those a bf16
    near-tie made diverge (the first view should not open on a caveat), then by the speedup recorded with each."""
    paths = sorted(TRACE_DIR.glob("*.json")) if TRACE_DIR.exists() else []
    return sorted(paths, key=lambda p: gallery_rank(_summary(p)) + (p.stem,))


def gallery_rank(summary: dict) -> tuple:
    return (summary["tiny"], summary.get("diverged", False), -(summary["speedup"] or 0.0))


def _summary(path: Path) -> dict:
    """What the gallery list shows of a trace: models, strategy, preset, prompt kind, speedup (cached per file)."""
    key = (str(path), path.stat().st_mtime_ns)
    if key not in _SUMMARIES:
        try:
            data = json.loads(path.read_text())
            config, comparison = RunConfig.from_dict(data.get("config")), known(Comparison, data.get("comparison"))
            target = str(config.target or "?")
            temperature = config.sampling.temperature or 0
            _SUMMARIES[key] = {"tiny": target.startswith("tiny"), "speedup": comparison.speedup_vs_ar,
                               "strategy": data.get("strategy"), "target": target, "temperature": temperature,
                               "machine": config.machine,
                               # a sampled run is not expected to equal AR's output; a greedy one is
                               "diverged": temperature == 0 and bool(data.get("comparison"))
                                           and not comparison.exact_match}
        except (OSError, ValueError, AttributeError, TypeError):
            _SUMMARIES[key] = {"tiny": True, "speedup": None, "strategy": None, "target": "?", "temperature": 0}
    return _SUMMARIES[key]


_SUMMARIES: dict[tuple, dict] = {}


def gallery_label(path: Path) -> str:
    """e.g. "code: dynatree (cpu) · 2.31× vs AR on Intel Xeon, 2 cores, AMX · Qwen2.5-Coder-1.5B-Instruct" from a
    make_gallery file (pair_kind_strategy_preset.json), the speedup recorded in it and the machine it names."""
    info = _summary(path)
    parts = path.stem.rsplit("_", 3)
    head = f"{parts[1]}: {parts[2]} ({parts[3]})" if len(parts) == 4 else path.stem.replace("_", " ")
    if info["temperature"]:
        head += f" at T={info['temperature']:g}"
    speedup = f" · {info['speedup']:.2f}× vs AR" if info["speedup"] else ""
    if speedup:  # a speed belongs to the machine it was measured on, which may be nothing like this one
        speedup += f" on {info.get('machine') or 'a machine it does not name'}"
    return f"{head}{speedup} · {info['target'].split('/')[-1]}"


def read_trace(path: str) -> RunResult:
    """The trace at `path`; TraceError with a plain message for anything that is not a replayable trace."""
    size = Path(path).stat().st_size
    if size > MAX_TRACE_MB * 1024 * 1024:
        raise TraceError(f"the file is {size / 1024 / 1024:.0f} MB; traces up to {MAX_TRACE_MB} MB can be replayed")
    try:
        run = load_run(path)
    except RecursionError:  # json's parser recurses once per nesting level
        raise TraceError("the file's JSON is nested too deeply to be a treeviz trace") from None
    except (AttributeError, TypeError, ValueError) as err:  # well-formed JSON of the wrong shape
        raise TraceError(f"not a treeviz trace ({type(err).__name__}: {err})") from None
    if not run.iterations and not run.output_ids:
        raise TraceError("the trace holds no iterations")
    return run


def replay(path: str | None, stage_mode: str, source: str) -> tuple:
    """Run outputs (states, scrubber, status, download, views) for the trace at `path`."""
    if not path:
        return outputs({})
    try:
        run = read_trace(path)
        views = render_views(run, None, last_index(run), stage_mode)
    except (TraceError, AttributeError, KeyError, TypeError, ValueError) as err:  # a malformed record inside
        message = f"Cannot replay this file: {err}"
        gr.Warning(message)
        return outputs({"status": status_html(message, error=True)})
    n, cfg = len(run.iterations), run.config
    message = (f"replaying {source}: {run.strategy} on {cfg.target} + {cfg.draft} "
               f"({cfg.dtype}), {n} iterations, {len(run.output_ids)} tokens — no models used")
    return outputs({"run": run, "ar": None, "scrubber": gr.update(maximum=max(1, n - 1), value=max(0, n - 1)),
                    "status": status_html(message), **views})
