"""Progress reporting for slow loads: one callback `progress(fraction, message)` that sub-tasks share.

A sub-task reports its own 0..1; `span` maps that onto its slice of the caller's bar, so a load that assembles,
converts and then reads weights moves one bar forward once, never backwards.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

log = logging.getLogger("engine.models")

Progress = Callable[[float, str], None]


def say(progress: Progress | None, fraction: float, message: str, *, quiet: bool = False) -> None:
    """Log `message` (unless quiet) and move the bar to `fraction`, clamped to 0..1."""
    if not quiet:
        log.info(message)
    if progress is not None:
        progress(min(max(fraction, 0.0), 1.0), message)


def span(progress: Progress | None, lo: float, hi: float) -> Progress | None:
    """Map a sub-task's 0..1 onto [lo, hi] of the caller's bar."""
    if progress is None:
        return None
    return lambda f, msg: progress(lo + (hi - lo) * min(max(f, 0.0), 1.0), msg)


@contextlib.contextmanager
def forward_gguf_tqdm(progress: Progress | None, message: str):
    """transformers dequantises GGUF tensors in a tqdm loop (a minute or two); mirror it on our bar. Best effort."""
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        gguf_utils = None
    original = getattr(gguf_utils, "tqdm", None)
    if progress is None or original is None:
        yield
        return

    def tqdm(iterable, *args, **kwargs):
        total = max(len(iterable), 1)
        for i, item in enumerate(original(iterable, *args, **kwargs)):
            if i % 8 == 0:
                progress(i / total, f"{message} ({i}/{total} tensors)")
            yield item

    gguf_utils.tqdm = tqdm
    try:
        yield
    finally:
        gguf_utils.tqdm = original
