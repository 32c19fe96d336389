"""Measured forward costs: what one target or draft forward of n rows costs on this machine, per kernel path.

Speculative decoding pays off by L̄ / (t(n) + d·c) (ARCHITECTURE.md, *Performance model*), and both c (draft
step / target step) and t(n) (verifying n rows / target step) are properties of the CPU, the models and the kernels.
So they are measured, once per (machine, model, dtype, torch version, threads), and cached on disk in
cache_dir()/costs; `recalibrate=True` measures again.

A measurement: fill a KV cache with a realistic prefix (PREFIX tokens, then each of CONTEXTS), then time forwards of 1,
2, 4, ... 64 rows over it with the verification's additive mask, each path forced in turn (engine/cpu/kernels.py:
the formats engine/cpu/formats.py kept), fastest of REPEATS (after one discarded warm-up call per path). A path
ladder.CLIMB_LIMIT times the best at a rung is not measured further up (priced at infinity: not competitive, never
guessed), and the other contexts are measured only for the paths that win somewhere at PREFIX. The cache is rolled
back after each call, so every call sees the same prefix. On CUDA, timing synchronises the device and the only path
is torch's own. Where runs replay CUDA
graphs (engine/core/steps.py) the table is measured through those same steps, one graph per rung
(engine/measure/graphed.py `measure_graphed`): a GPU's eager forwards cost what the host takes to launch them, which
says nothing about a replay.

The table then decides three things: the routing (each row count to its fastest path), the predicted cost of an
iteration (Σ draft forwards at their row counts + verification at the tree's size, interpolated between the
measured context lengths), and the `auto` presets (engine/measure/autosize.py).
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from engine.core import kv
from engine.core.steps import LADDER
from engine.measure.ladder import climb, interpolate
from engine.measure.quiet import watch_cpu
from engine.runtime import cache_dir, forcing, fused_projections, onednn_bf16, router_of, synchronize

PREFIX = 300
# Further context lengths measured beside PREFIX (attention's share of a forward grows with the cache), stored in the
# same file under "contexts" so a table cached before they existed still loads and only they are measured.
CONTEXTS = (1200,)
REPEATS = 3
CAPTURED = "captured"  # the path name of a model's captured steps in a table (never a kernel route)
ROUTED = "routed"  # the path name of a model timed as its router sends each linear (a routing per shape group)
FORMAT = 3  # bump when the meaning of a cached table changes (3: cached only where measured on a quiet machine)
_STREAM_BYTES = 1 << 30  # streaming-read probe: large enough to defeat every cache level


# ----------------------------------------------------------------------------------------------------------------------
# what a table is keyed by


def cpu_info() -> dict[str, str]:
    """This CPU's model name and instruction-set flags, from /proc/cpuinfo ("unknown" / "" where it does not say)."""
    info = {"name": "unknown", "flags": ""}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and info["name"] == "unknown":
                info["name"] = value.strip()
            elif key in ("flags", "Features") and not info["flags"]:
                info["flags"] = value.strip()
    except OSError:
        pass
    return info


def cpu_capability() -> str:
    """The vector ISA ATen dispatches to here ("AVX512", "AVX2", "DEFAULT", ...), after ATEN_CPU_CAPABILITY."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return "unknown"


def kernel_isa() -> str:
    """The instruction sets torch's CPU kernels actually use, after the variables that lower them (an emulated CPU
    class, docs/cpu.md, gets tables of its own): ATen's dispatch level, oneDNN's bf16 and MKL's setting."""
    mkl = os.environ.get("MKL_ENABLE_INSTRUCTIONS", "auto")
    return f"{cpu_capability()}/onednn-bf16={int(onednn_bf16())}/mkl={mkl}"


def machine(device: torch.device) -> dict:
    """The hardware and software a measurement holds for. A virtualised CPU often reports only its family name
    ("AMD EPYC"), so the instruction-set flags, the ISA torch's kernels use and the core count are part of the
    identity too."""
    if device.type == "cuda":
        hw = {"gpu": torch.cuda.get_device_name(device)}
    else:
        cpu = cpu_info()
        hw = {"cpu": cpu["name"], "cpu_flags": hashlib.sha256(cpu["flags"].encode()).hexdigest()[:12],
              "cores": os.cpu_count(), "isa": kernel_isa()}
    return {**hw, "device": device.type, "torch": torch.__version__, "threads": torch.get_num_threads()}


