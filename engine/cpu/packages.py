"""Captured steps for a pair: which forwards run compiled (CPU) or graphed (CUDA), and where each one pays.

    prepare_capture(pair, progress)      # CPU: build (once per machine) and load each model's packages, measure them
    steps = pair.captured["draft"]       # a CapturedModel: route(n) -> (rows to run, runner) or (n, None)

The switch (`capture`: auto | on | off) belongs to the pair:
  CPU   packages compiled ahead of time by AOTInductor (engine/cpu/aoti.py), where a C++ compiler exists;
  CUDA  one CUDA graph per row-count bucket (engine/cuda/graphs.py), with `auto` too: on an H100 every strategy
        decoded the same tokens graphed and eager, and AR's (docs/experiments/gpu-2026-11-26/summary.md).

What each CPU model gets (`plan`): per span of row counts its routing sends to one weight format, a package for that
span -- static for one row (AR's step, and the draft's most frequent forward), the row count dynamic for the rest
(a tree's size changes every iteration; the GEMMs are the formats' own kernels, which take any row count). A
package holds no weights (engine/cpu/aoti.py), so these cost disk and compile seconds, not memory. Rows no
package covers (a prefill, the draft's first forward over the prompt) run eagerly. Every package is then timed
against the eager path at each rung of the cost ladder, and a row count is served by it only where it measured
faster (`serves`, kept in the cost table, which thereby prices the path the run takes). A row count runs padded to a
larger measured rung where that rung measured cheaper (`pads`): oneDNN's bf16 GEMM on a CPU without AMX streams its
weights faster at four rows than at one (docs/experiments/2026-12-06-zen4.md), so there AR's step runs as four rows.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.core.steps import LADDER, StaticSteps
from engine.cpu.aoti import MAX_ROWS, Recipe, build, load, package_file, package_key, read_meta, write_meta
from engine.cpu.kernels import (INT4_GROUP, assigned, format_tensors, route_linears, routed_linears, router_of,
                                standin_tensors)
from engine.measure.costs import (CONTEXTS, PREFIX, REPEATS, describe_pads, machine, model_identity,
                                  probe_ids, read_cached, spans, table_file, table_key, write_json)
from engine.measure.graphed import time_rungs
from engine.measure.quiet import watch_cpu
from engine.runtime import model_device

DRAFT_TOP = 32  # the draft's largest captured forward (a batched level of a wide tree); the target's is MAX_ROWS
PAD_GAIN = 0.95  # a row count runs padded to a larger rung only where that measured at least 5 % cheaper: a smaller
# difference is within a cost table's noise, and padding then buys nothing but doubt


def plan(model, role: str, top: int | None = None) -> list[Recipe]:
    """The packages `model` gets (module docstring): per span of rows on which every shape group keeps one format,
    one row static and the rest of the span dynamic."""
    top = top or (MAX_ROWS if role == "target" else DRAFT_TOP)
    router = router_of(model)
    groups = sorted({layer.group for layer in routed_linears(model)})

    def formats_at(rows: int) -> tuple[tuple[str, str], ...]:
        return tuple((g, router.path(rows, g) if router is not None else "plain") for g in groups)
    recipes, lo = [], 1
    for rows in range(1, top + 1):
        if rows == top or formats_at(rows + 1) != formats_at(rows):
            recipes += _span(lo, rows, formats_at(lo))
            lo = rows + 1
    return recipes


def _span(lo: int, hi: int, formats: tuple[tuple[str, str], ...]) -> list[Recipe]:
    """Packages for rows lo..hi on one assignment of formats: one row static, two or more dynamic (an export needs
    two at least). The format most groups take is the recipe's `path`; the others are named per group."""
    names = [p for _, p in formats] or ["plain"]
    path = max(set(names), key=names.count)
    groups = tuple((g, p) for g, p in formats if p != path)
    out = [Recipe(1, path, groups=groups)] if lo == 1 else []
    lo = max(lo, 2)
    if lo == hi:
        out.append(Recipe(lo, path, groups=groups))
    elif lo < hi:
        out.append(Recipe(lo, path, hi=hi, groups=groups))
    return out


