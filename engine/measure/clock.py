"""The stage clock of one decoding iteration: back-to-back stages, each timed to its end with the device's work in it.

    clock = StageClock(device)
    with clock("build"):
        ...
    with clock("verify"):
        ...
    record.times = clock.times(draft=drafter_seconds, within="build")

Stages run back to back: each one's seconds run from the end of the one before (the first from the clock's start) to
its own end, after a device synchronize, so the queued work it launched is counted in it and the stages add up to the
total.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch

from engine.core.trace import StageTimes
from engine.runtime import synchronize


class StageClock:
    def __init__(self, device: torch.device):
        self.device = device
        self.start = self.mark = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        yield
        synchronize(self.device)
        now = time.perf_counter()
        self.seconds[stage], self.mark = now - self.mark, now

    def times(self, draft: float, within: str) -> StageTimes:
        """The stages' seconds (build, verify, commit, record) and their total, with `draft` seconds (timed by the
        drafter's own clock) taken out of the stage `within` and given as the draft stage."""
        stages = dict(self.seconds)
        stages[within] -= draft
        return StageTimes(draft=draft, **stages, total=self.mark - self.start)
