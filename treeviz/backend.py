"""The app's side of the engine: one model pair at a time (loaded in a background thread), decoding jobs run in
worker threads and streamed through queues, AR results cached per (pair, prompt, max_new_tokens, dtype).

No tensor math here: the engine is imported lazily and only called. Errors come back as plain messages.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger("treeviz")

HUB_PRESETS = (
    "EleutherAI/pythia-2.8b + EleutherAI/pythia-70m",
    "Qwen/Qwen2.5-1.5B-Instruct + Qwen/Qwen2.5-0.5B-Instruct",
    "HuggingFaceTB/SmolLM2-1.7B-Instruct + HuggingFaceTB/SmolLM2-135M-Instruct",
)
LOCAL_PAIRS = ("default", "tiny-random", "tiny-random-identical", "tiny-random-unrelated")

try:  # Hugging Face ZeroGPU: only when the package exists
    import spaces  # type: ignore

    def gpu(fn):
        return spaces.GPU(fn)
except Exception:  # noqa: BLE001 - any import problem means: not on a Space
    spaces = None

    def gpu(fn):
        return fn


class UserError(Exception):
    """A problem to show the user as a plain message."""


def pair_choices() -> list[str]:
    try:
        from engine.models import PAIRS
        local = [name for name in PAIRS]
    except Exception:  # noqa: BLE001 - the app still opens (gallery, uploads) without a model module
        local = list(LOCAL_PAIRS)
    return local + [p for p in HUB_PRESETS if p not in local]


def split_pair(name: str) -> tuple[str, str]:
    try:
        from engine.models import PAIRS
        if name in PAIRS:
            return tuple(PAIRS[name])
    except ImportError:
        pass
    if " + " in name:
        target, draft = (s.strip() for s in name.split(" + ", 1))
        return target, draft
    return name, name


def friendly_error(err: BaseException, context: str = "") -> str:
    """One clear sentence for the user; the traceback goes to the server log only."""
    name = type(err).__name__
    text = str(err) or name
    low = text.lower()
    if name == "OutOfMemoryError" or "out of memory" in low or isinstance(err, MemoryError):
        return ("Out of memory: lower the node budget (N_max / budget), the tree depth or max new tokens, "
                "or choose a smaller model pair.")
    if name in ("PromptError", "StrategyError", "SamplingError", "TraceError", "UserError"):
        return text
    if name == "ModelLoadError":
        return f"Could not load the models: {text}"
    if context == "load":
        return f"Could not load the models ({name}): {text}"
    if isinstance(err, ValueError):
        return text
    return f"{context + ': ' if context else ''}{name}: {text}"


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
        self.loaded_at = 0.0
        self._cond = threading.Condition()
        self.run_lock = threading.Lock()
        self._generation = 0
        self._inflight: dict[str, int] = {}  # pair name -> generation of its load still running

    def request(self, name: str) -> None:
        """Start loading `name` (no-op if it is loaded or loading). Loads run in background threads and never hold
        the run lock while loading, so a quick pair (tiny-random) can be used while a slow one is still loading."""
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
        threading.Thread(target=self._load, args=(name, gen), daemon=True, name=f"load-{name}").start()

    def _load(self, name: str, gen: int) -> None:
        def progress(fraction: float = 0.0, message: str = "") -> None:
            with self._cond:
                if gen == self._generation:
                    self.progress = (max(0.0, min(1.0, float(fraction or 0.0))), str(message or ""))

        try:
            from engine.models import load_pair
            target, draft = split_pair(name)
            # one pair in memory at a time: drop the previous one as soon as no run uses it
            with self.run_lock, self._cond:
                if gen == self._generation:
                    self.pair, self.loaded_name = None, None
            pair = load_pair(target, draft, progress=progress)
            progress(1.0, "warming up (so the first measured run is not penalised)…")
            _warm_up(pair)
            describe = pair.describe() if hasattr(pair, "describe") else name
            with self._cond:
                if gen != self._generation:
                    return  # superseded by another pair while loading: let it go
                self.pair, self.loaded_name, self.description = pair, name, str(describe)
                self.loading, self.progress, self.loaded_at = False, (1.0, "ready"), time.time()
                self._cond.notify_all()
        except BaseException as err:  # noqa: BLE001 - shown in the UI, never a traceback
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

    def wait(self, name: str, cancel: threading.Event, on_wait: Callable[[dict], None] | None = None):
        """The loaded pair `name`, loading it if needed; raises UserError on failure or cancel."""
        self.request(name)
        last = 0.0
        while True:
            with self._cond:
                if self.loaded_name == name and self.pair is not None:
                    return self.pair
                if self.name != name:
                    raise UserError(f"the model pair changed to {self.name} while waiting")
                if self.error and not self.loading:
                    raise UserError(self.error)
                self._cond.wait(timeout=0.2)
            if cancel.is_set():
                raise Cancelled()
            if on_wait and time.time() - last > 0.5:
                last = time.time()
                on_wait(self.status())


class Cancelled(Exception):
    pass


def _warm_up(pair) -> None:
    """A few tokens through target and draft: first calls pay for allocator growth and kernel selection, which
    would otherwise land on the first run's (or AR's) tokens/s."""
    try:
        from engine.decoder import Decoder
        from engine.strategies import make_strategy
        name = "linear" if getattr(pair, "draft", None) is not None else "ar"
        Decoder(pair, make_strategy(name)).generate("def hello():", max_new_tokens=4)
    except Exception:  # noqa: BLE001 - warm-up is best effort
        log.info("warm-up skipped:\n%s", traceback.format_exc())


# -- decoding jobs -----------------------------------------------------------------------------------------------------
def sampling_support() -> bool:
    """Does this engine have engine.sampling.Sampling and a Decoder that takes `sampling=`?"""
    try:
        from engine.decoder import Decoder
        import engine.sampling  # noqa: F401
        return "sampling" in inspect.signature(Decoder.__init__).parameters and hasattr(engine.sampling, "Sampling")
    except Exception:  # noqa: BLE001
        return False


@dataclass
class RunSpec:
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

    @property
    def greedy(self) -> bool:
        return not self.temperature


@dataclass
class Job:
    spec: Any
    cancel: threading.Event = field(default_factory=threading.Event)
    events: "queue.Queue[tuple]" = field(default_factory=queue.Queue)
    thread: threading.Thread | None = None
    superseded: bool = False  # cancelled because a newer job of the same session started


class Backend:
    def __init__(self):
        self.pairs = PairManager()
        self.ar_cache: dict[tuple, Any] = {}
        self._jobs: dict[str, Job] = {}
        self._jobs_lock = threading.Lock()

    # one job per browser session: starting a new one cancels the old
    def start(self, session: str, target: Callable[[Job], None], spec: Any) -> Job:
        job = Job(spec)
        with self._jobs_lock:
            old = self._jobs.get(session)
            if old is not None:
                old.superseded = True
                old.cancel.set()
            self._jobs[session] = job
        job.thread = threading.Thread(target=self._guard, args=(target, job), daemon=True, name=f"job-{session}")
        job.thread.start()
        return job

    def stop(self, session: str) -> bool:
        with self._jobs_lock:
            job = self._jobs.get(session)
        if job is not None and not job.cancel.is_set():
            job.cancel.set()
            return True
        return False

    def finished(self, session: str, job: Job) -> None:
        with self._jobs_lock:
            if self._jobs.get(session) is job:
                del self._jobs[session]

    @staticmethod
    def _guard(target, job: Job) -> None:
        try:
            target(job)
        except Cancelled:
            job.events.put(("cancelled", None))
        except BaseException as err:  # noqa: BLE001
            log.warning("run failed:\n%s", traceback.format_exc())
            job.events.put(("error", friendly_error(err)))

    # -- the work --------------------------------------------------------------------------------------------------
    def _pair(self, job: Job):
        return self.pairs.wait(job.spec.pair if isinstance(job.spec, RunSpec) else job.spec[0].pair, job.cancel,
                               on_wait=lambda st: job.events.put(("loading", st)))

    @contextlib.contextmanager
    def _locked(self, job: Job):
        """Hold the pair's run lock (one run on a pair at a time); give up when the job is cancelled."""
        told = False
        while not self.pairs.run_lock.acquire(timeout=0.2):
            if not told:
                job.events.put(("status", "waiting for another run on this model pair to finish…"))
                told = True
            if job.cancel.is_set():
                raise Cancelled()
        try:
            yield
        finally:
            self.pairs.run_lock.release()

    @staticmethod
    def _prompt_for(pair, prompt):
        if isinstance(prompt, list) and not getattr(pair.tokenizer, "chat_template", None):
            # a tokenizer without a chat template (e.g. the tiny test pair): plain text instead
            return "\n".join(str(m.get("content", "")) for m in prompt)
        return prompt

    def _decoder(self, pair, spec: RunSpec, strategy_name: str, params: dict | None, preset: str):
        from engine.decoder import Decoder
        from engine.strategies import make_strategy
        strategy = make_strategy(strategy_name, preset, **(params or {}))
        kwargs = {}
        if sampling_support():
            from engine.sampling import Sampling
            kwargs["sampling"] = Sampling(temperature=float(spec.temperature), top_k=int(spec.top_k),
                                          top_p=float(spec.top_p), seed=int(spec.seed))
        elif not spec.greedy:
            raise UserError("this engine decodes greedily only: set temperature to 0")
        if spec.verifier and spec.verifier != "auto" and strategy_name != "ar":
            from engine.verify import make_verifier
            kwargs["verifier"] = make_verifier(spec.verifier)
        return Decoder(pair, strategy, **kwargs)

    def _ar_key(self, pair, spec: RunSpec) -> tuple:
        return (self.pairs.loaded_name, spec.prompt_key(), int(spec.max_new_tokens), str(pair.dtype),
                float(spec.temperature), float(spec.top_p), int(spec.top_k), int(spec.seed))

    def _ar(self, pair, spec: RunSpec, job: Job):
        key = self._ar_key(pair, spec)
        if key in self.ar_cache:
            return self.ar_cache[key]
        job.events.put(("status", "measuring plain autoregressive decoding on the same prompt…"))
        run = self._decoder(pair, spec, "ar", {}, "cpu").run(self._prompt_for(pair, spec.prompt),
                                                               max_new_tokens=int(spec.max_new_tokens))
        for _ in run:
            if job.cancel.is_set():
                raise Cancelled()
        self.ar_cache[key] = run.result
        return run.result

    def decode_job(self, job: Job) -> None:
        """Worker: decode spec, stream ("iter", record), then ("done", result, ar_result)."""
        spec: RunSpec = job.spec
        pair = self._pair(job)
        with self._locked(job):
            _decode_locked(self, pair, spec, job)

    def compare_job(self, job: Job) -> None:
        """Worker: AR + each strategy on the same prompt; stream ("method", name, result), then ("done", ...)."""
        spec, methods, params_by_strategy = job.spec
        pair = self._pair(job)
        with self._locked(job):
            ar = self._ar(pair, spec, job)
            job.events.put(("method", "ar", ar))
            for name in methods:
                if name == "ar":
                    continue
                job.events.put(("status", f"running {name}…"))
                run = self._decoder(pair, spec, name, params_by_strategy.get(name, {}), spec.preset).run(
                    self._prompt_for(pair, spec.prompt), max_new_tokens=int(spec.max_new_tokens))
                for _ in run:
                    if job.cancel.is_set():
                        raise Cancelled()
                result = run.result
                _attach_comparison(result, ar)
                job.events.put(("method", name, result))
        job.events.put(("done", None, ar))


def _attach_comparison(result, ar) -> None:
    from engine.metrics import compare_outputs
    if ar is not None and result is not ar:
        result.comparison = compare_outputs(result, ar)
    elif result is ar:
        result.comparison = {"exact_match": True, "first_divergence": None,
                             "compared_tokens": len(ar.output_ids), "speedup_vs_ar": 1.0}


@gpu
def _decode_locked(backend: Backend, pair, spec: RunSpec, job: Job) -> None:
    run = backend._decoder(pair, spec, spec.strategy, spec.params, spec.preset).run(
        backend._prompt_for(pair, spec.prompt), max_new_tokens=int(spec.max_new_tokens))
    records = []
    for record in run:
        records.append(record)
        job.events.put(("iter", record))
        if job.cancel.is_set():
            job.events.put(("cancelled", records))
            return
    result = run.result
    if spec.strategy == "ar":
        backend.ar_cache[backend._ar_key(pair, spec)] = result
        ar = result
    else:
        ar = backend._ar(pair, spec, job)
    _attach_comparison(result, ar)
    job.events.put(("done", result, ar))