@dataclass
class Package:
    """One loaded package and what it cost."""
    recipe: Recipe
    runner: object
    file: str
    compile_s: float | None  # None: found on disk, compiled by an earlier process
    load_s: float
    bytes: int


@dataclass
class CapturedModel:
    """A model's loaded packages and the row counts each serves (after measuring: only where faster than eager)."""
    packages: list[Package]
    serves: dict[int, Package] = field(default_factory=dict)
    pads: dict[int, int] = field(default_factory=dict)  # n -> the rows it runs as, where padding measured cheaper
    notes: list[str] = field(default_factory=list)

    @property
    def max_rows(self) -> int:
        return max((p.recipe.hi or p.recipe.rows for p in self.packages), default=1)

    def package_for(self, n: int) -> Package | None:
        """The package that would run n rows: the smallest static bucket holding n, else a dynamic range."""
        static = [p for p in self.packages if not p.recipe.dynamic and p.recipe.rows >= n]
        if static:
            return min(static, key=lambda p: p.recipe.rows)
        return next((p for p in self.packages if p.recipe.covers(n)), None)

    @staticmethod
    def rows_of(package: Package, n: int) -> int:
        return n if package.recipe.dynamic else package.recipe.rows

    def route(self, n: int) -> tuple[int, object]:
        package = self.serves.get(n)
        if package is None:
            return n, None
        return self.pads.get(n, self.rows_of(package, n)), package.runner

    def serve_all(self) -> None:
        """Every row count a package can run, unpadded, before measuring (tests, and a forced `on` without a table)."""
        self.serves = {n: p for n in range(1, self.max_rows + 1) if (p := self.package_for(n)) is not None}
        self.pads = {}

    def info(self) -> dict:
        return {"packages": [{"recipe": p.recipe.describe(), "compile_s": p.compile_s, "load_s": p.load_s,
                              "bytes": p.bytes} for p in self.packages],
                "serves": spans(self.serves), "pads": describe_pads(self.pads), "notes": list(self.notes)}


def recipe_key(model, name: str, recipe: Recipe) -> dict:
    """What a package is keyed by: the model (identity, and a weight fingerprint: its norms and biases are frozen
    in), its dtype, the recipe (with the int4 grouping when it is int4), the weight inputs it takes (each linear's
    format), torch and the machine (not its thread count: a package runs on any)."""
    device = model_device(model)
    extra = {"int4_group": INT4_GROUP} if "int4" in recipe.formats().values() else {}
    route_linears(model)
    inputs = hashlib.sha256(str([(layer.group, path) for layer, path in assigned(model, recipe.formats())])
                            .encode()).hexdigest()[:12]
    compiled_for = {k: v for k, v in machine(device).items() if k != "threads"}  # threads are chosen at run time
    return {**package_key(model_identity(model, name), model.dtype, recipe, compiled_for),
            "weights": weights_fingerprint(model), "inputs": inputs, **extra}


def weights_fingerprint(model) -> str:
    """A digest of a strided sample of every parameter: a retrained checkpoint of the same shape gets new packages.
    Taken once, when the model is loaded (`remember_fingerprint`), before a format replaces a plain weight."""
    stored = getattr(model, "treeviz_fingerprint", None)
    if stored is not None:
        return stored
    digest = hashlib.sha256()
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            flat = param.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 64)][:64].float().cpu()
            digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]


def remember_fingerprint(model) -> None:
    model.treeviz_fingerprint = weights_fingerprint(model)


