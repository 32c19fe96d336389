"""A model's forward at fixed shapes, compiled ahead of time by AOTInductor and kept on disk: the CPU's captured step.

    recipe = Recipe(rows=1, path="plain")                       # every linear on its plain weight; `groups` overrides
    seconds = build(model, recipe, file, standin_tensors(model, recipe.formats()))   # once per machine
    runner = load(file, format_tensors(model, recipe.formats()))                     # every later process
    logits, hidden = runner(embeds, positions, mask, start, keys, values)

One package is one forward of the model over a preallocated KV cache given as tensors (`keys`, `values`: one
[1, kv_heads, L, head_dim] pair per layer, written in place from `start`), for `rows` query rows (a static count, or
any count in a range with `dynamic=True`); the cache length L is dynamic, so one package serves caches of every
length. The embedding lookup stays outside (a gather; keeping it out keeps the table out of the package).

The linear weights are the package's inputs, not its constants: every linear calls its format's kernel through the
opaque `treeviz::linear` (engine/cpu/kernels.py), handed the model's own tensors on every call. So a package holds
no copy of the weights -- all packages of a model share the one resident copy, and a package per row-count range
costs disk and seconds, not gigabytes -- and it is traced with one-element stand-ins, so building one needs neither
the weights' formats nor their memory. The compiler fuses what lies between the GEMMs (norms, rotary,
activations; attention is torch's fused CPU kernel over folded query heads), and a step pays no Python per layer.

Why AOTInductor rather than torch.compile: a package is compiled once per machine and loads in seconds in every
later process. Packages are keyed by the model's identity, the recipe, torch's version and the CPU (`package_key`)
and live under cache_dir()/captured.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from transformers.cache_utils import Cache, StaticLayer

from engine.core.attention import folded_attention
from engine.cpu.kernels import bound_tensors, opaque_linears, page_out, routed_linears
from engine.runtime import cache_dir, load_package, model_device

FORMAT = 6  # bump when a package's inputs, outputs or kernels change (4: weights are inputs; 5: plain opaque too;
# 6: attention folded, engine/core/attention.py folded_attention)
MAX_ROWS = 64  # the largest dynamic row count a package is exported for


class CaptureError(RuntimeError):
    """A captured step cannot be built here (no C++ compiler, a model torch.export cannot trace)."""


@dataclass(frozen=True)
class Recipe:
    """What one package computes: `rows` query rows (exactly, or any count in rows..hi when `hi` is set) with every
    linear on weight format `path` (engine/cpu/kernels.py) but those of the shape groups in `groups`, which take
    the format paired with them (the routing of a model whose groups differ: an LM head that stays plain)."""
    rows: int
    path: str = "plain"
    hi: int | None = None  # dynamic row count: rows..hi
    groups: tuple[tuple[str, str], ...] = ()

    @property
    def dynamic(self) -> bool:
        return self.hi is not None

    def covers(self, n: int) -> bool:
        return self.rows <= n <= (self.hi if self.hi is not None else self.rows)

    def formats(self) -> dict[str, str]:
        """{group: format} with "*" for every other group (kernels.assigned)."""
        return {"*": self.path, **dict(self.groups)}

    def describe(self) -> str:
        span = f"{self.rows}-{self.hi} rows" if self.dynamic else f"{self.rows} row{'s' if self.rows > 1 else ''}"
        others = ", ".join(f"{g.rsplit('.', 1)[-1]} {p}" for g, p in self.groups)
        return f"{span} {self.path}" + (f" ({others})" if others else "")


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
    at `positions` under the additive `mask` [1, 1, rows, L], the cache written in place, every linear on the format
    `formats` gives its group, reading its tensors from `weights` (kernels.format_tensors's order)."""

    def __init__(self, model, formats: dict[str, str]):
        super().__init__()
        self.model, self.formats = model, formats

    def forward(self, embeds, positions, mask, start, keys: list[torch.Tensor], values: list[torch.Tensor],
                weights: list[torch.Tensor]):
        with bound_tensors(self.model, self.formats, weights):
            out = self.model(inputs_embeds=embeds, position_ids=positions, attention_mask=mask,
                             past_key_values=bound_cache(keys, values, start), use_cache=True,
                             output_hidden_states=True)
        return out.logits[0], out.hidden_states[-1][0]


@contextmanager
def weights_out_of_sight(model):
    """Inside the block the linears' own weights (plain Parameters and every format's buffers) and the input
    embedding are swapped for empty stand-ins: the package reads its weights from its inputs and takes no
    embedding, so export must neither lift nor freeze them (they would be copied into the package, and a packed
    oneDNN or MKL tensor cannot even be copied by strides)."""
    empty = nn.Parameter(torch.empty(0, dtype=model.dtype), requires_grad=False)
    saved = []
    for layer in routed_linears(model):
        saved.append((layer._parameters, "weight", layer._parameters["weight"]))
        layer._parameters["weight"] = empty
        for name in list(layer._buffers):
            saved.append((layer._buffers, name, layer._buffers.pop(name)))
    embedding = model.get_input_embeddings()
    embedding = getattr(embedding, "embedding", embedding)  # a wrapped embedding (engine/models/widths.py)
    saved.append((embedding._parameters, "weight", embedding._parameters["weight"]))
    embedding._parameters["weight"] = empty
    try:
        yield
    finally:
        for slots, name, value in reversed(saved):
            slots[name] = value


