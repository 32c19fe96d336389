"""A model's forward at fixed shapes, compiled ahead of time by AOTInductor and kept on disk: the CPU's captured step.

    seconds = build(model, Recipe(rows=1, path="plain"), file)   # once per machine: torch.export + AOTInductor
    runner = load(file)                                           # every later process: seconds
    logits, hidden = runner(embeds, positions, mask, start, keys, values)

One package is one forward of the model over a preallocated KV cache given as tensors (`keys`, `values`: one
[1, kv_heads, L, head_dim] pair per layer, written in place from `start`), for `rows` query rows (a static count, or
any count in a range with `dynamic=True`); the cache length L is dynamic, so one package serves caches of every
length. The embedding lookup stays outside (a gather; keeping it out keeps the table out of the package). Weights are
frozen into the package and inductor picks its own GEMM per weight shape (`max_autotune`), the way the compiled AR
step does: on a 2-core CPU that is what makes a one-row step faster than oneDNN's packed path
(docs/experiments/2026-11-25-captured-steps.md).

Why AOTInductor rather than torch.compile: a torch.compile graph with frozen, re-packed weights bypasses inductor's
disk cache, so every process would compile again (minutes per graph); a package is compiled once per machine and
loads in seconds. Packages are keyed by the model's identity, the recipe, torch's version and the CPU
(`package_key`) and live under cache_dir()/captured.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from unittest.mock import patch

import torch
from torch import nn
from transformers.cache_utils import Cache, StaticLayer

from engine.core.attention import compiled_attention
from engine.core.kernels import forcing, routed_linears
from engine.core.runtime import cache_dir

FORMAT = 1  # bump when a package's inputs or outputs change meaning
MAX_ROWS = 64  # the largest dynamic row count a package is exported for


class CaptureError(RuntimeError):
    """A captured step cannot be built here (no C++ compiler, a model torch.export cannot trace)."""


@dataclass(frozen=True)
class Recipe:
    """What one package computes: `rows` query rows (exactly, or any count in rows..hi when `hi` is set) with the
    linears on kernel path `path` (engine/core/kernels.py; "packed" is never used inside: inductor packs plain weights
    itself)."""
    rows: int
    path: str = "plain"
    hi: int | None = None  # dynamic row count: rows..hi

    @property
    def dynamic(self) -> bool:
        return self.hi is not None

    def covers(self, n: int) -> bool:
        return self.rows <= n <= (self.hi if self.hi is not None else self.rows)

    def describe(self) -> str:
        span = f"{self.rows}-{self.hi} rows" if self.dynamic else f"{self.rows} row{'s' if self.rows > 1 else ''}"
        return f"{span} {self.path}"


def compiler_missing() -> str | None:
    """None if inductor can build C++ here, else why not."""
    try:
        from torch._inductor import cpp_builder
        cpp_builder.get_cpp_compiler()
    except Exception as err:  # noqa: BLE001 - any failure means no compiler
        return f"no C++ compiler for inductor ({str(err)[:120]})"
    return None


# -- the exported forward ---------------------------------------------------------------------------------------------

class _BoundLayer(StaticLayer):
    """transformers' static cache layer over tensors the caller owns, writing the new rows from `start` on."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, start: torch.Tensor):
        super().__init__(max_cache_len=keys.shape[2])
        self.keys, self.values = keys, values
        self.cumulative_length = start.clone()  # update() advances its own copy; the caller's start stays
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True


def bound_cache(keys: list[torch.Tensor], values: list[torch.Tensor], start: torch.Tensor) -> Cache:
    """A transformers Cache whose layers write into `keys`/`values` (one tensor per layer) from row `start`."""
    return Cache(layers=[_BoundLayer(k, v, start) for k, v in zip(keys, values)])