def prepare_model(model, name: str, role: str, progress=None, build_missing: bool = True) -> CapturedModel:
    """Build (where missing, if `build_missing`) and load every package of `plan(model, role)`, each bound to the
    model's own tensors of its format; a package that inductor cannot build, or that is missing where building is
    not this process's business (the app's: its builder declined it, engine/cpu/builder.py), is left out with a
    note (those rows stay eager)."""
    say = progress or (lambda fraction, message: None)
    route_linears(model)  # every linear opaque to the compiler: a plain nn.Linear's weight would be frozen in
    recipes, loaded, notes = plan(model, role), [], []
    for i, recipe in enumerate(recipes):
        key = recipe_key(model, name, recipe)
        file = package_file(key)
        compile_s = None
        if not file.is_file() and not build_missing:
            notes.append(f"{recipe.describe()}: left eager, not built (see the builder's status)")
            continue
        if not file.is_file():
            say(i / len(recipes), f"compiling the {role}'s captured step for {recipe.describe()} (once per machine)")
            try:
                compile_s = build(model, recipe, file, standin_tensors(model, recipe.formats()))
            except Exception as err:  # noqa: BLE001 - inductor's failures (CaptureError among them) are many
                notes.append(f"{recipe.describe()}: left eager, compiling failed ({type(err).__name__}: "
                             f"{str(err)[:160]})")
                continue
            write_meta(file, key, compile_s)
        say((i + 0.9) / len(recipes), f"loading the {role}'s captured step for {recipe.describe()}")
        start = time.perf_counter()
        runner = load(file, format_tensors(model, recipe.formats()))
        loaded.append(Package(recipe, runner, str(file), compile_s, time.perf_counter() - start, file.stat().st_size))
        earlier = read_meta(file).get("compile_s") if compile_s is None else None
        if earlier is not None:
            notes.append(f"{recipe.describe()}: compiled by an earlier process in {earlier:.0f} s")
    return CapturedModel(loaded, notes=notes)


def measure_captured(model, captured: CapturedModel, ladder, prefix: int, repeats: int) -> dict[int, float]:
    """Seconds of a forward of each rung's row count over a `prefix`-token cache through `captured`'s packages
    (each rung its package runs; padded where static), fastest of `repeats` whole sweeps after one warm-up sweep."""
    rungs = [r for r in ladder if captured.package_for(r) is not None]
    saved = captured.serves, captured.pads
    captured.serve_all()
    try:
        ids = probe_ids(model, prefix + max(rungs)).tolist()
        steps = StaticSteps(model, prefix + max(rungs) + 8, (1,), captured=captured)
        return time_rungs(steps, ids, prefix, rungs, repeats)
    finally:
        captured.serves, captured.pads = saved


def captured_table(model, name: str, captured: CapturedModel, recalibrate: bool = False) -> dict[int, dict[int, float]]:
    """{context: {rows: seconds}} of `captured` at PREFIX and every CONTEXTS length: read from the cost cache, where
    the same packages were measured on this machine, else measured and stored there."""
    device = next(model.parameters()).device
    key = {**table_key(model, name, model.dtype, device), "steps": "aoti",
           "packages": sorted(Path(p.file).stem for p in captured.packages)}
    data = None if recalibrate else read_cached(key)
    if data is not None:
        try:
            return {int(c): {int(r): s for r, s in t.items()} for c, t in data["captured"].items()}
        except (ValueError, KeyError, AttributeError):
            pass  # a damaged entry is measured again
    with watch_cpu() as watch:
        table = {c: measure_captured(model, captured, LADDER, c, REPEATS) for c in (PREFIX, *CONTEXTS)}
    if not watch.disturbed:  # a table measured beside other work serves this run only (engine/measure/quiet.py)
        write_json(table_file(key), {"key": key, "captured": {str(c): t for c, t in table.items()},
                                     "measured_at": time.time()})
    return table


def install(table, captured: CapturedModel, seconds: dict[int, dict[int, float]]) -> None:
    """Give the model's cost `table` its captured seconds, and let each row count be served by a package only where
    that measured faster than the fastest eager path: as its own rows, or padded to a larger measured rung where
    that rung measured cheaper by PAD_GAIN (the table then prices what runs take)."""
    table.captured = seconds
    rungs = sorted({r for points in seconds.values() for r in points})
    serves, pads = {}, {}
    for n in range(1, captured.max_rows + 1):
        run = _cheapest_run(table, captured, n, rungs)
        if run is not None and table.captured_time(run[1]) < table.eager_time(n):
            serves[n] = run[0]
            if run[1] != captured.rows_of(run[0], n):
                pads[n] = run[1]
    captured.serves, captured.pads = serves, pads
    table.serves = {n: pads.get(n, captured.rows_of(p, n)) for n, p in serves.items()}


