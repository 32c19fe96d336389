"""What keeps a builder process (engine/cpu/builder.py) safe to run beside the app: one compile at a time, a
memory budget checked before each compile, an end with the app that started it, and a status file the app can show.

    end_with_parent(parent_pid, on_end)                              # PR_SET_PDEATHSIG and a watchdog thread
    with build_lock(folder, timeout=1800, on_wait=say) as held:      # one compile per captured folder at a time
        need = compile_peak_estimate(package_weight_bytes(model, path), earlier_peaks(folder, key))
        fits, room = wait_for_memory(need, headroom=1 << 30, budget=None, timeout=600, on_wait=say)
        with PeakMemory() as peak:                                    # this process and its compilers, sampled
            build(...)
    read_build_status(path)                                           # what the app reads for its page

Why: an unguarded builder compiling the default pair's fp32 target outgrew the machine beside the app; the kernel's
OOM killer ended the app, and the builder went on alone (docs/experiments/2026-11-26-every-cpu.md, "The builder's
memory").

Linux only where it matters (/proc, prctl); elsewhere the lock still holds, memory is not checked, and the parent
is watched by polling os.getppid().
"""
from __future__ import annotations

import ctypes
import fcntl
import itertools
import json
import os
import resource
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from torch import nn

from engine.cpu.kernels import RoutedLinear
from engine.cpu.memory import available_memory

LOCK_NAME = ".build.lock"
DEFAULT_PEAK_FACTOR = 2.5       # compile growth per byte of weights the package holds, before anything was measured
DEFAULT_PEAK_FIXED = 1 << 29    # the compiler itself (inductor's workers, g++) ...
DEFAULT_PEAK_PER_LAYER = 0.09 * (1 << 30)  # ... and per decoder layer of the graph it compiles
MEASURED_MARGIN = 1.15          # over the largest growth measured for an earlier package of the same model
GiB = float(1 << 30)


# -- the memory a compile will need -----------------------------------------------------------------------------------

def compile_peak_estimate(weight_bytes: int, earlier_peaks: list[tuple[int, int]], layers: int = 0) -> int:
    """Bytes a package's compile is expected to add to the builder's resident memory.

    `weight_bytes`: what the package freezes in (package_weight_bytes). `earlier_peaks`: (weight_bytes, measured
    growth) of earlier packages of the same model and dtype on this machine (`earlier_peaks`, from their meta JSON).
    With any, the largest growth, scaled up (never down) by how many more weight bytes this package holds, plus a
    margin. Without, DEFAULT_PEAK_FACTOR x the weights + DEFAULT_PEAK_FIXED + DEFAULT_PEAK_PER_LAYER x `layers`.
    Since weights are the packages' inputs (aoti.FORMAT 4+) the compiler's own part dominates, and it grows with
    the graph, so the default is per decoder layer; the growths it is fitted to are in the lab note
    (docs/experiments/2026-11-26-every-cpu.md, "The builder's memory"). Adjust here: the default is what a first
    start relies on, before its first package is measured."""
    if earlier_peaks:
        return int(MEASURED_MARGIN * max(growth * max(1.0, weight_bytes / max(weights, 1))
                                         for weights, growth in earlier_peaks))
    return int(DEFAULT_PEAK_FACTOR * weight_bytes + DEFAULT_PEAK_FIXED + DEFAULT_PEAK_PER_LAYER * layers)


def package_weight_bytes(model: nn.Module) -> int:
    """Bytes of `model`'s tensors a package freezes in as constants: its norms, biases and buffers. Not the linears'
    weights (a package's inputs since aoti.FORMAT 2: every package shares the model's resident copy) nor the input
    embedding (the lookup stays outside)."""
    outside = {id(model.get_input_embeddings().weight)}
    embedding = getattr(model.get_input_embeddings(), "embedding", None)  # a wrapped embedding (models/widths.py)
    if embedding is not None:
        outside.add(id(embedding.weight))
    for module in model.modules():
        if isinstance(module, (nn.Linear, RoutedLinear)):
            outside.add(id(module.weight))
            outside.update(id(b) for b in module.buffers(recurse=False))
    inside = {id(t): t for t in itertools.chain(model.parameters(), model.buffers()) if id(t) not in outside}
    return sum(t.nbytes for t in inside.values())


