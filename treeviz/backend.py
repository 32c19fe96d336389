"""The app's side of the engine: one model pair at a time (loaded in a background thread on CPU), one decoding
loop per request iterated by the request's own handler under the pair's lock, AR baselines cached per prompt.

No tensor math here: the engine is only called. Engine errors become plain messages (`friendly_error`).
"""
from __future__ import annotations

import json
import logging
import threading
import traceback
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from engine.decoder import Decoder, PromptError
from engine.metrics import compare_outputs
from engine.models import PAIRS, ModelLoadError, load_pair
from engine.sampling import Sampling, SamplingError
from engine.strategies import make_strategy
from engine.strategies.base import StrategyError
from engine.trace import RunResult, TraceError
from engine.verify import VerificationError, make_verifier
from treeviz.gpu import on_zero_gpu

log = logging.getLogger("treeviz")

HUB_PRESETS = (
    "EleutherAI/pythia-2.8b + EleutherAI/pythia-70m",
    "Qwen/Qwen2.5-1.5B-Instruct + Qwen/Qwen2.5-0.5B-Instruct",
    "HuggingFaceTB/SmolLM2-1.7B-Instruct + HuggingFaceTB/SmolLM2-135M-Instruct",
)
# On a GPU the DynaTree pair is the natural first choice: its 6-layer draft is cheap even when kernel launches
# dominate a step, and both models fit any Space GPU in bf16.
GPU_PRESET = HUB_PRESETS[0]


class UserError(Exception):
    """A problem to show the user as a plain message."""


# The engine's own "you asked for something impossible" errors: their text is already written for a user.
USER_FACING = (UserError, PromptError, StrategyError, SamplingError, VerificationError, TraceError)


def friendly_error(err: BaseException, context: str = "") -> str:
    """One clear sentence for the user; the traceback goes to the server log only."""
    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return ("Out of memory: lower the node budget (N_max / budget), the tree depth or max new tokens, "
                "or choose a smaller model pair.")
    if isinstance(err, USER_FACING):
        return str(err)
    if isinstance(err, ModelLoadError):
        return f"Could not load the models: {err}"
    if context == "load":
        return f"Could not load the models ({type(err).__name__}): {err}"
    return f"{context + ': ' if context else ''}{type(err).__name__}: {err}"


def pair_choices() -> list[str]:
    return list(PAIRS) + [p for p in HUB_PRESETS if p not in PAIRS]


def split_pair(name: str) -> tuple[str, str]:
    if name in PAIRS:
        return PAIRS[name]
    if " + " in name:
        target, draft = (s.strip() for s in name.split(" + ", 1))
        return target, draft
    return name, name


# -- model pair ------------------------------------------------------------------------------------------------------
class PairManager:
    """Holds at most one loaded pair; loads in a background thread; `run_lock` serialises decoding on it."""

    def __init__(self):
        self.name: str | None = None       # the pair requested last
        self.pair = None                   # loaded ModelPair for self.loaded_name
        self.loaded_name: str | None = None
        self.loading = False
        self.progress = (0.0, "")
        self.error: str | None = None
        self.description = ""
        self._cond = threading.Condition()
        self.run_lock = threading.Lock()   # a Lock (not RLock): a closed generator may release it from any thread
        self._generation = 0
        self._inflight: dict[str, int] = {}  # pair name -> generation of its load still running

    def request(self, name: str, device: str = "auto") -> None:
        """Start loading `name` (no-op if it is loaded or loading). Loads never hold the run lock while loading, so
        a quick pair (tiny-random) can be used while a slow one is still loading."""
        with self._cond:
            if name == self.name and (self.loading or self.pair is not None) and not self.error:
                return
            self.name, self.error, self.loading = name, None, True
            if name in self._inflight:  # a load of this pair is still running: follow it
                self._generation = self._inflight[name]
                return
            self.progress = (0.0, f"loading {name}…")
            self._generation += 1
            gen = self._inflight[name] = self._generation
        threading.Thread(target=self.load, args=(name, gen, device), daemon=True, name=f"load-{name}").start()

    def load(self, name: str, gen: int | None = None, device: str = "auto") -> None:
        """Load `name` in this thread (a background thread from `request`, or at import time on ZeroGPU)."""
        if gen is None:
            with self._cond:
                self.name, self.loading, self.error = name, True, None
                self._generation += 1
                gen = self._inflight[name] = self._generation

        def progress(fraction: float = 0.0, message: str = "") -> None:
            with self._cond:
                if gen == self._generation:
                    self.progress = (max(0.0, min(1.0, float(fraction or 0.0))), str(message or ""))

        try:
            target, draft = split_pair(name)
            with self.run_lock, self._cond:  # one pair in memory at a time: drop the old one once no run uses it
                if gen == self._generation:
                    self.pair, self.loaded_name = None, None
            # On ZeroGPU nothing may run on the GPU outside spaces.GPU: no cost calibration, no warm-up there.
            zero_gpu = on_zero_gpu()
            # draft_quant="auto": the draft's int8 / int4 paths where the table measures them faster (CPU only; on
            # the 2-core machine DynaTree went from 1.47-1.52x to 1.54-1.96x AR with L-bar unchanged, README).
            pair = load_pair(target, draft, device=device, progress=progress, calibrate=not zero_gpu,
                             draft_quant="auto")
            if not zero_gpu:
                progress(1.0, "warming up (so the first measured run is not penalised)…")
                # First calls pay for allocator growth and kernel selection: keep that off the first run's tokens/s.
                Decoder(pair, make_strategy("linear" if pair.draft is not None else "ar")).generate(
                    "def hello():", max_new_tokens=4)
            with self._cond:
                if gen != self._generation:
                    return  # superseded by another pair while loading: let it go
                self.pair, self.loaded_name, self.description = pair, name, pair.describe()
                self.loading, self.progress = False, (1.0, "ready")
                self._cond.notify_all()
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

    def status(self) -> dict[str, Any]:
        with self._cond:
            return {"name": self.name, "loaded": self.loaded_name, "loading": self.loading,
                    "progress": self.progress, "error": self.error, "description": self.description}

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


