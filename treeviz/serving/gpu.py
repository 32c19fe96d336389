"""Hugging Face ZeroGPU, when the `spaces` package is installed; plain local execution otherwise. Never gradio.

On a ZeroGPU Space CUDA exists only inside a function decorated with `spaces.GPU`, which runs in a forked worker
process: its arguments and every value it yields are pickled across, and of an exception only a gradio error keeps
its text (any other reaches the page as "ZeroGPU worker error: ClassName"). Off ZeroGPU (any machine without
SPACES_ZERO_GPU set) `spaces.GPU` returns the function unchanged, so the same decorated work runs locally.
`spaces` must be imported before torch on a Space (it patches torch's CUDA entry points): app.py imports this module
first. `spaces` imports without gradio off ZeroGPU; where it is absent, so is ZeroGPU.

The serving room runs without gradio (the GPU check runs it on a machine that has none), so gradio's error type is
the page's to hand in (`use_page_error`), once, at import: a forked worker inherits it.
"""
from __future__ import annotations

import html
import re
from typing import Callable

try:  # an optional dependency: a Space installs it, a plain local install may not
    import spaces
except ImportError:
    spaces = None

GPU_SECONDS_MAX = 120  # the most one request may ask ZeroGPU for, after spaces' own multiplier (longer asks queue)


class PageInterface:
    """What the page hands the serving room: `error`, the exception type whose text survives ZeroGPU's worker
    boundary and that ZeroGPU's own messages come as (gr.Error); None where no page runs (a script, the GPU check)."""

    def __init__(self):
        self.error: type[Exception] | None = None


PAGE = PageInterface()  # one per process; a forked worker inherits what the page set


def use_page_error(error: type[Exception]) -> None:
    """The page's error type (gr.Error): work errors cross the GPU boundary as it, and ZeroGPU's are known by it."""
    PAGE.error = error


def page_error(message: str) -> Exception | None:
    """`message` as the page's error (its traceback printing off: the boundary logged it), or None without a page."""
    if PAGE.error is None:
        return None
    err = PAGE.error(message)
    err.print_exception = False  # spaces prints a gradio error's traceback only when this is true
    return err


def on_zero_gpu() -> bool:
    """True on a ZeroGPU Space (models must then be loaded at import time and placed on `cuda`)."""
    return spaces is not None and spaces.config.Config.zero_gpu


def gpu(duration: Callable[..., int]) -> Callable[[Callable], Callable]:
    """`spaces.GPU(duration=duration)` when `spaces` is importable, else the function itself."""
    if spaces is None:
        return lambda fn: fn
    if on_zero_gpu():  # its workers are forked from this multi-threaded process (imported here: spaces before torch)
        from engine.runtime import one_thread_in_forked_children
        one_thread_in_forked_children()
    return spaces.GPU(duration=duration)


def duration_factor() -> float:
    """What `spaces` multiplies every asked duration by on the card this machine has (its configs.json: 1.0 on the
    H200, 1.5 on the RTX PRO 6000 Blackwell; none for an 'xlarge' slot): read from spaces itself, 1.0 without it."""
    if spaces is None:
        return 1.0
    from spaces.zero import default_gpu_size
    from spaces.zero.config import get_config
    return 1.0 if default_gpu_size() == "xlarge" else float(get_config()["duration_factor"])


def is_zero_gpu_error(err: BaseException) -> bool:
    """ZeroGPU reports quota, queue timeouts and aborted (over-time) tasks as gradio errors titled 'ZeroGPU …'."""
    return (PAGE.error is not None and isinstance(err, PAGE.error)
            and str(getattr(err, "title", "") or "").startswith("ZeroGPU"))


def error_text(err: BaseException) -> str:
    """A gradio error's message (its text for the user)."""
    return str(getattr(err, "message", err))


def zero_gpu_message(err: BaseException) -> str:
    """One plain sentence: ZeroGPU's messages may carry HTML (links to sign in / subscribe)."""
    text = " ".join(html.unescape(re.sub(r"<[^>]+>", "", error_text(err))).split())
    if "aborted" in text.lower():
        text = ("the run used up its GPU time slot and was stopped; lower max new tokens or the node budget and "
                "run again")
    return f"{err.title}: {text}"
