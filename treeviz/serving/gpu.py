"""Hugging Face ZeroGPU, when the `spaces` package is installed; plain local execution otherwise.

On a ZeroGPU Space CUDA exists only inside a function decorated with `spaces.GPU`, which runs in a forked worker
process: its arguments and every value it yields are pickled across. Off ZeroGPU (any machine without
SPACES_ZERO_GPU set) `spaces.GPU` returns the function unchanged, so the same decorated handler runs locally.
`spaces` must be imported before torch on a Space (it patches torch's CUDA entry points): app.py imports this module
first.
"""
from __future__ import annotations

import html
import re
from typing import Callable

import gradio as gr

try:  # an optional dependency: a Space installs it, a plain local install may not
    import spaces
except ImportError:
    spaces = None

GPU_SECONDS_MAX = 120  # ZeroGPU's default slot is 60 s; longer requests queue behind shorter ones


def on_zero_gpu() -> bool:
    """True on a ZeroGPU Space (models must then be loaded at import time and placed on `cuda`)."""
    return spaces is not None and spaces.config.Config.zero_gpu


def gpu(duration: Callable[..., int]) -> Callable[[Callable], Callable]:
    """`spaces.GPU(duration=duration)` when `spaces` is importable, else the function itself."""
    if spaces is None:
        return lambda fn: fn
    return spaces.GPU(duration=duration)


def is_zero_gpu_error(err: BaseException) -> bool:
    """ZeroGPU reports quota, queue timeouts and aborted (over-time) tasks as gr.Error titled 'ZeroGPU …'."""
    return isinstance(err, gr.Error) and str(getattr(err, "title", "") or "").startswith("ZeroGPU")


def zero_gpu_message(err: gr.Error) -> str:
    """One plain sentence: ZeroGPU's messages may carry HTML (links to sign in / subscribe)."""
    text = html.unescape(re.sub(r"<[^>]+>", "", str(err.message if hasattr(err, "message") else err)))
    text = " ".join(text.split())
    if "aborted" in text.lower():
        text = ("the run used up its GPU time slot and was stopped; lower max new tokens or the node budget and "
                "run again")
    return f"{err.title}: {text}"