def _cheapest_run(table, captured: CapturedModel, n: int, rungs: list[int]) -> tuple[Package, int] | None:
    """(package, rows it runs) for n rows, or None where no package can: its own package, unless a package running a
    larger measured rung took less than PAD_GAIN of that."""
    package = captured.package_for(n)
    best = (package, captured.rows_of(package, n)) if package is not None else None
    for rung in (r for r in rungs if r > n):
        wider = captured.package_for(rung)
        if wider is None:
            continue
        rows = captured.rows_of(wider, rung)
        if best is None or table.captured_time(rows) < PAD_GAIN * table.captured_time(best[1]):
            best = (wider, rows)
    return best


def prepare_capture(pair, progress=None, recalibrate: bool = False, measure: bool = True,
                    build_missing: bool = True) -> None:
    """CPU pairs with captured steps on (`pair.capture == "aoti"`): build or load both models' packages, measure them
    against the eager table, and install them (`pair.captured`, the cost tables' `serves`). Seconds and memory per
    model land in `pair.capture_info`. The pair's kept static steps are dropped: their routes changed. Without
    `measure` (or a cost table) every package serves every row count it can."""
    if pair.capture != "aoti":
        return
    say = progress or (lambda fraction, message: None)
    roles = [(r, m, n) for r, m, n in (("target", pair.target, pair.target_name), ("draft", pair.draft,
                                                                                  pair.draft_name)) if m is not None]
    for i, (role, model, name) in enumerate(roles):
        share = (lambda f, m, i=i: say((i + f) / len(roles), m))
        rss = _rss()
        captured = prepare_model(model, name, role, share, build_missing)
        if measure and pair.costs is not None and captured.packages:
            say((i + 0.95) / len(roles), f"measuring the {role}'s captured steps (cached after the first time)")
            table = getattr(pair.costs, role)
            install(table, captured, captured_table(model, name, captured, recalibrate))
        else:
            captured.serve_all()
        pair.captured[role] = captured
        pair.capture_info[role] = {**captured.info(), "memory_bytes": max(_rss() - rss, 0)}
    pair.static_steps.clear()
    say(1.0, f"captured steps ready: {pair.describe_capture()}")


def _rss() -> int:
    """This process's resident memory in bytes (0 where /proc says nothing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def format_capture(pair) -> str:
    """Per model: its packages (compile seconds: now, or when an earlier process built them), bytes on disk, the
    memory loading them took, and the row counts they serve."""
    lines = []
    for role, info in pair.capture_info.items():
        packages = info["packages"]
        built = [p["compile_s"] for p in packages if p["compile_s"] is not None]
        disk = sum(p["bytes"] for p in packages) / 2**30
        lines.append(f"captured {role}: {len(packages)} package(s) ({', '.join(p['recipe'] for p in packages)}); "
                     f"{disk:.2f} GiB on disk, {info['memory_bytes'] / 2**30:.2f} GiB of memory to load; "
                     + (f"compiled now in {sum(built):.0f} s; " if built else "")
                     + f"serves rows {info['serves']}"
                     + (f", padded: rows {info['pads']}" if info.get("pads") else ""))
        lines += [f"  {note}" for note in info["notes"]]
    return "\n".join(lines)


# -- what a builder process (engine/cpu/builder.py) still has to compile ---------------------------------------

def missing(pair) -> dict[str, list[Recipe]]:
    """Per model, the packages `plan` wants that are not on disk yet (an empty dict: all built, loading is quick)."""
    if pair.capture != "aoti":
        return {}
    out = {}
    for role, model, name in (("target", pair.target, pair.target_name), ("draft", pair.draft, pair.draft_name)):
        if model is not None:
            todo = [r for r in plan(model, role) if not package_file(recipe_key(model, name, r)).is_file()]
            if todo:
                out[role] = todo
    return out
