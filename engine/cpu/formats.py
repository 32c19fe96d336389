"""Which weight formats each linear keeps: a short probe on a few of the model's own layers, then a memory plan.

Making every format of a 1.5B model whole to time whole forwards costs minutes and a copy of the weights per format
(engine/cpu/kernels.py lists them), and most formats lose on a given CPU (weight-only int8 on an AVX2-only CPU
loses at every row count). So formats are timed on the linears of the model's first decoder layers -- enough of
them that the group's own weights fill the last-level cache (every layer where the model has fewer), the cache
flushed before every timed sweep, so the probe streams from memory as a forward does -- and on the layers
outside them (the LM head), one shape group at a time (`kernels.group_of`: every linear of one weight shape), at each
rung of the ladder:

  * a format stops climbing once it is ladder.CLIMB_LIMIT times the best at a rung (what is not measured is priced
    as not competitive, never guessed);
  * a group keeps at most two formats: the one fastest over the tree rungs (2-16 rows, weighted by WEIGHT), and
    the one fastest at one row if it beats that by more than SHARE there (a wide matrix streams fastest unpacked at
    one row and packed above it). So a model's routing changes at one row count at most, and its captured steps are
    two packages (engine/cpu/packages.py `plan`);
  * `plan_memory` then drops the second formats that buy the least time per byte until the pair's weights fit its
    budget (`weights_budget`): one resident copy of each format a route reads, and no more than the machine has
    (8 GiB of weights on a 16 GiB machine; more on a larger one, where one-row AR keeps its own format).

The probe is cached per machine like the cost tables, where the machine was quiet while it ran
(engine/measure/quiet.py); the whole-model table (engine/measure/costs.py) is measured afterwards on the formats
kept, as routed.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from safetensors.torch import load_file, save_file

from engine.core.steps import LADDER
from engine.cpu.kernels import (INT4_GROUP, PATHS, QUANTISED, RoutedLinear, drop_format, format_unavailable,
                                linear_bytes, named_routed_linears, routed_linears, router_of, tensor_bytes,
                                tied_weights)
from engine.cpu.memory import available_memory, grown
from engine.measure.costs import ModelCosts, machine, model_identity, read_cached, table_file, write_json
from engine.measure.ladder import climb, interpolate
from engine.measure.quiet import watch_cpu
from engine.runtime import cache_dir

SHARE = 1.05  # a second format is kept only where it beats the first by more than this
REPEATS = 3
STORED = 1  # bump when what stored_file keeps changes meaning
FORMAT = 6  # bump when a cached probe's meaning changes (5: cached only where probed on a quiet machine; 6: each
# group on enough of its own layers to stream, the cache flushed before each sweep)
_LAYER = re.compile(r"\.layers\.(\d+)\.")
# How much each row count's speed matters when memory forces a choice: one row is every AR step and most draft
# steps; 2-16 rows are trees; 32-64 rows are rare.
WEIGHT = {1: 4.0, 2: 2.0, 4: 2.0, 8: 2.0, 16: 1.0, 32: 0.25, 64: 0.25}
WEIGHTS_CEILING = 8 << 30  # the pair's linear weights never exceed this on a machine of up to 18 GiB. The app
# beside them holds ~2 GiB (runtime, embeddings, caches) and its builder ~2 GiB plus a compile's growth: together
# inside a 16 GiB machine. In fp32 the default pair then keeps about one format per weight shape.
BESIDE_WEIGHTS = 10 << 30  # on a larger machine the ceiling is its memory less this: the app and its builder as
# above, a browser and the system (a 24 GiB machine: 14 GiB, room for AR's own one-row format beside the trees')
RESERVE = 3 << 30  # memory left to everything else when the budget comes from what is free


@dataclass
class GroupChoice:
    """One shape group of a model: its probe seconds per format and rung (infinity: not competitive there), the
    formats it keeps (best first), and how many bytes its linears hold in plain form across the whole model."""
    seconds: dict[str, dict[int, float]]
    kept: list[str]
    plain_bytes: int
    tied: bool = False  # its plain weight is the input embedding's: resident whatever it keeps, so plain is free

    def time(self, path: str, rows: int) -> float:
        return interpolate(self.seconds[path], rows)

    def routing(self, top: int = LADDER[-1]) -> list[str]:
        """Row count -> format for 1..top: the one-row format at one row, the many-row format above (`keep`)."""
        one = min(self.kept, key=lambda p: self.time(p, 1))
        return [one] + [self.kept[0]] * (top - 1)

    def loss_without(self, path: str) -> float:
        """Weighted probe seconds lost per call if `path` left the kept formats (infinity if it is the only one)."""
        rest = [p for p in self.kept if p != path]
        if not rest:
            return float("inf")
        return sum(w * max(min(self.time(p, r) for p in rest) - min(self.time(p, r) for p in self.kept), 0.0)
                   for r, w in WEIGHT.items())


@dataclass
class FormatChoice:
    """The probe's verdict for one model: per group, the formats to make whole and each format's bytes per byte of
    plain weight (per group: MKL's packing pads a 1536x256 weight to 6.7 times its bytes, a 1536x8960 one to 1.24);
    why formats were not probed."""
    groups: dict[str, GroupChoice]
    size: dict[str, dict[str, float]]
    notes: list[str] = field(default_factory=list)
    measured: bool = False
    disturbed: str | None = None  # probed here beside other work (engine/measure/quiet.py): what shared the CPU

    @property
    def kept(self) -> list[str]:
        """Every format some group keeps, in PATHS order."""
        return [p for p in PATHS if any(p in g.kept for g in self.groups.values())]

    def bytes(self) -> int:
        """Resident bytes of the kept formats over the whole model's linears."""
        return int(sum(self.format_bytes(group, p) for group, g in self.groups.items() for p in g.kept
                       if not (g.tied and p == "plain")))

    def format_bytes(self, group: str, path: str) -> int:
        """Bytes the group's linears take in `path` (their plain bytes where the probe did not say)."""
        return int(self.groups[group].plain_bytes * self.size.get(group, {}).get(path, 1.0))

    def routing(self) -> dict[str, list[str]]:
        return {group: g.routing() for group, g in self.groups.items()}

    def summary(self) -> str:
        """Per group: the kept formats and the probe's ratio of each to the best at one row."""
        parts = []
        for group, g in self.groups.items():
            at1 = {p: t[1] for p, t in g.seconds.items()}
            best = min(at1.values())
            ratios = ", ".join(f"{p} {v / best:.2f}" for p, v in sorted(at1.items(), key=lambda kv: kv[1]))
            parts.append(f"{group}: {'+'.join(g.kept)} (1 row: {ratios})")
        return "; ".join(parts)


# -- the probe ------------------------------------------------------------------------------------------------------

def last_level_cache() -> int:
    """Bytes of the CPU's last-level cache (32 MiB where sysfs does not say)."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1], 1)
            best = max(best, int(size.rstrip("KMG")) * scale)
        except (OSError, ValueError, IndexError):
            continue
    return best or 32 << 20


def probe_groups(model) -> dict[str, list[RoutedLinear]]:
    """Per shape group, the linears the probe times: the group's own in the first decoder layers until their weights
    fill the last-level cache (every layer if the model has fewer), and every linear outside the layers. Counted per
    group because each group is timed alone, and `CacheFlush` empties the cache before each sweep: a sweep that long
    streams as a forward does. Counted over all groups, the draft's q|k|v was timed on its first two layers (8 MB),
    from the cache (docs/experiments/2026-11-29-probe-streams.md)."""
    want = last_level_cache()
    groups: dict[str, list[RoutedLinear]] = {}
    size: dict[str, int] = {}
    for name, module in model.named_modules():  # layer by layer, in order
        if not isinstance(module, RoutedLinear):
            continue
        in_layer = _LAYER.search(name + ".") is not None
        if in_layer and size.get(module.group, 0) >= want:
            continue
        groups.setdefault(module.group, []).append(module)
        size[module.group] = size.get(module.group, 0) + (_plain_bytes(module) if in_layer else 0)
    return groups


def _plain_bytes(layer: RoutedLinear) -> int:
    return layer.weight.numel() * layer.weight.element_size()


def time_formats(layers: list[RoutedLinear], paths: list[str], ladder=LADDER, repeats: int = REPEATS,
                 streams: bool = True) -> dict[str, dict[int, float]]:
    """Seconds of one call of every layer in `layers` on each format, per rung, climbed as `ladder.climb` does
    (fastest of `repeats`, formats interleaved, a clearly losing format stops climbing), after a discarded warm-up
    per rung; where the model `streams` its weights from memory, the cache flushed before every sweep
    (`CacheFlush`)."""
    generator = torch.Generator().manual_seed(0)
    dtype = layers[0].weight.dtype
    inputs: list[torch.Tensor] = []
    flush = CacheFlush() if streams else None

    def at_rung(rows: int, live: list[str]) -> None:  # this rung's inputs, and a discarded warm-up per format
        inputs[:] = [torch.randn(rows, layer.in_features, generator=generator).to(dtype) for layer in layers]
        for path in live:
            _sweep(layers, inputs, path, flush)

    with torch.inference_mode():
        return climb(paths, ladder, lambda path, rows: _sweep(layers, inputs, path, flush), repeats, at_rung)


class CacheFlush:
    """Reads a buffer of twice the last-level cache: a sweep after it finds none of its weights cached, as in a
    forward, where every other weight passes through the cache between two calls of one layer. Without it, a format
    whose group fits the cache (a quantised copy is a quarter of the bytes) is timed from the cache on the second
    sweep."""

    def __init__(self):
        self.buffer = torch.ones(2 * last_level_cache() // 4)  # written, so its pages are real (not the zero page)

    def __call__(self) -> None:
        self.buffer.sum()


def _sweep(layers, inputs, path: str, flush=None) -> float:
    router = layers[0].router
    router.forced = path
    try:
        if flush is not None:
            flush()
        start = time.perf_counter()
        for layer, x in zip(layers, inputs):
            layer(x)
        return time.perf_counter() - start
    finally:
        router.forced = None


def keep(seconds: dict[str, dict[int, float]]) -> list[str]:
    """[the format fastest over the tree rungs (2-16 rows, weighted by WEIGHT)] + [the format fastest at one row,
    where it beats that one by more than SHARE there]. A format missing at a rung was not competitive there."""
    tree = [r for r in (2, 4, 8, 16) if any(r in t for t in seconds.values())] or [1]
    many = min(seconds, key=lambda p: (sum(WEIGHT[r] * seconds[p].get(r, float("inf")) for r in tree),
                                       PATHS.index(p)))
    one = min(seconds, key=lambda p: (seconds[p][1], PATHS.index(p)))
    return [many] + ([one] if one != many and seconds[one][1] * SHARE < seconds[many][1] else [])


def probe_key(model, name: str, dtype: torch.dtype, paths: list[str]) -> dict:
    device = next(model.parameters()).device
    return {"format": FORMAT, "probe": "formats", "model": model_identity(model, name),
            "dtype": str(dtype).removeprefix("torch."), "paths": sorted(paths), "ladder": list(LADDER),
            "cache": last_level_cache(), **machine(device)}


def choose_formats(model, name: str, candidates: list[str], compute_dtype: torch.dtype | None = None,
                   recalibrate: bool = False) -> FormatChoice:
    """Probe `candidates` on `model` per shape group (read from the cache where this machine probed them before)
    and say which each group keeps. The probe's copies are made for the probed layers only and freed after."""
    device, dtype = next(model.parameters()).device, model.dtype
    notes, paths = [], []
    for path in candidates:
        reason = format_unavailable(path, device, dtype)
        (notes.append(f"{path}: {reason}") if reason else paths.append(path))
    members = {}
    for layer in routed_linears(model):
        members.setdefault(layer.group, []).append(layer)
    plain = {g: sum(_plain_bytes(m) for m in ms) for g, ms in members.items()}
    key = probe_key(model, name, dtype, paths)
    data = None if recalibrate else read_cached(key)
    disturbed = None
    if data is None:
        with watch_cpu() as watch:
            seconds, size = _probe(model, paths, compute_dtype, notes)
        if watch.disturbed:  # serves this load only; the next start probes again (engine/measure/quiet.py)
            disturbed = watch.sharing.describe()
        else:
            write_json(table_file(key), {"key": key, "seconds": seconds, "size": size, "notes": notes,
                                         "measured_at": time.time()})
        measured = True
    else:
        seconds = {g: {p: {int(r): v for r, v in t.items()} for p, t in by_path.items()}
                   for g, by_path in data["seconds"].items()}
        size, notes, measured = data["size"], notes + data.get("notes", []), False
    tied = {g for g, ms in members.items() if any(id(m.weight) in tied_weights(model) for m in ms)}
    groups = {g: GroupChoice(seconds[g], _kept(seconds[g], g in tied), plain[g], g in tied) for g in members}
    return FormatChoice(groups, size, notes, measured, disturbed)


def _kept(seconds, tied: bool) -> list[str]:
    """`keep`, and for a tied group its plain weight too where it is the fastest at one row (it is resident anyway)."""
    kept = keep(seconds)
    if tied and "plain" in seconds and "plain" not in kept and seconds["plain"][1] < seconds[kept[0]][1]:
        kept.append("plain")
    return kept


def _probe(model, paths: list[str], compute_dtype, notes: list[str]):
    """(seconds[group][path][rows], bytes per plain byte[group][path]) on copies made for the probed layers only; a
    group is probed on the formats its weight shape takes (int4 needs multiples of its group size). One group's
    copies exist at a time: each group fills the last-level cache, and a VM may report its whole socket's (480 MiB),
    where making every group's copies at once added gigabytes to a start (docs/experiments/2026-12-07-xeon-amx.md)."""
    groups = probe_groups(model)
    takes = {g: [p for p in paths if all(layer.takes(p) for layer in layers)] for g, layers in groups.items()}
    for g, have in takes.items():
        notes += [f"{g}: {p} does not take this weight shape" for p in paths if p not in have]
    # a model whose weights fit the cache is read from it by its forwards, and timed so (no flush)
    streams = linear_bytes(model) > last_level_cache()
    seconds, size = {}, {}
    for g, layers in groups.items():
        try:
            for layer in layers:
                for path in takes[g]:
                    layer.add(path, compute_dtype)
            size[g] = {p: _bytes_ratio(layers, p) for p in takes[g]}
            seconds[g] = time_formats(layers, takes[g], streams=streams)
        finally:
            for layer in layers:
                for path in paths:
                    if path != "plain":
                        layer.drop(path)
    return seconds, size


def _bytes_ratio(layers: list[RoutedLinear], path: str) -> float:
    """Bytes of `layers` in `path` per byte of their plain weights."""
    made = [layer for layer in layers if path in layer.paths]
    return sum(tensor_bytes(t) for layer in made for t in layer.tensors(path)) / max(sum(map(_plain_bytes, made)), 1)


# -- the memory plan ----------------------------------------------------------------------------------------------------

def weights_budget(loaded_bytes: int) -> int:
    """Bytes the pair's linear weights may take: `weights_ceiling()` (or TREEVIZ_WEIGHTS_GIB), and no more than what
    is free now plus what the loaded models already hold, less RESERVE for everything else."""
    ceiling = int(float(os.environ.get("TREEVIZ_WEIGHTS_GIB", weights_ceiling() / 2**30)) * 2**30)
    free = available_memory()
    return ceiling if free is None else min(ceiling, free + loaded_bytes - RESERVE)


def weights_ceiling(total: int | None = None) -> int:
    """WEIGHTS_CEILING on a machine (or container) of `total` bytes (default: this one's) up to 18 GiB, its memory
    less BESIDE_WEIGHTS above: where a float32 pair has room, one-row AR keeps the format it runs fastest (plain,
    where the trees' rows run MKL's packed GEMMs), so the page's Race measures AR at its fastest
    (docs/experiments/2026-11-29-room-for-ar.md)."""
    return grown(WEIGHTS_CEILING, BESIDE_WEIGHTS, total)


def plan_memory(choices: list[FormatChoice], budget: int) -> list[str]:
    """Drop second formats, the one that buys the least weighted time per byte first, until the choices' bytes fit
    `budget` (a group's last format always stays: a model that does not fit in one format is the loader's refusal,
    not this plan's). Returns one note per format dropped."""
    notes = []
    while sum(c.bytes() for c in choices) > budget:
        options = [(g.loss_without(p) / max(c.format_bytes(group, p), 1), c, group, p)
                   for c in choices for group, g in c.groups.items() if len(g.kept) > 1 for p in g.kept]
        if not options:
            notes.append(f"the weights need {sum(c.bytes() for c in choices) / 2**30:.1f} GiB in one format each; "
                         f"the budget is {budget / 2**30:.1f} GiB")
            break
        _, choice, group, path = min(options, key=lambda o: o[0])
        choice.groups[group].kept.remove(path)
        notes.append(f"{group}: {path} dropped to fit {budget / 2**30:.1f} GiB of weights")
    return notes


def make_whole(model, choice: FormatChoice, compute_dtype: torch.dtype | None = None) -> None:
    """Give every linear of `model` the formats its group keeps, layer by layer, freeing a plain weight right after
    its replacement is made (so two whole copies never coexist; a tied one stays), and install the groups'
    routing. Formats a layer's shape cannot take leave that layer on what it has. A quantised format is read back
    from disk where an earlier start made it for these very weights (`stored_file`), else made and written there."""
    tied, file = tied_weights(model), stored_file(model)
    stored, made = read_stored(file), {}
    for name, layer in named_routed_linears(model):
        kept = choice.groups[layer.group].kept
        for path in (p for p in kept if layer.takes(p)):
            tensors = {k.rsplit("/", 1)[1]: t for k, t in stored.items() if k.startswith(f"{name}/{path}/")}
            if tensors:
                layer.restore(path, tensors)
                continue
            layer.add(path, compute_dtype)
            if path in QUANTISED and file is not None:
                made.update({f"{name}/{path}/{k}": t for k, t in layer.stored(path).items()})
        if "plain" not in kept and id(layer.weight) not in tied and all(layer.takes(p) for p in kept):
            layer.drop("plain")
    if made:
        write_stored(file, {**stored, **made})
    router = router_of(model)
    router.paths = [p for p in PATHS if any(p in layer.paths for layer in routed_linears(model))]
    biggest = max(choice.groups.values(), key=lambda g: g.plain_bytes)
    router.default = biggest.kept[0]
    router.install([], choice.routing())


def untouched_by_make_whole(model, choice: FormatChoice | None) -> list[RoutedLinear]:
    """The routed linears `make_whole` neither reads nor replaces the weight of: those of groups that keep `plain`
    alone (every one where no probe chose formats, as `make_whole` then does not run), so another thread may copy
    their weights while it runs."""
    return [m for m in routed_linears(model) if choice is None or choice.groups[m.group].kept == ["plain"]]


# -- quantised formats on disk ------------------------------------------------------------------------------------------

def stored_file(model) -> Path | None:
    """Where `model`'s quantised formats are kept between starts: keyed by its weights (the fingerprint taken at
    load, after any head trim), dtype, layer shapes, the formats' version and torch's; None for a model without a
    fingerprint. Quantising again would read every float weight at every start
    (docs/experiments/2026-11-28-second-start.md)."""
    fingerprint = getattr(model, "treeviz_fingerprint", None)
    if fingerprint is None:
        return None
    shapes = [[name, m.out_features, m.in_features] for name, m in named_routed_linears(model)]
    key = {"stored": STORED, "fingerprint": fingerprint, "dtype": str(model.dtype), "torch": torch.__version__,
           "int4_group": INT4_GROUP, "shapes": shapes}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / "formats" / f"{digest}.safetensors"


def read_stored(file: Path | None) -> dict[str, torch.Tensor]:
    """The tensors kept in `file`, as safetensors maps them, or {} (none yet, or unreadable: the formats are then made
    again)."""
    if file is None or not file.is_file():
        return {}
    try:
        return load_file(file)
    except Exception:  # noqa: BLE001 - a damaged file costs one remake, never a start
        return {}


def write_stored(file: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Keep `tensors` in `file` for the next start; a disk that refuses costs that start a remake, never this one."""
    tmp = file.with_name(f".tmp-{file.name}-{os.getpid()}")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: t.contiguous() for k, t in tensors.items()}, str(tmp))
        os.replace(tmp, file)  # a crash never leaves half a file
    except OSError:
        tmp.unlink(missing_ok=True)


def drop_unrouted(model, costs: ModelCosts) -> None:
    """Free the formats the installed routing sends no row count to, and forget their columns of the table: one
    resident copy of each format a route actually reads (memory is a budget)."""
    used = set(costs.routing())
    for path in [p for p in costs.seconds if p not in used]:
        drop_format(model, path)
        if path not in router_of(model).paths:  # a tied plain weight stays (the embedding reads it)
            costs.seconds.pop(path)
            for table in costs.contexts.values():
                table.pop(path, None)
