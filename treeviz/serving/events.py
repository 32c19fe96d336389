"""What a request emits: the typed events a RunSession yields and the handlers render (treeviz/page/handlers.py,
treeviz/page/teaching_handlers.py).

Plain frozen dataclasses over engine.core.trace records, so they pickle across ZeroGPU's worker boundary.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.core.trace import RunResult


@dataclass(frozen=True)
class Started:
    text: str                          # what the request is about to do


@dataclass(frozen=True)
class Progress:
    text: str                          # waiting for the models or the pair, measuring AR, the next compared method
    fraction: float | None = None      # of the model load, when known


@dataclass(frozen=True)
class Iteration:
    """The run so far (a snapshot) while it decodes, `batched` iterations after the previous Iteration event."""
    run: RunResult
    batched: int


@dataclass(frozen=True)
class Finished:
    """One run ended, every iteration in `result`: a Run's (with AR beside it when AR was cached, else None until
    BaselineMeasured), or a compared method's (the first is AR itself: `result is ar`)."""
    result: RunResult
    ar: RunResult | None = None


@dataclass(frozen=True)
class BaselineMeasured:
    """AR on the same prompt was measured after the Run's Finished: `result` now carries its comparison."""
    result: RunResult
    ar: RunResult


@dataclass(frozen=True)
class Raced:
    runs: list                         # [(label, RunResult)], AR first, each compared with this request's AR


@dataclass(frozen=True)
class Swept:
    progress: dict                     # engine.bench.sweep's event: {"done", "total", "sweep", "complete"?, ...}


@dataclass(frozen=True)
class Stopped:
    superseded: bool                   # a newer request of the same view took over: its events own the views


@dataclass(frozen=True)
class Failed:
    message: str                       # one plain sentence; the traceback went to the log


@dataclass(frozen=True)
class ARMeasured:
    """AR measured by the work, `key` its ARCache key: the session keeps it in this process's AR cache and passes it
    to no handler (a ZeroGPU worker's cache is a copy that dies with the worker, so the result travels back here)."""
    key: tuple
    result: RunResult
    measured_at: float                 # time.time() when AR finished


Event = Started | Progress | Iteration | Finished | BaselineMeasured | Raced | Swept | Stopped | Failed
WorkEvent = Event | ARMeasured         # what the model work yields; the session keeps ARMeasured to itself
