"""How much last-level cache this process has: what sysfs reports, or less where a warm re-read of a smaller buffer
already runs at memory speed.

The format probe (engine/cpu/formats.py) sizes its sweeps, and the flush before each, by this: enough of a group's
layers to overflow the cache, and a flush that evicts them. A VM may report its host socket's whole L3 to a guest of
two vCPUs; sized by such a report, the probe reads and flushes several times the bytes it needs
(docs/experiments/2026-12-07-probe-cache.md). The measured edge is doubled (MARGIN), as too small a size is the costly
error: the probe would time weights from the cache and route by it. Measured once per machine and cached where the
machine was quiet, as the cost tables are, so every start probes with the same size.
"""
from __future__ import annotations

import functools
import time
from pathlib import Path

import torch

from engine.measure.costs import machine, read_cached, table_file, write_json
from engine.measure.quiet import watch_cpu

FORMAT = 4  # bump when the meaning of a cached measurement changes
FALLBACK = 32 << 20  # where sysfs says nothing
GRID = tuple(m << 20 for m in (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072))
MEMORY_SPEED = 1.25  # a warm re-read within this factor of an uncacheable buffer's rate is served mostly from memory
# (on the AMX Xeon of 2026-12-07 a 96 MiB buffer read 1.19x memory's rate on one thread: partly held, counted out)
PASSES = 3  # over the grid; each size's fastest read counts (other work only ever slows one)
MARGIN = 2  # the edge is doubled: a start measures it while its other thread imports the page, so it may come
# out small, and a probe sized by too small a cache times its weights from the cache (see the lab note above)
LARGEST = 4 << 30  # a report beyond this is not believed (and not allocated twice over)


def reported_cache(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """Bytes of the largest cache sysfs reports for cpu0 (FALLBACK where it reports none)."""
    best = 0
    for index in root.glob("index*"):
        try:
            size = (index / "size").read_text().strip()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1], 1)
            best = max(best, int(size.rstrip("KMG")) * scale)
        except (OSError, ValueError, IndexError):
            continue
    return min(best or FALLBACK, LARGEST)


def warm_read_rate(nbytes: int, repeats: int = 5, seconds: float = 0.05) -> float:
    """Bytes per second of the fastest of at least `repeats` sums on one thread, and of as many as `seconds` holds,
    of an fp32 buffer of `nbytes` read twice before: a buffer the cache holds is re-read at the cache's speed, a
    larger one at memory's. One thread: its reads drop from the cache's speed to memory's within one step of the grid
    (2x to 1.2x on the AMX Xeon of 2026-12-07, where two threads' fell over three), and work on the other core
    leaves them alone. Noise only slows a read, so the fastest is the measure."""
    buffer = torch.ones(max(nbytes // 4, 1))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        buffer.sum()
        buffer.sum()
        fastest, count, begin = float("inf"), 0, time.perf_counter()
        while count < repeats or time.perf_counter() - begin < seconds:
            start = time.perf_counter()
            buffer.sum()
            fastest, count = min(fastest, time.perf_counter() - start), count + 1
    finally:
        torch.set_num_threads(threads)
    return nbytes / fastest


def cache_knee(reported: int, rate=warm_read_rate, passes: int = PASSES) -> int:
    """`edge` of each size's fastest warm re-read over `passes` passes (the grid below `reported`, and a buffer of
    twice `reported`, which no cache holds, for memory's speed): other work only ever slows a read, whether of a
    cached buffer or of memory's."""
    sizes = [2 * reported] + [s for s in GRID if s < reported]
    fastest = dict.fromkeys(sizes, 0.0)
    for _ in range(passes):
        for size in sizes:
            fastest[size] = max(fastest[size], rate(size))
    return edge(fastest, reported)


def edge(fastest: dict[int, float], reported: int) -> int:
    """The smallest size below `reported` from which a warm re-read runs at memory speed (within MEMORY_SPEED of the
    rate of twice `reported`), two sizes in a row so that one slow read is not taken for the edge; `reported` where
    no smaller size is slow, or where the smallest is (no cache of a report above it is that small: a measure made
    while other work held the cores)."""
    memory = fastest[2 * reported]
    sizes = sorted(s for s in fastest if s < reported)
    if sizes and fastest[sizes[0]] <= MEMORY_SPEED * memory:
        return reported  # even the smallest buffer read at memory's speed: the cores were taken, nothing was learnt
    slow_before = False
    for i, size in enumerate(sizes):
        slow = fastest[size] <= MEMORY_SPEED * memory
        if slow and slow_before:
            return sizes[i - 1]
        if slow and i == len(sizes) - 1:
            return size
        slow_before = slow
    return reported


@functools.cache
def _effective(reported: int, threads: int) -> int:
    key = {"format": FORMAT, "probe": "cache-knee", "reported": reported, "grid": list(GRID),
           **machine(torch.device("cpu"))}
    data = read_cached(key)
    if data is not None and isinstance(data.get("bytes"), int):
        return data["bytes"]
    with watch_cpu() as watch:
        knee = cache_knee(reported)
    size = min(reported, MARGIN * knee)
    if not watch.disturbed:
        write_json(table_file(key), {"key": key, "bytes": size, "knee": knee, "reported": reported,
                                     "measured_at": time.time()})
    return size


def effective_cache() -> int:
    """Bytes of last-level cache the probe counts on: sysfs's report, or MARGIN times the `cache_knee` below it where
    that is smaller; measured once per machine and
    thread count (threads read at different rates; the key holds both), and read back at every later start."""
    return _effective(reported_cache(), torch.get_num_threads())
