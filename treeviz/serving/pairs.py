"""The model pair: one serving at a time, loaded in a background thread (on CPU), with the lock that serialises
decoding on it. Pair names are engine.recipe's (`split_pair`); the hub presets are the app's.

A pair that fails to load never costs the one serving: the old pair serves until the new one is ready (both are in
memory meanwhile). On ZeroGPU only the pairs loaded on the main thread at start serve (`pin`): CUDA is emulated for
that thread alone there, so a pair loaded later, on another thread, could not work, and asking for one is refused in
words. The pair serving is one attribute (`held`), so a forked worker reads it without a lock."""
from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass

from engine.cpu.build_guard import process_rss
from engine.cpu.builder import EXIT_DECLINED, build_request, start_builder
from engine.cpu.memory import grown
from engine.cpu.packages import missing, prepare_capture
from engine.models import PAIRS, load_pair
from engine.models.devices import resolve_device, resolve_dtype
from engine.recipe import AR, RunSpec, split_pair, start_run
from engine.runtime import cache_dir
from treeviz.serving.compute_thread import COMPUTE
from treeviz.serving.errors import UserError, friendly_error
from treeviz.serving.gpu import on_zero_gpu

log = logging.getLogger("treeviz")

HUB_PRESETS = (
    "EleutherAI/pythia-2.8b + EleutherAI/pythia-70m",
    "Qwen/Qwen2.5-1.5B-Instruct + Qwen/Qwen2.5-0.5B-Instruct",
    "HuggingFaceTB/SmolLM2-1.7B-Instruct + HuggingFaceTB/SmolLM2-135M-Instruct",
)
# On a GPU the DynaTree pair is the natural first choice: its 6-layer draft is cheap even when kernel launches
# dominate a step, and both models fit any Space GPU in bf16.
GPU_PRESET = HUB_PRESETS[0]


MEMORY_CEILING_GIB = 16.0  # the app and its builder together: a 16 GB laptop or CPU Space runs it
BESIDE_APP_GIB = 4.0  # on a larger machine the ceiling is its memory less this: the system and a browser


def memory_ceiling(total: int | None = None) -> int:
    """Bytes the app and its builder may hold together: TREEVIZ_MEMORY_GIB, else MEMORY_CEILING_GIB, or the memory
    of this machine (or container; `total` overrides) less BESIDE_APP_GIB where that is more. It grows with the
    machine as the weights plan does (engine/cpu/formats.py `weights_ceiling`), so a builder still has room beside
    an app that kept more formats."""
    if "TREEVIZ_MEMORY_GIB" in os.environ:
        return int(float(os.environ["TREEVIZ_MEMORY_GIB"]) * 2**30)
    return grown(int(MEMORY_CEILING_GIB * 2**30), int(BESIDE_APP_GIB * 2**30), total)


EXACT_SUFFIX = " (fp32)"  # "default (fp32)": the pair loaded in float32, the exact mode (docs/rules.md)
PRECISIONS = ("auto", "fp32")  # the page's switch: auto is the engine's dtype for this machine (bf16 where fast)


def split_precision(name: str) -> tuple[str, str]:
    """A served pair name -> (pair name, precision): "default (fp32)" -> ("default", "fp32"); else (name, "auto").
    Why a name: the AR cache, the run lock's pair and every record key on it, so two precisions never mix."""
    name = str(name).strip()
    if name.endswith(EXACT_SUFFIX):
        return name.removesuffix(EXACT_SUFFIX).strip(), "fp32"
    return name, "auto"


def with_precision(name: str, precision: str) -> str:
    """The name `name` serves under at `precision` ("auto" | "fp32"). Where auto already is float32 (a CPU without
    fast bf16) fp32 is the pair's own name: one load, not two of the same weights."""
    base, _ = split_precision(name)
    if precision not in PRECISIONS:
        raise UserError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    if precision == "auto" or auto_dtype_name() == "float32":
        return base
    return base + EXACT_SUFFIX


def auto_dtype_name() -> str:
    """"bfloat16", "float32", ...: the dtype "auto" loads pairs in on this machine (engine/models/devices.py)."""
    return str(resolve_dtype("auto", resolve_device("auto"))).removeprefix("torch.")