class Step(nn.Module):
    """The forward a package holds: (logits [rows, V], final-norm hidden states [rows, H]) of `rows` embedded rows
    at `positions` under the additive `mask` [1, 1, rows, L], the cache written in place."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, embeds, positions, mask, start, keys: list[torch.Tensor], values: list[torch.Tensor]):
        out = self.model(inputs_embeds=embeds, position_ids=positions, attention_mask=mask,
                         past_key_values=bound_cache(keys, values, start), use_cache=True, output_hidden_states=True)
        return out.logits[0], out.hidden_states[-1][0]


@contextmanager
def path_only(model, path: str):
    """Every routed linear takes `path`, and the buffers of its other paths are out of sight, so export neither reads
    nor freezes them (a packed oneDNN weight cannot even be copied by strides)."""
    keep = {"plain": (), "packed": ("packed_",), "int8": ("int8_",), "int4": ("int4_",)}[path]
    hidden = []
    for layer in routed_linears(model):
        for name in [b for b in layer._buffers if not b.startswith(keep)] if keep else list(layer._buffers):
            hidden.append((layer, name, layer._buffers.pop(name)))
    try:
        with forcing(model, path):
            yield
    finally:
        for layer, name, buffer in hidden:
            layer._buffers[name] = buffer


def example_inputs(model, rows: int, length: int = 64):
    """Inputs of the right kinds for export: `rows` rows over a zero cache of `length` positions."""
    from transformers import StaticCache
    device, dtype = next(model.parameters()).device, model.dtype
    cache = StaticCache(config=model.config, max_cache_len=length)
    with torch.inference_mode():  # one forward allocates the cache's tensors
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), past_key_values=cache, use_cache=True)
    hidden = model.config.get_text_config().hidden_size
    embeds = torch.zeros(1, rows, hidden, dtype=dtype, device=device)
    positions = torch.arange(rows, device=device)[None]
    mask = torch.zeros(1, 1, rows, length, dtype=dtype, device=device)
    start = torch.zeros((), dtype=torch.long, device=device)
    return (embeds, positions, mask, start, [l.keys for l in cache.layers], [l.values for l in cache.layers])


def export_step(model, recipe: Recipe):
    """torch.export of `Step(model)` for `recipe`: the cache length always dynamic, the row count when asked."""
    args = example_inputs(model, recipe.hi if recipe.dynamic else recipe.rows)  # a boundary value would specialise
    length = torch.export.Dim("length", min=16, max=1 << 17)
    rows = torch.export.Dim("rows", min=recipe.rows, max=recipe.hi) if recipe.dynamic else None
    by_rows = {1: rows} if rows is not None else {}
    shapes = (by_rows, by_rows, {**({2: rows} if rows is not None else {}), 3: length}, {},
              [{2: length}] * len(args[4]), [{2: length}] * len(args[5]))
    with torch.inference_mode(), path_only(model, recipe.path), compiled_attention(model):
        return torch.export.export(Step(model).eval(), args, dynamic_shapes=shapes, strict=False)


# -- packages on disk -------------------------------------------------------------------------------------------------

def package_key(model_identity: str, dtype: torch.dtype, recipe: Recipe, machine: dict) -> dict:
    return {"format": FORMAT, "model": model_identity, "dtype": str(dtype).removeprefix("torch."),
            "recipe": asdict(recipe), **machine}


def package_file(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / "captured" / f"{digest}.pt2"


def build(model, recipe: Recipe, file: Path) -> float:
    """Export and compile `recipe` of `model` into `file` (written whole or not at all); returns the seconds."""
    reason = compiler_missing()
    if reason:
        raise CaptureError(reason)
    start = time.perf_counter()
    program = export_step(model, recipe)
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(f".tmp-{os.getpid()}-{file.name}")
    try:
        with torch.inference_mode():  # the example cache was made there: compiling updates it in place
            torch._inductor.aoti_compile_and_package(
                program, package_path=str(tmp), inductor_configs={"max_autotune": True, "freezing": True})
        os.replace(tmp, file)
    finally:
        tmp.unlink(missing_ok=True)
    return time.perf_counter() - start


def load(file: Path):
    """The package's runner: call it as Step.forward.

    torch unpacks a package into a temporary folder that it removes only when the runner is collected, which never
    happens in a process that exits or is killed with the runner alive: every start of the app would leave 6 GB
    behind. So it unpacks into a folder of our own, removed as soon as the runner is loaded (its library and weights
    stay mapped; the space is returned when the process ends, however it ends)."""
    tempfile.gettempdir()  # fix Python's own temporary folder before TMPDIR points elsewhere for a moment
    with tempfile.TemporaryDirectory(prefix="treeviz-aoti-") as folder, patch.dict(os.environ, {"TMPDIR": folder}):
        runner = torch._inductor.aoti_load_package(str(file))  # the C++ loader unpacks under $TMPDIR
    return lambda *args: runner(*args)


def write_meta(file: Path, key: dict, compile_s: float) -> None:
    file.with_suffix(".json").write_text(json.dumps({"key": key, "compile_s": compile_s,
                                                     "built_at": time.time()}, indent=1))


def read_meta(file: Path) -> dict:
    try:
        return json.loads(file.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return {}
