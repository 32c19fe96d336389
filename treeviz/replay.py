"""Replaying trace files (gallery and uploads) with no models: a file becomes run outputs, or one plain message."""
from __future__ import annotations

from pathlib import Path

import gradio as gr

from engine.trace import RunResult, TraceError, load_run
from treeviz.views import last_index, render_views, status_html

ROOT = Path(__file__).resolve().parent.parent
TRACE_DIR = ROOT / "assets" / "traces"
MAX_TRACE_MB = 20  # a 512-token run with 256-node trees is ~15 MB; anything larger is not worth parsing


def gallery_traces() -> list[Path]:
    """Gallery files, a code/DynaTree trace first (the most telling first view)."""
    paths = sorted(TRACE_DIR.glob("*.json")) if TRACE_DIR.exists() else []
    return sorted(paths, key=lambda p: (not ("code" in p.stem and "dynatree" in p.stem), "identical" in p.stem,
                                        p.stem))


def gallery_label(path: Path) -> str:
    return path.stem.replace("_", " ")


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


def replay(path: str | None, stage_mode: str, source: str) -> list:
    """Run outputs (states, scrubber, status, download, views) for the trace at `path`."""
    if not path:
        return [gr.skip()] * 11
    try:
        run = read_trace(path)
        views = render_views(run, None, last_index(run), stage_mode)
    except (TraceError, AttributeError, KeyError, TypeError, ValueError) as err:  # a malformed record inside
        message = f"Cannot replay this file: {err}"
        gr.Warning(message)
        return [gr.skip()] * 3 + [status_html(message, error=True)] + [gr.skip()] * 7
    n, cfg = len(run.iterations), run.config
    message = (f"replaying {source}: {run.strategy} on {cfg.get('target')} + {cfg.get('draft')} "
               f"({cfg.get('dtype')}), {n} iterations, {len(run.output_ids)} tokens — no models used")
    return [run, None, gr.update(maximum=max(1, n - 1), value=max(0, n - 1)), status_html(message), gr.skip(),
            *views]