# -- one run -----------------------------------------------------------------------------------------------------------
@dataclass
class RunSpec:
    """Everything a run needs, as plain picklable data (it crosses ZeroGPU's process boundary)."""
    pair: str
    prompt: Any                        # str or chat messages
    strategy: str
    preset: str = "cpu"
    params: dict[str, Any] = field(default_factory=dict)
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    verifier: str = "auto"

    def prompt_key(self) -> str:
        return json.dumps(self.prompt, sort_keys=True, ensure_ascii=False)


class Cancel:
    """A session's cancel flag, checked by its run between iterations."""

    def __init__(self):
        self.event = threading.Event()
        self.superseded = False  # cancelled because a newer run of the same session started

    def set(self, superseded: bool = False) -> None:
        self.superseded = self.superseded or superseded
        self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set()


# What a run streams to its handler (the handler turns each into component updates).
@dataclass
class Status:
    text: str


@dataclass
class Step:
    run: Any                           # the DecodeRun after one more iteration: .snapshot() is the run so far


@dataclass
class Done:
    """A finished run (None when stopped or superseded). A Run streams it twice: at once with `ar` None, then again
    with AR beside it once AR on the same prompt is measured (at once if it is cached)."""
    result: RunResult | None
    ar: RunResult | None = None


class ARCache:
    """AR results by (pair, prompt, max new tokens, dtype, sampling), the oldest dropped past `size` entries. At
    temperature 0 AR is greedy, so top-p, top-k and the seed do not change it and are left out of the key."""

    def __init__(self, size: int = 64):
        self.size, self.entries = size, OrderedDict()

    @staticmethod
    def key(pair_name: str | None, dtype, spec: RunSpec) -> tuple:
        sampling = ((float(spec.temperature), float(spec.top_p), int(spec.top_k), int(spec.seed))
                    if float(spec.temperature) > 0 else (0.0,))
        return (pair_name, spec.prompt_key(), int(spec.max_new_tokens), str(dtype), *sampling)

    def get(self, key: tuple) -> RunResult | None:
        if key in self.entries:
            self.entries.move_to_end(key)
        return self.entries.get(key)

    def put(self, key: tuple, result: RunResult) -> None:
        self.entries[key] = result
        self.entries.move_to_end(key)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)

    def __contains__(self, key: tuple) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)


