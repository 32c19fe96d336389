"""The builder process: rebuilds a pair from its specs and compiles the captured steps it still lacks.

    builder = start_builder(build_request(pair, target, draft, missing(pair)), log_file)   # the app, on a fresh cache
    builder.status()          # {"state": "compiling", "message": ...}: engine/cpu/build_guard.py BuildStatus
    builder.wait()            # 0: every package built or on disk; 3: some declined (status says why); 1: failed
    builder.stop()            # the app ends it (atexit): the builder, its compilers and its half-written package
    python -m engine build REQUEST.json        # what start_builder runs: the command line loads the pair, `run` builds

Compiling runs its own kernels and threads for minutes. It runs in its own process at the lowest CPU priority
(`NICENESS`), so it takes only the CPU time the serving process leaves: on 2 cores a builder at normal priority took
half the machine from the app's first tree (docs/experiments/2026-11-28-first-start-float32.md). The serving process
decodes eagerly meanwhile and loads the packages when the builder exits.

It lives within limits (engine/cpu/build_guard.py), per package: it takes the captured folder's build lock (one
compile at a time across processes; a package another builder finished meanwhile is skipped), estimates what the
compile will add to its memory (measured on earlier packages of the same model, else a default: build_guard.py)
and waits until that fits in MemAvailable (less a headroom, and within the app's budget if it gave one), or declines
the package with a message. It records each compile's measured peak in the package's meta JSON, writes its state to
a status file the app shows, and ends with the app that started it (parent-death signal and a watchdog thread).

Request fields besides the pair and the recipes, all optional (LIMITS has the defaults): parent_pid (ends with it),
status_file, lock_wait_s, memory_wait_s, memory_poll_s, headroom_bytes, budget_bytes (the most the builder may hold,
compiling included).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.cpu.aoti import Recipe, build, package_file, read_meta, write_meta
from engine.cpu.build_guard import (GiB, BuildStatus, PeakMemory, build_lock, compile_peak_estimate, descendants,
                                    earlier_peaks, end_with_parent, identities, kill_tree, package_weight_bytes,
                                    read_build_status, span, wait_for_memory)
from engine.cpu.kernels import standin_tensors
from engine.cpu.packages import recipe_key
from engine.runtime import cache_dir, fused_projections

REPOSITORY = Path(__file__).resolve().parents[2]  # the folder `python -m engine...` runs from
LIMITS = {"lock_wait_s": 1800.0,     # another builder's compile (minutes for a 1.5B fp32 target on 2 cores)
          "memory_wait_s": 600.0,    # for memory to be freed (a run ending, a browser tab closing) before declining
          "memory_poll_s": 5.0,
          "headroom_bytes": 1 << 30,  # left free for the app and the rest of the machine during a compile
          "budget_bytes": None}      # the most this process may hold, compiles included (the app's plan less the app)
NICENESS = 19  # the builder and everything it starts run only when the serving process leaves a core idle
EXIT_DECLINED = 3  # finished cleanly, but some packages were declined: the caller must not compile them itself
EXIT_STOPPED = 143


def build_request(pair, target: str, draft: str | None, recipes: dict[str, list[Recipe]], **load) -> dict:
    """What a builder process needs to rebuild the same models (specs and the load options that change their
    weights or names: whether the draft's projections are fused is read off the pair) and the recipes to compile.
    Extra keywords land in the request as they are (the load options draft_vocab / draft_quant, and any of
    LIMITS)."""
    fused = bool(fused_projections(pair.draft))
    return {"target": target, "draft": draft, "dtype": str(pair.dtype).removeprefix("torch."),
            "device": str(pair.device), "fuse_draft": fused, **load,
            "recipes": {role: [asdict(r) for r in rs] for role, rs in recipes.items()}}


@dataclass
class Builder:
    """A started builder process: wait() and poll() as a Popen's, status() its status file, stop() to end it."""
    process: subprocess.Popen
    status_file: Path
    paused: bool = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait(self, timeout: float | None = None) -> int:
        return self.process.wait(timeout)

    def poll(self) -> int | None:
        return self.process.poll()

    def status(self) -> dict:
        return read_build_status(self.status_file)

    def pause(self, paused: bool) -> None:
        """Stop (SIGSTOP) or continue (SIGCONT) the builder and the processes it started, its own process group: the
        app pauses it while a run decodes, so a compile takes no core or memory bandwidth from a run it measures.
        Its memory stays held. A no-op once it has ended, or when already in that state."""
        if paused == self.paused or self.process.poll() is not None:
            return
        try:
            os.killpg(self.pid, signal.SIGSTOP if paused else signal.SIGCONT)
            self.paused = paused
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, grace: float = 10.0) -> int:
        """End the builder and every process it started; returns its exit code. SIGTERM first (it ends its compilers,
        removes its half-written package and writes the state "stopped"), then after `grace` s SIGKILL to its
        process group and to any descendant left. Idempotent, quick when it has already ended: register it with
        atexit where the builder is started. A paused builder is continued first: a stopped process cannot act on
        SIGTERM."""
        if self.process.poll() is not None:
            return self.process.returncode
        started = identities(descendants(self.pid))  # after it dies its children are no longer found under it
        self.pause(False)
        self.process.terminate()
        try:
            return self.process.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.pid, signal.SIGKILL)  # its own session and group (start_builder): all it started
        except (ProcessLookupError, PermissionError):
            pass
        kill_tree(started, grace=0.0)
        return self.process.wait()