def earlier_peaks(folder: Path, key: dict) -> list[tuple[int, int]]:
    """(weight_bytes, compile_growth_bytes) of every package in `folder` whose meta names the same model and dtype
    as `key` and recorded its growth (packages built before growth was recorded are not counted)."""
    out = []
    for meta_file in folder.glob("*.json"):
        try:
            meta = json.loads(meta_file.read_text())
            other = meta["key"]
            if other["model"] == key["model"] and other["dtype"] == key["dtype"]:
                out.append((int(meta["weight_bytes"]), int(meta["compile_growth_bytes"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a package's meta (a status or request file), or one without memory numbers
    return out


def room_for_compile(headroom: int, budget: int | None) -> int | None:
    """Bytes a compile may add now: MemAvailable less `headroom`, and at most `budget` less what this process
    already holds, when a budget is given (the app's memory plan less what the app holds: the builder's whole
    footprint, its loaded models included, must fit it). None: nothing is known (no /proc/meminfo, no budget)."""
    free = available_memory()
    room = None if free is None else free - headroom
    if budget is not None:
        left = budget - process_rss()
        room = left if room is None else min(room, left)
    return room


class WaitClock:
    """Seconds waited since it was made, read at every poll of period `poll`, where a gap between two reads longer
    than two polls and a second counts as that much. The app pauses its builder (SIGSTOP) while a run decodes; a
    builder waiting for memory or the lock cannot wait while stopped, so a long run must not use up its waits."""

    def __init__(self, poll: float, now: Callable[[], float] = time.monotonic):
        self.gap, self.now, self.waited = 2 * poll + 1.0, now, 0.0
        self.last = now()

    def __call__(self) -> float:
        now = self.now()
        self.waited += min(now - self.last, self.gap)
        self.last = now
        return self.waited


def wait_for_memory(need: int, *, headroom: int, budget: int | None, timeout: float, poll: float = 5.0,
                    on_wait: Callable[[int, int], None] | None = None) -> tuple[bool, int | None]:
    """Wait until `need` bytes fit in `room_for_compile`, polling every `poll` s for up to `timeout` s of waiting
    (`WaitClock`: time paused does not count); calls `on_wait(need, room)` at every poll that finds too little.
    Returns (fits, the last room seen)."""
    waited = WaitClock(poll)
    while True:
        room = room_for_compile(headroom, budget)
        if room is None or need <= room:
            return True, room
        left = timeout - waited()
        if left <= 0:
            return False, room
        if on_wait is not None:
            on_wait(need, room)
        time.sleep(min(poll, left))


# -- one compile at a time --------------------------------------------------------------------------------------------

def lock_file(folder: Path) -> Path:
    return folder / LOCK_NAME


@contextmanager
def build_lock(folder: Path, timeout: float, poll: float = 0.5, holder: str = "",
               on_wait: Callable[[str], None] | None = None) -> Iterator[bool]:
    """Hold the advisory lock of the captured `folder` (fcntl.flock on folder/.build.lock) while the block runs;
    yields True, or False when another process held it for `timeout` s of waiting (`WaitClock`: time this process
    was paused does not count). While waiting, `on_wait(holder text)` is
    called once with what the holder wrote into the lock file (its pid and package). The kernel releases the lock
    when its file is closed, so a killed builder never leaves it held.

    One lock per folder, not per package: the memory check before a compile is only sound when no other compile is
    growing meanwhile, and two compiles on a small CPU finish no sooner than one after the other."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_file(folder), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        waited, told, held = WaitClock(poll), False, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except BlockingIOError:
                if not told and on_wait is not None:
                    on_wait(os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process")
                    told = True
                if waited() >= timeout:
                    break
                time.sleep(poll)
        if held:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()}{': ' + holder if holder else ''}".encode(), 0)
        yield held
    finally:
        os.close(fd)  # releases the lock


# -- memory actually used ---------------------------------------------------------------------------------------------

def _status_kib(pid: int | str, field: str) -> int:
    """A `kB` field of /proc/PID/status in bytes (0 when the process or the field is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def process_rss(pid: int | str = "self") -> int:
    """Resident bytes of one process (VmRSS)."""
    return _status_kib(pid, "VmRSS")


def proc_stat(pid: int) -> tuple[int, int, int] | None:
    """(parent pid, process group, start time in clock ticks since boot) of `pid` from /proc/PID/stat, or None when
    it is gone or a zombie (an exited process nobody reaped yet counts as gone). The start time tells a live process
    from a later one that got the same pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    rest = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    if rest[0] in ("Z", "X"):
        return None
    return int(rest[1]), int(rest[2]), int(rest[19])


def children_map() -> dict[int, list[int]]:
    """Parent pid -> child pids of every live process (one pass over /proc)."""
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := proc_stat(int(entry))) is not None:
            out.setdefault(stat[0], []).append(int(entry))
    return out


def descendants(pid: int, children: dict[int, list[int]] | None = None) -> list[int]:
    """Every live descendant of `pid` (children first)."""
    children = children_map() if children is None else children
    out, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop(0)
        out.append(child)
        todo.extend(children.get(child, []))
    return out


class PeakMemory:
    """Peak resident bytes of this process and its descendants (inductor's compile workers, the C++ compiler) while
    the block runs: the larger of the sampled sum (every `interval` s) and this process's own high-water mark plus
    the largest reaped child's (the kernel's counters catch what falls between samples; their sum can only
    overstate). `before`: the same sum at the start; `growth` (peak - before) is what the block added."""

    def __init__(self, interval: float = 0.25):
        self.interval, self.before, self.peak, self.hwm_reset = interval, 0, 0, False
        self._sampled, self._stop, self._thread = 0, threading.Event(), None

    def __enter__(self) -> PeakMemory:
        self.before = self._sample()  # compile workers an earlier package left running are already resident
        try:  # "5": reset this process's VmHWM to its current VmRSS (Linux >= 4.0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.hwm_reset = True
        except OSError:
            self.hwm_reset = False
        self._children_before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        self._sampled = self.before
        self._thread = threading.Thread(target=self._run, daemon=True, name="peak-memory")
        self._thread.start()
        return self

    def _sample(self) -> int:
        return process_rss() + sum(process_rss(p) for p in descendants(os.getpid()))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sampled = max(self._sampled, self._sample())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        own = _status_kib("self", "VmHWM") if self.hwm_reset else process_rss()
        children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        reaped = children if children > self._children_before else 0  # the counter is a maximum, not a sum
        self.peak = max(self._sampled, self._sample(), own + reaped)

    @property
    def growth(self) -> int:
        return max(0, self.peak - self.before)


# -- ending with the app ----------------------------------------------------------------------------------------------

PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int) -> bool:
    """Ask Linux to send `sig` to this process when its parent ends (prctl PR_SET_PDEATHSIG). Returns whether it
    took. The "parent" is the *thread* that started this process: the signal also comes when that thread ends while
    its process lives on (the child moves to another of its threads), once per thread as the process ends."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def watch_parent(parent_pid: int, on_end: Callable[[str], None], interval: float = 0.5,
                 wakeup: int | None = None) -> threading.Thread:
    """A daemon thread, the one place the process ends from: it calls `on_end(reason)` once os.getppid() is no
    longer `parent_pid` (the parent ended and this process was re-parented; checked every `interval` s, and at once
    when the death signal, SIGHUP, arrives), or when SIGTERM arrives. Signals come as bytes on the `wakeup` fd
    (signal.set_wakeup_fd writes them from C as they land, whatever the main thread is doing)."""
    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                return on_end("its app ended")
            if wakeup is None:
                time.sleep(interval)
                continue
            if not select.select([wakeup], [], [], interval)[0]:
                continue
            signals = os.read(wakeup, 512)
            if signal.SIGTERM in signals:
                return on_end("its app ended" if _parent_gone(parent_pid) else "stopped by its app")
            if signal.SIGHUP in signals and _parent_gone(parent_pid):
                return on_end("its app ended")  # (else only the thread that started it ended: the app lives on)
    thread = threading.Thread(target=watch, daemon=True, name="watch-parent")
    thread.start()
    return thread


def _parent_gone(parent_pid: int, wait: float = 0.3) -> bool:
    """Whether the parent process has ended, given the kernel a moment to re-parent this one."""
    deadline = time.monotonic() + wait
    while os.getppid() == parent_pid and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.getppid() != parent_pid


def end_with_parent(parent_pid: int, on_end: Callable[[str], None], interval: float = 0.5) -> None:
    """Make this process end with `parent_pid`, and on SIGTERM: the parent-death signal and a watchdog thread that
    calls `on_end(reason)`, which must not return (it ends the process). Call it first thing, from the main thread.
    A parent that ended before this call is caught at once.

    The death signal is SIGHUP, not SIGTERM: it also comes when the app's thread that started the builder ends, so
    it only means "look at the parent" (SIGTERM means "stop"). Python runs a signal handler on the main thread
    between two of its bytecodes: late while it waits in C (a compile), and re-entrant when a second signal lands
    (the death signal comes once per thread of the ending app). So the handlers do nothing; the C level writes each
    signal to a pipe the watchdog thread reads."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: None)
    signal.set_wakeup_fd(write)
    set_parent_death_signal(signal.SIGHUP)
    watch_parent(parent_pid, on_end, interval, wakeup=read)


def identities(pids: list[int]) -> dict[int, int]:
    """{pid: start time} of the live ones among `pids`: what kill_tree needs to never signal a reused pid."""
    return {p: stat[2] for p in pids if (stat := proc_stat(p)) is not None}


def kill_tree(started: dict[int, int], grace: float = 2.0) -> list[int]:
    """SIGTERM every process of `started` ({pid: start time}) still alive, wait up to `grace` s for them to go, then
    SIGKILL those left (and wait for them to be gone). Returns the pids that needed SIGKILL."""
    for pid, start in started.items():
        if _alive(pid, start):
            _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(p, s) for p, s in started.items()):
        time.sleep(0.05)
    killed = [pid for pid, start in started.items() if _alive(pid, start)]
    for pid in killed:
        _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + 2.0  # SIGKILL cannot be refused, but the kernel takes a moment to end a process
    while time.monotonic() < deadline and any(_alive(p, started[p]) for p in killed):
        time.sleep(0.02)
    return killed


def _alive(pid: int, start: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and stat[2] == start


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# -- the status file --------------------------------------------------------------------------------------------------

def span(seconds: float) -> str:
    """A wait's length for a log line: "45 s", "10 min"."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def write_build_status(path: Path, status: dict) -> None:
    """Write the builder's status JSON whole (a reader never sees half of it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**status, "pid": os.getpid(), "updated_at": time.time()}, indent=1))
    os.replace(tmp, path)


def read_build_status(path: str | Path) -> dict:
    """The builder's last status, as written by engine/cpu/builder.py (its docstring lists the fields); {} when
    there is none yet or it cannot be read."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


class BuildStatus:
    """The builder's state for the app's page, written whole to `path` at every change (and each change printed as
    one line to the builder's log). Fields (read back with read_build_status):

        state     starting | loading | waiting for lock | waiting for memory | compiling | built | skipped |
                  declined | done | failed | stopped  (the last three are final)
        message   one sentence for the page ("declined the target's 1 row plain: needs ~9.1 GiB ...")
        package   the package the state is about ("the target's 1 row plain"), or null
        total     packages the request names
        built     [{package, compile_s, peak_rss_bytes, growth_bytes}]      compiled by this builder
        skipped   [{package, reason}]                                      already on disk (built by another process)
        declined  [{package, reason}]                                      not built: no memory, or the lock not free
        pid, updated_at
    """

    def __init__(self, path: str | Path | None, total: int = 0):
        self.path = Path(path) if path else None
        self.data = {"state": "starting", "message": "", "package": None, "total": total,
                     "built": [], "skipped": [], "declined": []}

    def set(self, state: str, message: str, package: str | None = None) -> None:
        """The new state, written; printed unless it repeats the last one (a wait polls every few seconds)."""
        if (state, message) != (self.data["state"], self.data["message"]):
            print(f"{state}: {message}", flush=True)
        self.data.update(state=state, message=message, package=package)
        self.write()

    def add(self, kind: str, **entry) -> None:
        """Append an entry to `built`, `skipped` or `declined` (written with the next `set`)."""
        self.data[kind].append(entry)

    def write(self) -> None:
        if self.path is not None:
            write_build_status(self.path, self.data)