class Backend:
    def __init__(self):
        self.pairs = PairManager()
        self.ar_cache = ARCache()
        self._cancels: dict[str, Cancel] = {}
        self._lock = threading.Lock()

    # one run per browser session: starting a new one cancels the old
    def begin(self, session: str) -> Cancel:
        cancel = Cancel()
        with self._lock:
            old = self._cancels.get(session)
            if old is not None:
                old.set(superseded=True)
            self._cancels[session] = cancel
        return cancel

    def cancel_of(self, session: str) -> Cancel:
        with self._lock:
            return self._cancels.setdefault(session, Cancel())

    def stop(self, session: str) -> bool:
        with self._lock:
            cancel = self._cancels.get(session)
        if cancel is not None and not cancel.is_set():
            cancel.set()
            return True
        return False

    def end(self, session: str, cancel: Cancel) -> None:
        with self._lock:
            if self._cancels.get(session) is cancel:
                del self._cancels[session]

    # -- the work --------------------------------------------------------------------------------------------------
    def locked(self, cancel: Cancel) -> Iterator[Status | bool]:
        """Wait for the pair's run lock, yielding one Status while another run holds it; yields True once held
        (the caller releases it) or returns early if cancelled."""
        told = False
        while not self.pairs.run_lock.acquire(timeout=0.2):
            if cancel.is_set():
                return
            if not told:
                told = True
                yield Status("waiting for another run on this model pair to finish…")
        yield True

    @staticmethod
    def _prompt_for(pair, prompt):
        if isinstance(prompt, list) and not getattr(pair.tokenizer, "chat_template", None):
            # a tokenizer without a chat template (e.g. the tiny test pair): plain text instead
            return "\n".join(str(m.get("content", "")) for m in prompt)
        return prompt

    def _run(self, pair, spec: RunSpec, strategy: str, params: dict, preset: str):
        sampling = Sampling(temperature=float(spec.temperature), top_k=int(spec.top_k), top_p=float(spec.top_p),
                            seed=int(spec.seed))
        verifier = make_verifier(spec.verifier) if spec.verifier != "auto" and strategy != "ar" else None
        decoder = Decoder(pair, make_strategy(strategy, preset, **params), verifier=verifier, sampling=sampling)
        return decoder.run(self._prompt_for(pair, spec.prompt), max_new_tokens=int(spec.max_new_tokens))

    def _ar_key(self, pair, spec: RunSpec) -> tuple:
        return ARCache.key(self.pairs.loaded_name, pair.dtype, spec)

    def ar(self, pair, spec: RunSpec, cancel: Cancel) -> Iterator[Status | RunResult]:
        """AR on the same prompt and settings (cached); yields a Status, then the result (nothing if cancelled)."""
        key = self._ar_key(pair, spec)
        cached = self.ar_cache.get(key)
        if cached is None:
            yield Status("measuring plain autoregressive decoding on the same prompt…")
            run = self._run(pair, spec, "ar", {}, "cpu")
            for _ in run:
                if cancel.is_set():
                    return
            cached = run.result
            self.ar_cache.put(key, cached)
        yield cached

    def holding(self, cancel: Cancel, body: Iterator, cancelled: tuple = ()) -> Iterator:
        """`body`'s items, produced while holding the pair's run lock (a Status while waiting for it; `cancelled`'s
        items instead if the run is cancelled first). The lock is released when the body ends or the consumer
        closes this generator (Stop)."""
        held = False
        try:
            for item in self.locked(cancel):
                if item is True:
                    held = True
                else:
                    yield item
            if not held:
                yield from cancelled
                return
            yield from body
        finally:
            if held:
                self.pairs.run_lock.release()

    def decode(self, pair, spec: RunSpec, cancel: Cancel) -> Iterator[Status | Step | Done]:
        """Decode `spec` under the pair's lock: a Step after every iteration, Done as soon as it ends, then Done
        again with AR beside it once AR is measured (or found in the cache)."""
        return self.holding(cancel, self._decode(pair, spec, cancel), cancelled=(Done(None),))

    def _decode(self, pair, spec: RunSpec, cancel: Cancel) -> Iterator[Status | Step | Done]:
        run = self._run(pair, spec, spec.strategy, spec.params, spec.preset)
        for _ in run:
            yield Step(run)
            if cancel.is_set():
                yield Done(None)
                return
        result = run.result
        if spec.strategy == "ar":
            self.ar_cache.put(self._ar_key(pair, spec), result)
        ar = self.ar_cache.get(self._ar_key(pair, spec))
        if ar is None:
            yield Done(result)  # show the run now; AR follows
            for item in self.ar(pair, spec, cancel):
                if isinstance(item, Status):
                    yield item
                else:
                    ar = item
            if ar is None:  # cancelled while measuring AR: the run stays shown, without a baseline
                return
        attach_comparison(result, ar)
        yield Done(result, ar)

    def compare(self, pair, spec: RunSpec, methods: list[str], cancel: Cancel) -> Iterator[Status | Done]:
        """AR and each of `methods` on one prompt; a Done(result, ar) per method, AR first."""
        return self.holding(cancel, self._compare(pair, spec, methods, cancel))

    def _compare(self, pair, spec: RunSpec, methods: list[str], cancel: Cancel) -> Iterator[Status | Done]:
        ar = None
        for item in self.ar(pair, spec, cancel):
            if isinstance(item, Status):
                yield item
            else:
                ar = item
        if ar is None:
            return
        attach_comparison(ar, ar)
        yield Done(ar, ar)
        for name in methods:
            yield Status(f"running {name}…")
            params = spec.params if name == spec.strategy else {}
            run = self._run(pair, spec, name, params, spec.preset if name == spec.strategy else "cpu")
            for _ in run:
                if cancel.is_set():
                    return
            attach_comparison(run.result, ar)
            yield Done(run.result, ar)


def attach_comparison(result: RunResult, ar: RunResult) -> None:
    if result is ar:
        result.comparison = {"exact_match": True, "first_divergence": None,
                             "compared_tokens": len(ar.output_ids), "speedup_vs_ar": 1.0}
    else:
        result.comparison = compare_outputs(result, ar)


BACKEND = Backend()  # one per process: the decorated GPU handlers reach it as a module global, never as an argument
