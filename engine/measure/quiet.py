"""Whether a measurement had its CPU cores to itself: the CPU time other processes ran on them meanwhile (/proc).

    with watch_cpu() as watch:
        seconds = measure(...)
    if not watch.disturbed:
        write_json(...)            # only a quiet measurement is cached

A cached table is read by every later start. One measured beside a compile, a test suite or another app routes every
later run by numbers that were never true: on a 2-core Zen 3, a format probe disturbed that way sent the target's
widest weights to kernels that cost 1.9x a one-row step at two rows, where the right one costs 1.1x
(docs/experiments/2026-11-28-quiet-measurements.md). So what was measured beside other work serves the run that
measured it and is measured again at the next start.

Only the cores this process may run on are counted (its affinity: a container's cpuset), and other work up to the
cores its threads leave free does not count: it does not take a core from them. Where /proc cannot say (not Linux),
or the window is too short for the kernel's 10 ms tick to tell, a measurement is not judged and counts as quiet.
"""
from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

ALLOWANCE = 0.15  # cores' worth of other work tolerated beyond the free cores: daemons, an idle browser tab
SHORTEST = 1.0  # seconds: a shorter window is not judged (a 10 ms tick is 1 % of it)
_TICK_SLACK = 3  # ticks of rounding in the two /proc readings


@dataclass(frozen=True)
class Sharing:
    """CPU time other processes (and the hypervisor's steal) took on this process's cores during a window."""
    others_s: float
    wall_s: float
    threads: int  # this process's compute threads (torch's)
    cores: int  # the cores this process may run on
    tick_s: float = 0.01

    @property
    def disturbed(self) -> bool:
        """Other work took more than the cores the threads leave free, by more than ALLOWANCE, over a window long
        enough to judge."""
        if self.wall_s < SHORTEST:
            return False
        spare = max(self.cores - self.threads, 0)
        return self.others_s > (spare + ALLOWANCE) * self.wall_s + _TICK_SLACK * self.tick_s

    @property
    def others_cores(self) -> float:
        """Cores other work used on average during the window."""
        return self.others_s / self.wall_s if self.wall_s > 0 else 0.0

    def describe(self) -> str:
        return (f"other processes used {self.others_cores:.2f} of this process's {self.cores} cores while it was "
                f"measured on {self.threads} thread(s)")


class CpuWatch:
    """What `watch_cpu` yields: `sharing` is set when the block ends (None where /proc cannot say)."""
    sharing: Sharing | None = None

    @property
    def disturbed(self) -> bool:
        return self.sharing is not None and self.sharing.disturbed


@contextmanager
def watch_cpu() -> Iterator[CpuWatch]:
    """Measure the other processes' CPU time on this process's cores while the block runs."""
    watch, cores = CpuWatch(), _cores()
    before, own, start = _busy_ticks(cores), time.process_time(), time.perf_counter()
    yield watch
    after, own, wall = _busy_ticks(cores), time.process_time() - own, time.perf_counter() - start
    if before is not None and after is not None:
        tick = 1.0 / os.sysconf("SC_CLK_TCK")
        others = max((after - before) * tick - own, 0.0)
        watch.sharing = Sharing(others, wall, torch.get_num_threads(), len(cores), tick)


def _cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _busy_ticks(cores: list[int]) -> int | None:
    """Busy ticks of `cores` summed (user, nice, system, irq, softirq and steal), or None where /proc cannot say."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    wanted, busy, seen = {f"cpu{c}" for c in cores}, 0, 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name in wanted:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in rest.split()[:8])
            busy += user + nice + system + irq + softirq + steal
            seen += 1
    return busy if seen == len(wanted) else None