def pair_choices(manager: "PairManager | None" = None) -> list[str]:
    """The pairs the page offers: on ZeroGPU (`manager` pinned) only those loaded at start; else every known pair."""
    if manager is not None and manager.pinned is not None:
        return list(manager.pinned)
    return list(PAIRS) + [p for p in HUB_PRESETS if p not in PAIRS]


def warm_up(name: str, pair) -> None:
    """First calls pay for allocator growth and kernel selection: keep that off the first run's tokens/s."""
    spec = RunSpec(pair=name, prompt="def hello():", strategy="linear" if pair.draft is not None else AR,
                   max_new_tokens=4)
    for _ in start_run(pair, spec):
        pass


@dataclass(frozen=True)
class PairStatus:
    """A PairManager's state at one moment, read under its lock: the page's model line and the run's wait read it."""
    name: str | None                     # the pair requested last
    loaded: str | None                   # the pair loaded now
    loading: bool
    progress: tuple[float, str]          # (fraction, message) of the load under way
    error: str | None
    description: str                     # the loaded pair in words ("": none)
    capture: str                         # what the captured steps are doing ("": nothing)


@dataclass(frozen=True)
class Serving:
    """The pair serving now and its name, replaced whole (one attribute write: a fork sees all of it or none)."""
    name: str
    pair: object


def zero_gpu_capture(device: str) -> str:
    """On ZeroGPU: graphs for a pair placed on `cuda` (captured in each worker), nothing for one kept on the CPU."""
    return "on" if str(device).startswith("cuda") else "off"