def example_inputs(model, rows: int, length: int = 64):
    """Inputs of the right kinds for export: `rows` rows over a zero cache of `length` positions, one key and one
    value tensor per layer shaped as transformers' static cache shapes them (made here, so no forward runs: the
    weights may be gone, `release_weights`)."""
    device, dtype = model_device(model), model.dtype
    config = model.config.get_text_config()
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache = [torch.zeros(1, heads, length, head_dim, dtype=dtype, device=device)
             for _ in range(config.num_hidden_layers)]
    embeds = torch.zeros(1, rows, config.hidden_size, dtype=dtype, device=device)
    positions = torch.arange(rows, device=device)[None]
    mask = torch.zeros(1, 1, rows, length, dtype=dtype, device=device)
    start = torch.zeros((), dtype=torch.long, device=device)
    return (embeds, positions, mask, start, cache, [t.clone() for t in cache])


def release_weights(model) -> None:
    """Free every linear's plain weight and the input embedding (shapeless stand-ins on `meta` keep their shapes):
    a package is traced with stand-ins and takes no embedding, so a process that only builds packages needs neither
    (the fp32 default pair's 8 GB)."""
    for layer in routed_linears(model):
        layer._parameters["weight"] = _meta_like(layer._parameters["weight"])
    embedding = model.get_input_embeddings()
    embedding = getattr(embedding, "embedding", embedding)  # a wrapped embedding (engine/models/widths.py)
    embedding._parameters["weight"] = _meta_like(embedding._parameters["weight"])


def _meta_like(param: torch.Tensor) -> nn.Parameter:
    page_out(param)  # a checkpoint's mapped pages stay resident after the tensor is gone (kernels.page_out)
    return nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=False)



def export_step(model, recipe: Recipe, weights: list[torch.Tensor]):
    """torch.export of `Step(model, recipe.formats())` for `recipe`, traced with `weights` (stand-ins are enough:
    kernels.standin_tensors): the cache length always dynamic, the row count when asked."""
    rows_hint = recipe.hi if recipe.dynamic else recipe.rows  # a boundary value would specialise
    args = (*example_inputs(model, rows_hint), weights)
    length = torch.export.Dim("length", min=16, max=1 << 17)
    rows = torch.export.Dim("rows", min=recipe.rows, max=recipe.hi) if recipe.dynamic else None
    by_rows = {1: rows} if rows is not None else {}
    shapes = (by_rows, by_rows, {**({2: rows} if rows is not None else {}), 3: length}, {},
              [{2: length}] * len(args[4]), [{2: length}] * len(args[5]), [{}] * len(weights))
    with torch.inference_mode(), opaque_linears(), folded_attention(model):
        step = Step(model, recipe.formats()).eval()
        with weights_out_of_sight(model):
            return torch.export.export(step, args, dynamic_shapes=shapes, strict=False)


# -- packages on disk -------------------------------------------------------------------------------------------------

def package_key(model_identity: str, dtype: torch.dtype, recipe: Recipe, machine: dict) -> dict:
    return {"format": FORMAT, "model": model_identity, "dtype": str(dtype).removeprefix("torch."),
            "recipe": asdict(recipe), **machine}


def package_file(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / "captured" / f"{digest}.pt2"


def build(model, recipe: Recipe, file: Path, weights: list[torch.Tensor]) -> float:
    """Export and compile `recipe` of `model`, traced with `weights` (stand-ins will do), into `file` (written whole
    or not at all); returns the seconds."""
    reason = compiler_missing()
    if reason:
        raise CaptureError(reason)
    start = time.perf_counter()
    program = export_step(model, recipe, weights)
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(f".tmp-{os.getpid()}-{file.name}")
    try:
        with torch.inference_mode():  # the example cache was made there: compiling updates it in place
            torch._inductor.aoti_compile_and_package(program, package_path=str(tmp))
        os.replace(tmp, file)
    finally:
        tmp.unlink(missing_ok=True)
    return time.perf_counter() - start


_ISA_CHECK: Future | None = None


def check_isa_ahead() -> None:
    """Start, in a background thread, inductor's check of this CPU's vector instruction sets, which the first package
    load of every process otherwise waits for: a cached compile, then a child process per set that loads it (~1.5 s
    of a warm start's critical path on 2 cores: docs/experiments/2026-11-29-warm-start.md). Once per process; the
    answer is inductor's own (cached in-process), so a package loads as it would have."""
    global _ISA_CHECK
    if _ISA_CHECK is None:
        _ISA_CHECK = ThreadPoolExecutor(1, thread_name_prefix="isa-check").submit(_check_isa)


def _check_isa() -> None:
    from torch._inductor import cpu_vec_isa  # private to inductor: where another torch lacks it, nothing is ahead
    if callable(getattr(cpu_vec_isa, "valid_vec_isa_list", None)):
        cpu_vec_isa.valid_vec_isa_list()


def load(file: Path, weights: list[torch.Tensor]):
    """The package's runner, bound to the model's `weights` (kernels.format_tensors of its recipe's formats): call
    it as Step.forward without them. Unpacked without leaving a folder behind (engine/runtime.py `load_package`)."""
    if _ISA_CHECK is not None:
        _ISA_CHECK.exception()  # waits for a check started ahead (else the load runs its own beside it); a check
        # that failed fails again, in words, inside the load
    runner = load_package(file)
    return lambda *args: runner(*args, weights)


def write_meta(file: Path, key: dict, compile_s: float) -> None:
    file.with_suffix(".json").write_text(json.dumps({"key": key, "compile_s": compile_s,
                                                     "built_at": time.time()}, indent=1))


def read_meta(file: Path) -> dict:
    try:
        return json.loads(file.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return {}