def start_builder(request: dict, log_file, status_file: str | Path | None = None) -> Builder:
    """`python -m engine build REQUEST` in its own process and session (module docstring): its output goes
    to `log_file`, its status to `status_file` (default: beside the log, NAME.status.json). The request gets this
    process's pid, so the builder ends with it."""
    folder = cache_dir() / "captured"
    folder.mkdir(parents=True, exist_ok=True)
    if status_file is None:
        name = getattr(log_file, "name", None)
        status_file = (Path(name).with_suffix(".status.json") if isinstance(name, str)
                       else folder / f"build-{os.getpid()}.status.json")
    status_file = Path(status_file)
    file = folder / f".request-{os.getpid()}-{time.time_ns()}.json"
    file.write_text(json.dumps({**request, "parent_pid": os.getpid(), "status_file": str(status_file)}))
    process = subprocess.Popen([sys.executable, "-m", "engine", "build", str(file)], stdout=log_file,
                               stderr=subprocess.STDOUT, cwd=str(REPOSITORY), start_new_session=True)
    lowest_priority(process.pid)
    return Builder(process, status_file)


def lowest_priority(pid: int) -> None:
    """Give process `pid` the niceness NICENESS. Called as soon as Popen returns, while the new interpreter has one
    thread: the threads and processes it starts later inherit it (Linux keeps a niceness per thread). The builder
    leads its own session, and where the kernel groups each session's processes for scheduling (autogroup), a
    niceness counts only within the group: so the group gets it too (/proc/PID/autogroup)."""
    if not hasattr(os, "setpriority"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, pid, NICENESS)
        autogroup = Path(f"/proc/{pid}/autogroup")
        if autogroup.exists():
            autogroup.write_text(str(NICENESS))
    except OSError:  # gone already, not ours, or no autogroup to set
        pass


def run(request_file: Path, load_request_pair: Callable[[dict], object]) -> int:
    """Build the packages a request file names (see build_request) on the pair `load_request_pair` loads from it
    (engine/cli.py: as the app loads it, then stripped of the weights no build reads: `aoti.release_weights`); one
    status line per change in the log. The loading is the caller's, so this room never imports the models."""
    request = json.loads(request_file.read_text())
    if request_file.name.startswith(".request-"):
        request_file.unlink(missing_ok=True)  # start_builder's: one per start, read once
    limits = {**LIMITS, **{k: request[k] for k in LIMITS if request.get(k) is not None}}
    folder = cache_dir() / "captured"
    status = BuildStatus(request.get("status_file"), total=sum(len(r) for r in request["recipes"].values()))
    if request.get("parent_pid"):
        end_with_parent(int(request["parent_pid"]), lambda reason: stop_now(status, folder, reason))
    try:
        status.set("loading", "loading the models to compile")
        pair = load_request_pair(request)
        for role, recipes in request["recipes"].items():
            model = pair.target if role == "target" else pair.draft
            name = pair.target_name if role == "target" else pair.draft_name
            for fields in recipes:
                build_one(model, name, role, recipe_from(fields), folder, limits, status)
    except Exception as err:
        state, package = status.data["state"], status.data["package"]
        status.set("failed", f"failed while {state}{' ' + package if package else ''}: {type(err).__name__}: "
                             f"{str(err)[:200]}", package)
        raise
    built, skipped, declined = (status.data[k] for k in ("built", "skipped", "declined"))
    reasons = "".join(f"; {d['package']}: {d['reason']}" for d in declined)
    status.set("done", f"built {len(built)}, already on disk {len(skipped)}, declined {len(declined)}{reasons}")
    return EXIT_DECLINED if declined else 0