class PairManager:
    """Holds the pair serving (`held`); loads in a background thread; `run_lock` serialises decoding on it."""

    def __init__(self, capture: str | None = None):
        # captured steps (engine/cpu/packages.py): auto | on | off; TREEVIZ_CAPTURE or app.py --capture sets it
        self.capture_mode = capture or os.environ.get("TREEVIZ_CAPTURE", "auto")
        self.name: str | None = None       # the pair requested last
        self.serving: Serving | None = None
        self.pinned: tuple[str, ...] | None = None  # on ZeroGPU: the pairs loaded at start, the only ones served
        self.loading = False
        self.progress = (0.0, "")
        self.error: str | None = None
        self.description = ""
        self.capture = ""                  # what the captured steps are doing (building, loading, ready), for the page
        self._cond = threading.Condition()
        self.run_lock = threading.Lock()   # a Lock (not RLock): a closed generator may release it from any thread
        self._generation = 0
        self._inflight: dict[str, int] = {}  # pair name -> generation of its load still running
        self.builder = None                # the process compiling captured steps, while one runs (build_captured)

    @property
    def pair(self):
        """The ModelPair serving now (None: none)."""
        serving = self.serving
        return None if serving is None else serving.pair

    @property
    def loaded_name(self) -> str | None:
        serving = self.serving
        return None if serving is None else serving.name

    @loaded_name.setter
    def loaded_name(self, name: str) -> None:
        """Serve the loaded pair under another name (tests, tools)."""
        self.serving = Serving(name, self.pair)

    def held(self, name: str):
        """The pair serving as `name`, or None; reads one attribute, no lock (safe in a forked worker)."""
        serving = self.serving
        return serving.pair if serving is not None and serving.name == name else None

    def pin(self) -> None:
        """Serve only the pair loaded now (ZeroGPU, after loading at start on the main thread): others are refused."""
        with self._cond:
            self.pinned = (self.loaded_name,) if self.loaded_name is not None else ()

    def request(self, name: str, device: str = "auto") -> None:
        """Start loading `name` (no-op if it is loaded or loading; going back to the pair serving lets a load of
        another go). UserError, in words, for a pair not pinned (ZeroGPU). Loads never hold the run lock, so a
        quick pair (tiny-random) can be used while a slow one is still loading."""
        with self._cond:
            self._refuse_unpinned(name)
            if self.loaded_name == name:
                if self.name != name or self.loading:  # back to the pair serving: the other load's result is let go
                    self.name, self.loading, self.error, self.progress = name, False, None, (1.0, "ready")
                    self._generation += 1
                    self._cond.notify_all()
                return
            if name == self.name and self.loading and not self.error:
                return
            self.name, self.error, self.loading = name, None, True
            if name in self._inflight:  # a load of this pair is still running: follow it
                self._generation = self._inflight[name]
                return
            self.progress = (0.0, f"loading {name}…")
            self._generation += 1
            gen = self._inflight[name] = self._generation
        threading.Thread(target=self.load, args=(name, gen, device), daemon=True, name=f"load-{name}").start()

    def _refuse_unpinned(self, name: str) -> None:
        if self.pinned is not None and name not in self.pinned:
            if not self.pinned:
                raise UserError(f"this Space could not load its model pair at start ({self.error}), and on ZeroGPU "
                                f"no pair can be loaded while it runs")
            served = ", ".join(self.pinned)
            raise UserError(f"this Space serves only the model pair it loaded at start ({served}): on ZeroGPU a pair "
                            f"cannot be loaded while it runs. Choose {served}, or run the app locally for {name}.")

    def load(self, name: str, gen: int | None = None, device: str = "auto") -> None:
        """Load `name` in this thread (a background thread from `request`, or at import time on ZeroGPU). On failure
        the pair serving before serves on, and `error` says why the new one did not load."""
        if gen is None:
            with self._cond:
                self.name, self.loading, self.error = name, True, None
                self._generation += 1
                gen = self._inflight[name] = self._generation
        try:
            self._load(name, gen, device)
        except Exception as err:  # noqa: BLE001 - any failure is shown in the UI, never as a traceback
            log.warning("loading %s failed:\n%s", name, traceback.format_exc())
            with self._cond:
                if gen == self._generation:
                    self.loading, self.error = False, friendly_error(err, "load")
                    self._cond.notify_all()
        finally:
            with self._cond:
                if self._inflight.get(name) == gen:
                    del self._inflight[name]

    def _load(self, name: str, gen: int, device: str) -> None:
        def progress(fraction: float = 0.0, message: str = "") -> None:
            with self._cond:
                if gen == self._generation:
                    self.progress = (max(0.0, min(1.0, float(fraction or 0.0))), str(message or ""))

        base, precision = split_precision(name)
        target, draft = split_pair(base)
        # On ZeroGPU nothing may run on the GPU outside spaces.GPU: no cost calibration and no warm-up here; CUDA graphs
        # are captured inside each worker at its run's first forwards (0.1-0.2 s per model on an H200, where a graphed
        # one-row step is 5-10x cheaper than an eager one: docs/experiments/gpu-2026-11-27/), so they pay every request.
        zero_gpu = on_zero_gpu()
        # Every choice below is this machine's, measured (engine/cpu/formats.py, costs.py): draft_quant="auto"
        # offers the draft's quantised formats, kept where the probe finds them faster; draft_vocab="auto" trims the
        # draft's head to its frequent tokens where a frequency table exists (engine/models/vocab.py).
        # capture="auto": on a CPU, each model's forwards compiled ahead of time (engine/cpu/packages.py), once per
        # machine; until they exist, runs decode eagerly and the packages are built in another process.
        pair = load_pair(target, draft, dtype=precision, device=device, progress=progress, calibrate=not zero_gpu,
                         draft_quant="auto", draft_vocab="auto", capture=zero_gpu_capture(device) if zero_gpu else self.capture_mode)
        todo = missing(pair)
        if pair.capture == "aoti" and not todo:  # built on an earlier start: load them now, before any run
            progress(1.0, "loading the captured steps (compiled on an earlier start)…")
            prepare_capture(pair, progress, build_missing=False)
            log.info("captured steps serving: %s", pair.describe_capture())
        if not zero_gpu:
            progress(1.0, "warming up (so the first measured run is not penalised)…")
            warm_up(name, pair)
        with self._cond:
            if gen != self._generation:
                return  # superseded by another pair while loading: let it go
            self.serving, self.description, self.capture = Serving(name, pair), pair.describe(), ""
            self.loading, self.progress = False, (1.0, "ready")  # the old pair goes once no run holds it
            self._cond.notify_all()
        if todo:
            threading.Thread(target=self.build_captured, args=(name, gen, pair, target, draft, todo), daemon=True,
                             name=f"capture-{name}").start()

    def build_captured(self, name: str, gen: int, pair, target: str, draft: str | None, todo: dict) -> None:
        """Compile the pair's missing captured steps in another process (so this one keeps serving eager runs on its
        compute thread; engine/cpu/builder.py: one build at a time, within the memory left, ending with this
        process), paused while a run holds the run lock (on 2 cores it took ~6 s from a warm start's first tree, and
        it would skew what a run measures: docs/experiments/2026-11-28-first-start-float32.md), showing its state on
        the page; then load and measure them on the compute thread between runs (the
        pair's run lock held: a measurement needs a quiet machine). A failure or a declined package leaves those
        rows eager, with the reason on the page; nothing is ever compiled in this process."""
        count = sum(len(r) for r in todo.values())
        starting = f"compiling {count} captured step(s) in the background (once per machine, a few minutes)"
        self._set_capture(gen, f"{starting}; runs decode eagerly until then")
        log_path = cache_dir() / "captured" / f"build-{os.getpid()}.log"
        try:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "w") as log_file:
                budget = max(memory_ceiling() - process_rss(), 0)  # the plan: app + builder within the ceiling
                builder = self.builder = start_builder(build_request(pair, target, draft, todo, draft_vocab="auto",
                                                                     budget_bytes=budget), log_file)
                atexit.register(builder.stop)
                try:
                    while builder.poll() is None:
                        builder.pause(self.run_lock.locked())  # a run decoding has the cores to itself
                        message = builder.status().get("message") or starting  # the builder's own words: what
                        paused = " (paused while a run decodes)" if builder.paused else ""  # it compiles, or waits for
                        self._set_capture(gen, f"{message}{paused}; runs decode eagerly until then")
                        if gen != self._generation:
                            builder.stop()  # another pair was asked for: its packages can wait
                        time.sleep(0.1)
                finally:
                    atexit.unregister(builder.stop)
            code, status = builder.wait(), builder.status()
            if code not in (0, EXIT_DECLINED):
                raise RuntimeError(f"the builder exited with {code} ({status.get('message', '')}); its log: "
                                   f"{log_path}")
            with self.run_lock:
                if gen != self._generation:
                    return
                self._set_capture(gen, "loading and measuring the captured steps…")
                COMPUTE.call(prepare_capture, pair, None, False, True, False)
            declined = "; ".join(f"{d['package']}: {d['reason']}" for d in status.get("declined", []))
            log.info("captured steps serving: %s%s", pair.describe_capture(), f" (declined: {declined})" if declined
                     else "")
            with self._cond:
                if gen == self._generation:
                    self.description, self.capture = pair.describe(), (f"some captured steps were not built: "
                                                                       f"{declined}" if declined else "")
        except Exception as err:  # noqa: BLE001 - the pair stays usable, eagerly
            log.warning("captured steps unavailable for %s:\n%s", name, traceback.format_exc())
            self._set_capture(gen, f"captured steps unavailable, runs stay eager ({friendly_error(err, 'load')})")

    def _set_capture(self, gen: int, text: str) -> None:
        with self._cond:
            if gen == self._generation:
                self.capture = text

    def status(self) -> PairStatus:
        with self._cond:
            return PairStatus(name=self.name, loaded=self.loaded_name, loading=self.loading,
                              progress=self.progress, error=self.error, description=self.description,
                              capture=self.capture)

    def ready(self, name: str, timeout: float = 0.25):
        """The loaded pair `name`, or None if it is still loading after `timeout` s; UserError if it failed."""
        with self._cond:
            if not (self.loaded_name == name and self.pair is not None):
                self._cond.wait(timeout=timeout)
            if self.loaded_name == name and self.pair is not None:
                return self.pair
            if self.name != name:
                raise UserError(f"the model pair changed to {self.name} while waiting")
            if self.error and not self.loading:
                raise UserError(self.error)
            return None