def model_identity(model, name: str) -> str:
    """Name + architecture + size + head + fused projections: a different checkpoint, shape, trimmed vocabulary or
    set of linears (engine/cpu/fusion.py stacks siblings into wider ones) is another model."""
    config = model.config.to_json_string(use_diff=False) if hasattr(model.config, "to_json_string") else ""
    digest = hashlib.sha256(config.encode()).hexdigest()[:12]
    numel = sum(p.numel() for p in model.parameters())
    head = model.get_output_embeddings()
    vocab = getattr(head, "vocab_rows", None)
    fused = fused_projections(model)
    return f"{name}|{digest}|{numel}" + (f"|vocab {vocab}" if vocab else "") + (f"|fused {fused}" if fused else "")


def table_key(model, name: str, dtype: torch.dtype, device: torch.device, graphs: bool = False) -> dict:
    key = {"format": FORMAT, "model": model_identity(model, name), "dtype": str(dtype).removeprefix("torch."),
           "prefix": PREFIX, "ladder": list(LADDER), **machine(device),
           "attention": getattr(model.config, "_attn_implementation", None)}
    return {**key, "steps": "cuda-graphs"} if graphs else key


def table_file(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / "costs" / f"{digest}.json"


def read_cached(key: dict) -> dict | None:
    """The entry stored under `key` (write_json), or None: none yet, damaged, or written for another key."""
    try:
        data = json.loads(table_file(key).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("key") == key else None


# ----------------------------------------------------------------------------------------------------------------------
# one model's table


@dataclass
class ModelCosts:
    """Median forward seconds of one model: seconds[path][rows] for each eager kernel path; `captured[context][rows]`
    through its captured steps (engine/cpu/packages.py), and `serves`: the row counts those serve (only where
    faster) -> the rows each actually runs (a static package pads to its bucket)."""
    name: str
    seconds: dict[str, dict[int, float]]
    measured: bool = False  # measured in this process (False: read from the disk cache)
    step_bytes: int = 0  # linear weight bytes one single-row step reads on the installed routing
    disturbed: str | None = None  # measured here beside other work (engine/measure/quiet.py): what shared the CPU
    contexts: dict[int, dict[str, dict[int, float]]] = field(default_factory=dict)  # other context lengths' tables
    captured: dict[int, dict[int, float]] = field(default_factory=dict)
    serves: dict[int, int] = field(default_factory=dict)

    def time(self, rows: int, path: str | None = None, context: int | None = None) -> float:
        """Seconds of a forward of `rows` rows on `path` (default: the way a run takes it: captured where a captured
        step serves `rows`, else the fastest eager path) over a cache of `context` tokens (default PREFIX): linear
        in rows between rungs, then linear in context between the measured context lengths."""
        if path == CAPTURED or (path is None and rows in self.serves):
            return self.captured_time(self.serves.get(rows, rows), context)
        return self.eager_time(rows, path, context)

    def eager_time(self, rows: int, path: str | None = None, context: int | None = None) -> float:
        tables = {PREFIX: self.seconds, **self.contexts} if context is not None else {PREFIX: self.seconds}
        at = {}
        for length, seconds in tables.items():
            at[length] = (interpolate(seconds[path], rows) if path is not None else
                          min(interpolate(points, rows) for points in seconds.values()))
        return interpolate(at, context if context is not None else PREFIX)

    def captured_time(self, rows: int, context: int | None = None) -> float:
        """Seconds of the captured forward that runs `rows` rows (padding already applied)."""
        at = {length: interpolate(points, rows) for length, points in self.captured.items()}
        return interpolate(at, context if context is not None else PREFIX)

    def best_path(self, rows: int) -> str:
        return min(self.seconds, key=lambda p: interpolate(self.seconds[p], rows))

    def routing(self, max_rows: int = LADDER[-1]) -> list[str]:
        """The fastest eager kernel path for each row count 1..max_rows (what a Router installs)."""
        return [self.best_path(r) for r in range(1, max_rows + 1)]


def probe_ids(model, count: int) -> torch.Tensor:
    """`count` deterministic, ordinary-looking token ids on the model's device (cost does not depend on them; the
    specials at the end of the vocabulary are avoided)."""
    vocab = model.config.get_text_config().vocab_size
    return (torch.arange(count, device=next(model.parameters()).device) * 7919) % max(vocab - 512, 1)


def measure(model, paths: list[str], ladder=LADDER, prefix: int = PREFIX, repeats: int = REPEATS
            ) -> dict[str, dict[int, float]]:
    """Seconds of a forward of each rung's row count over a `prefix`-token cache, per path, climbed as
    `ladder.climb` does (fastest of `repeats`, paths interleaved, a clearly losing path stops climbing)."""
    ids = probe_ids(model, prefix + max(ladder))

    def sample(path: str, rows: int) -> float:
        with forcing(model, None if path == ROUTED else path):
            return timed_forward(model, ids, prefix, rows, cache)

    with torch.inference_mode():
        cache = filled_cache(model, ids, prefix)
        for path in paths:  # warm-up, discarded: first calls of a path allocate and pick kernels
            sample(path, ladder[0])
        return climb(paths, ladder, sample, repeats)


def filled_cache(model, ids: torch.Tensor, prefix: int):
    """A cache of `prefix` positions to time forwards over. Random keys and values where the model's config says
    their shapes: a forward's cost depends on how many positions attention reads, not on what they hold, and the
    prefill that would make real ones is the longest part of a table (a 1,200-token prefill of the fp32 1.5B target
    takes ~40 s on 2 cores). A model whose cache does not take them gets a real prefill."""
    cfg = getattr(model.config, "get_text_config", lambda: model.config)()
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache = kv.new_cache(model)
    try:
        generator = torch.Generator().manual_seed(0)
        for layer in range(cfg.num_hidden_layers):
            keys, values = (torch.randn(1, heads, prefix, head_dim, generator=generator).to(ids.device, model.dtype)
                            for _ in range(2))
            cache.update(keys, values, layer)
        model(input_ids=ids[None, prefix:prefix + 1], position_ids=torch.tensor([[prefix]], device=ids.device),
              past_key_values=cache, use_cache=True)  # the cache takes a forward after it: else a real prefill
        kv.keep_rows(cache, prefix, [])
        return cache
    except (AttributeError, RuntimeError, ValueError, TypeError):
        cache = kv.new_cache(model)
        model(input_ids=ids[None, :prefix], past_key_values=cache, use_cache=True, logits_to_keep=1)
        return cache


def timed_forward(model, ids: torch.Tensor, prefix: int, rows: int, cache) -> float:
    """Seconds of one forward of `rows` rows after the cached prefix; the cache is rolled back after."""
    device = ids.device
    mask = _causal_mask(prefix, rows, model.dtype, device)
    positions = torch.arange(prefix, prefix + rows, device=device)[None]
    synchronize(device)
    start = time.perf_counter()
    model(input_ids=ids[None, prefix:prefix + rows], position_ids=positions, attention_mask=mask,
          past_key_values=cache, use_cache=True)
    synchronize(device)
    seconds = time.perf_counter() - start
    kv.keep_rows(cache, prefix, [])
    return seconds


def _causal_mask(prefix: int, rows: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # The verification's mask format (a chain is a tree): cost includes building and applying an additive mask.
    chain = torch.tril(torch.ones(rows, rows, dtype=torch.bool))
    return kv.additive_mask(kv.tree_visibility(prefix, chain).to(device), dtype)


def model_costs(model, name: str, dtype: torch.dtype, device: torch.device, recalibrate: bool = False,
                measure_fn=measure, graphs: bool = False) -> ModelCosts:
    """The model's table for the paths it has: from the disk cache where it holds them, else measured, and saved
    where the machine was quiet meanwhile (engine/measure/quiet.py; a disturbed table serves this run only).
    `graphs`: the table of replayed CUDA graphs (`measure_fn` then times them: engine/measure/graphed.py
    `measure_graphed`), cached apart from the eager one."""
    router = router_of(model)
    paths = [ROUTED] if router is not None and router.by_group else list(router.paths) if router is not None else \
        ["plain"]
    key = {**table_key(model, name, dtype, device, graphs), **({"routing": router.by_group} if paths == [ROUTED]
                                                                else {})}
    stored: dict[str, dict[int, float]] = {}
    others: dict[int, dict[str, dict[int, float]]] = {}
    data = None if recalibrate else read_cached(key)
    if data is not None:
        try:
            stored = _table(data["seconds"])
            others = {int(c): _table(t) for c, t in data.get("contexts", {}).items()}
        except (ValueError, KeyError, AttributeError):
            stored, others = {}, {}  # a damaged cache entry is measured again
    measured, shared = False, []
    for context, table in [(PREFIX, stored)] + [(c, others.setdefault(c, {})) for c in CONTEXTS]:
        missing = [p for p in paths if set(table.get(p, {})) != set(LADDER)]
        if context != PREFIX:  # another context only for the paths that win somewhere
            winners = set(ModelCosts(name, {p: stored[p] for p in paths}).routing())
            table.update({p: {r: float("inf") for r in LADDER} for p in missing if p not in winners})
            missing = [p for p in missing if p in winners]
        if missing:
            with watch_cpu() as watch:
                table.update(measure_fn(model, missing) if context == PREFIX else
                             measure_fn(model, missing, prefix=context))
            shared.append(watch.sharing)
            measured = True
    disturbed = next((s.describe() for s in shared if s is not None and s.disturbed), None)
    if measured and disturbed is None:
        write_json(table_file(key), {"key": key, "seconds": stored,
                                     "contexts": {str(c): t for c, t in others.items()}, "measured_at": time.time(),
                                     "others_cores": max((s.others_cores for s in shared if s), default=None)})
    return ModelCosts(name, {p: stored[p] for p in paths}, measured=measured, disturbed=disturbed,
                      contexts={c: {p: t[p] for p in paths} for c, t in others.items() if c in CONTEXTS})


def _table(data: dict) -> dict[str, dict[int, float]]:
    """A table read from JSON (row counts are string keys there)."""
    return {p: {int(r): s for r, s in v.items()} for p, v in data.items()}


def write_json(file: Path, data: dict) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(f".tmp-{file.name}-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, file)  # a crash never leaves half a table


# ----------------------------------------------------------------------------------------------------------------------
# memory bandwidth


def stream_bandwidth(device: torch.device, nbytes: int = _STREAM_BYTES, repeats: int = 3, seconds: float = 1.0
                     ) -> float:
    """Bytes per second of a streaming read: the fastest of at least `repeats` sums of a `nbytes` fp32 tensor, and
    of as many as `seconds` holds (every byte read once, arithmetic negligible; a window long enough for
    engine/measure/quiet.py to judge). This is the ceiling a memory-bound single-row step can approach."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    samples, begin = [], time.perf_counter()
    while len(samples) <= repeats or time.perf_counter() - begin < seconds:
        synchronize(device)
        start = time.perf_counter()
        x.sum()
        synchronize(device)
        samples.append(time.perf_counter() - start)
    return nbytes / min(samples[1:])


def machine_bandwidth(device: torch.device, recalibrate: bool = False) -> float:
    """stream_bandwidth, cached per machine like the tables (where measured on a quiet machine)."""
    key = {"format": FORMAT, "probe": "stream-sum-fp32", "bytes": _STREAM_BYTES, **machine(device)}
    data = None if recalibrate else read_cached(key)
    if data is not None and isinstance(data.get("bytes_per_s"), (int, float)):
        return float(data["bytes_per_s"])
    with watch_cpu() as watch:
        value = stream_bandwidth(device)
    if not watch.disturbed:
        write_json(table_file(key), {"key": key, "bytes_per_s": value, "measured_at": time.time()})
    return value


# ----------------------------------------------------------------------------------------------------------------------
# a pair's costs and the cost model


@dataclass
class PairCosts:
    target: ModelCosts
    draft: ModelCosts | None
    bandwidth: float | None = None  # streaming-read bytes per second of the machine
    notes: list[str] = field(default_factory=list)

    def eager(self) -> "PairCosts":
        """The same tables pricing only the eager paths: what a run with captured steps off costs."""
        strip = lambda t: None if t is None else replace(t, serves={})  # noqa: E731
        return replace(self, target=strip(self.target), draft=strip(self.draft))

    @property
    def step(self) -> float:
        """Seconds of one target step (1 row): the unit of c and t(n)."""
        return self.target.time(1)

    @property
    def c(self) -> float | None:
        return self.draft.time(1) / self.step if self.draft is not None else None

    def t(self, rows: int) -> float:
        return self.target.time(rows) / self.step

    def predict(self, draft_rows: list[int], verify_rows: int, context: int | None = None) -> dict[str, float]:
        """Predicted seconds of an iteration at `context` committed tokens (default: the table's PREFIX): each draft
        forward at its row count + one verification."""
        draft = (sum(self.draft.time(r, context=context) for r in draft_rows)
                 if self.draft is not None and draft_rows else 0.0)
        verify = self.target.time(verify_rows, context=context)
        return {"draft_s": draft, "verify_s": verify, "total_s": draft + verify}

    def ar_bandwidth(self) -> float:
        """Bytes per second AR achieves: the target's linear weight bytes per step ÷ its measured step time."""
        return self.target.step_bytes / self.step

    def to_dict(self) -> dict:
        """Plain JSON-able summary (for bench reports and traces)."""
        out = {"c": self.c, "t": {r: self.t(r) for r in LADDER},
               "bandwidth_bytes_per_s": self.bandwidth, "ar_bytes_per_s": self.ar_bandwidth()}
        for role, table in (("target", self.target), ("draft", self.draft)):
            if table is not None:
                out[role] = {"name": table.name, "seconds": table.seconds, "step_bytes": table.step_bytes,
                             "captured": table.captured, "serves": spans(table.serves),
                             "padded": describe_pads(table.serves)}
        return out


def spans(rows) -> str:
    """[1, 2, 3, 5, 6] -> '1-3, 5-6' ('none' when empty)."""
    rows, out, start = sorted(rows), [], None
    for i, r in enumerate(rows):
        start = r if start is None else start
        if i + 1 == len(rows) or rows[i + 1] != r + 1:
            out.append(f"{start}-{r}" if r > start else f"{r}")
            start = None
    return ", ".join(out) or "none"


def describe_pads(runs: dict[int, int]) -> str:
    """{row count: rows it runs as} -> the padded ones: {1: 4, 2: 4, 3: 4, 4: 4} -> '1-3 as 4' ('' where none is)."""
    by_rows: dict[int, list[int]] = {}
    for n, rows in sorted(runs.items()):
        if rows != n:
            by_rows.setdefault(rows, []).append(n)
    return ", ".join(f"{spans(ns)} as {rows}" for rows, ns in by_rows.items())


def format_costs(costs: PairCosts, routing: dict[str, str] | None = None, formats: dict[str, str] | None = None
                 ) -> str:
    """The cost table as text: ms per path and row count, c, t(n), routing, and AR against the bandwidth bound."""
    head = "model   path    " + "".join(f"{r:>8d}" for r in LADDER) + "   (ms per forward, rows)"
    lines = [head, "-" * len(head)]
    for role, table in (("target", costs.target), ("draft", costs.draft)):
        if table is None:
            continue
        for path in table.seconds:  # kernel paths in the router's order; a model routed per shape group has the
            if path != ROUTED:       # one column ROUTED: the row below
                cells = "".join(f"{table.seconds[path][r] * 1000:8.1f}" for r in LADDER)
                lines.append(f"{role:7s} {path:7s} {cells}")
        routed = "".join(f"{table.eager_time(r) * 1000:8.1f}" for r in LADDER)
        lines.append(f"{role:7s} {'routed':7s} {routed}")
        if table.captured:
            at = table.captured.get(PREFIX, {})
            cells = "".join(f"{at[r] * 1000:8.1f}" if r in at else f"{'-':>8s}" for r in LADDER)
            lines.append(f"{role:7s} {CAPTURED:7s} {cells}")
            run = "".join(f"{table.time(r) * 1000:8.1f}" for r in LADDER)
            padded = describe_pads(table.serves)
            lines.append(f"{role:7s} {'as run':7s} {run}   (captured where it serves: rows {spans(table.serves)}"
                         + (f"; run padded: rows {padded})" if padded else ")"))
    lines.append("")
    lines.append("t(n) = verify n rows / target step: " +
                 "  ".join(f"t({r})={costs.t(r):.2f}" for r in LADDER))
    if costs.c is not None:
        lines.append(f"c = draft step / target step = {costs.draft.time(1) * 1000:.1f} / "
                     f"{costs.step * 1000:.1f} ms = {costs.c:.3f}")
    for role, text in (routing or {}).items():
        lines.append(f"routing {role}: {text}")
    for role, text in (formats or {}).items():
        lines.append(f"formats {role} (probe, engine/cpu/formats.py): {text}")
    ar = costs.ar_bandwidth()
    line = (f"AR: {costs.target.step_bytes / 1e9:.2f} GB of linear weights per step in {costs.step * 1000:.1f} ms "
            f"= {ar / 1e9:.1f} GB/s")
    if costs.bandwidth:
        line += (f"; streaming read (sum of a {_STREAM_BYTES >> 30} GiB fp32 tensor) {costs.bandwidth / 1e9:.1f} GB/s "
                 f"-> {ar / costs.bandwidth:.0%} of the bound, which is "
                 f"{costs.target.step_bytes / costs.bandwidth * 1000:.1f} ms per step")
    lines.append(line)
    for table in (costs.target, costs.draft):
        if table is not None and table.disturbed:
            lines.append(f"warning: {table.name}'s table was measured beside other work ({table.disturbed}): it "
                         "serves this run only and is measured again next time; rerun on a quiet machine")
    return "\n".join(lines)