def recipe_from(fields: dict) -> Recipe:
    """A Recipe from its JSON (asdict) form: JSON turned its tuples into lists."""
    if "groups" in fields:
        fields = {**fields, "groups": tuple(tuple(group) for group in fields["groups"])}
    return Recipe(**fields)


def build_one(model, name: str, role: str, recipe: Recipe, folder: Path, limits: dict, status: BuildStatus) -> None:
    """Compile one package unless it is on disk: under the build lock, once its estimated compile growth fits."""
    what = f"the {role}'s {recipe.describe()}"
    key = recipe_key(model, name, recipe)
    file = package_file(key)
    if file.is_file():
        status.add("skipped", package=what, reason="already on disk")
        return

    def lock_wait(holder: str) -> None:
        status.set("waiting for lock", f"waiting for another build to finish ({holder}) before compiling {what} "
                                       f"(up to {span(limits['lock_wait_s'])})", what)

    def memory_wait(need: int, room: int) -> None:
        status.set("waiting for memory", f"waiting for memory to compile {what}: it needs ~{need / GiB:.1f} GiB, "
                                         f"{room / GiB:.1f} GiB is free for it (up to {span(limits['memory_wait_s'])})",
                   what)

    with build_lock(folder, limits["lock_wait_s"], holder=f"compiling {what}", on_wait=lock_wait) as held:
        if not held:
            return decline(status, what, f"another build held the lock for {span(limits['lock_wait_s'])}")
        if file.is_file():
            status.add("skipped", package=what, reason="built by another process while this one waited")
            status.set("skipped", f"{what} was built by another process meanwhile: skipped", what)
            return
        weights = package_weight_bytes(model)
        layers = getattr(model.config.get_text_config(), "num_hidden_layers", 0) or 0
        need = compile_peak_estimate(weights, earlier_peaks(folder, key), layers)
        fits, room = wait_for_memory(need, headroom=limits["headroom_bytes"], budget=limits["budget_bytes"],
                                     timeout=limits["memory_wait_s"], poll=limits["memory_poll_s"],
                                     on_wait=memory_wait)
        if not fits:
            return decline(status, what, f"compiling it needs ~{need / GiB:.1f} GiB and at most {room / GiB:.1f} GiB "
                                         f"was free for it in {span(limits['memory_wait_s'])}; its rows stay eager")
        free = "" if room is None else f", {room / GiB:.1f} GiB free for it"
        status.set("compiling", f"compiling {what} (needs ~{need / GiB:.1f} GiB{free})", what)
        with PeakMemory() as peak:
            seconds = build(model, recipe, file, standin_tensors(model, recipe.formats()))
        write_meta(file, key, seconds)
        memory = {"peak_rss_bytes": peak.peak, "rss_before_bytes": peak.before, "compile_growth_bytes": peak.growth,
                  "weight_bytes": weights, "estimate_bytes": need}
        file.with_suffix(".json").write_text(json.dumps({**read_meta(file), **memory}, indent=1))
    status.add("built", package=what, compile_s=round(seconds, 1), peak_rss_bytes=peak.peak,
               growth_bytes=peak.growth)
    status.set("built", f"built {what} in {seconds:.0f} s (peak {peak.peak / GiB:.2f} GiB; compiling added "
                        f"{peak.growth / GiB:.2f} GiB, estimated {need / GiB:.2f})", what)


def decline(status: BuildStatus, what: str, reason: str) -> None:
    status.add("declined", package=what, reason=reason)
    status.set("declined", f"declined {what}: {reason}", what)


def stop_now(status: BuildStatus, folder: Path, reason: str) -> None:
    """End this builder at once (its app ended, or stopped it): its compilers, its half-written package (aoti.build
    writes .tmp-PID-NAME), the status "stopped", exit 143. Called once, from end_with_parent's watchdog thread."""
    kill_tree(identities(descendants(os.getpid())), grace=1.0)
    for tmp in folder.glob(f".tmp-{os.getpid()}-*"):
        tmp.unlink(missing_ok=True)
    status.data.update(state="stopped", message=f"the builder stopped: {reason}")
    try:
        status.write()
        os.write(1, f"stopped: {reason}\n".encode())  # not print: the main thread may be inside a print
    finally:
        os._exit(EXIT_STOPPED)

