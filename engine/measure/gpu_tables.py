"""GPU cost tables: what each forward of one model pair costs on one GPU, measured there, read anywhere.

    tables = shipped()                                   # every table in assets/gpu/*.json, validated
    table = find(tables, run.config.target, run.config.draft)
    prediction = predict(table, run.iterations)          # the run's own trees priced on that GPU

`python -m scripts.gpu_check` writes one file per shape pair into its --out folder (`save`); a table is shipped by
copying it into assets/gpu/. It holds the forwards as runs take them there (`steps`: "cuda-graphs", one graph per
row count; the cost of a forward depends on the shapes, not the weights, so random models of the published shapes
stand in for the real ones: engine/models/shapes.py). The file (schema "treeviz-gpu-costs", version 1):

    gpu          str    torch.cuda.get_device_name(), e.g. "NVIDIA H100 80GB HBM3"
    measured     str    the date, YYYY-MM-DD
    torch        str    torch.__version__ there;  transformers: the same for transformers
    dtype        str    "bfloat16", ...
    steps        str    how the forwards ran: "cuda-graphs" (a CPU dry run writes "eager": never ship that)
    prefix       int    cached tokens before each timed forward
    target       str    the target's shape name (`shape:NAME`), matched against a run's model names word by word
    draft        str    the draft's
    seconds      {"target": {rows: s}, "draft": {rows: s}}   one forward of `rows` rows (the ladder's rungs; "1" needed)
    c            float  seconds.draft["1"] / seconds.target["1"]
    t            {rows: float}   seconds.target[rows] / seconds.target["1"], the same rungs as seconds.target
    overhead_s   float | null   an iteration's measured seconds beyond its forwards' table prices there (~16 nodes)
    source       str    which report the numbers come from

Row counts are JSON string keys. `c` and `t` repeat what `seconds` says (for a reader of the file); `parse` checks that
they agree. A prediction prices each iteration as its draft forwards at their row counts plus one verification
(linear between rungs, engine/measure/costs.py `interpolate`), plus `overhead_s`, against AR's one-row step for the
same tokens: the performance model of ARCHITECTURE.md with the GPU's c and t(n) and the run's own trees and L.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from datetime import date
from functools import lru_cache
from pathlib import Path

from engine.measure.ladder import interpolate

SCHEMA, VERSION = "treeviz-gpu-costs", 1
GPU_DIR = Path(__file__).resolve().parents[2] / "assets" / "gpu"
_TEXT = ("gpu", "measured", "torch", "transformers", "dtype", "steps", "target", "draft", "source")
_AGREE = 1e-3  # relative tolerance of c and t against the seconds they repeat


class GpuTableError(ValueError):
    """A GPU table file that does not follow the schema (the message names the file and the field)."""


@dataclass(frozen=True)
class GpuTable:
    gpu: str
    measured: str
    torch: str
    transformers: str
    dtype: str
    steps: str
    prefix: int
    target: str
    draft: str
    target_s: dict[int, float]
    draft_s: dict[int, float]
    overhead_s: float | None
    source: str
    file: str = ""

    @property
    def label(self) -> str:
        return f"prediction for {self.gpu}, measured {self.measured}"

    @property
    def pair(self) -> str:
        return f"{self.target} + {self.draft}"

    @property
    def c(self) -> float:
        return self.draft_s[1] / self.target_s[1]

    def t(self, rows: int) -> float:
        return interpolate(self.target_s, rows) / self.target_s[1]

    def matches(self, target_name: str, draft_name: str) -> bool:
        """Whether a run of `target_name` + `draft_name` has these shapes (every word of each shape name is a word
        of the model's name: "qwen2.5-1.5b" matches "Qwen2.5-Coder-1.5B-Instruct (GGUF, offline)")."""
        return _words(self.target) <= _words(target_name) and _words(self.draft) <= _words(draft_name)

    def iteration_s(self, draft_rows: list[int], verify_rows: int) -> float:
        """One iteration's forwards on this GPU, plus the measured overhead when the table has it."""
        forwards = sum(interpolate(self.draft_s, r) for r in draft_rows) + interpolate(self.target_s, verify_rows)
        return forwards + (self.overhead_s or 0.0)

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "version": VERSION, **{k: getattr(self, k) for k in _TEXT},
                "prefix": self.prefix, "seconds": {"target": _keyed(self.target_s), "draft": _keyed(self.draft_s)},
                "c": self.c, "t": {str(r): self.t(r) for r in sorted(self.target_s)},
                "overhead_s": self.overhead_s}


def _words(name: str) -> set[str]:
    return set(re.split(r"[\s\-_,()/]+", str(name).lower())) - {""}


def _keyed(seconds: dict[int, float]) -> dict[str, float]:
    return {str(r): s for r, s in sorted(seconds.items())}


# -- reading and checking ----------------------------------------------------------------------------------------------

def parse(data: dict, file: str = "<table>") -> GpuTable:
    """A GpuTable from a file's JSON, or GpuTableError saying which field breaks the schema."""
    def fail(why: str):
        raise GpuTableError(f"{file}: {why}")

    if not isinstance(data, dict) or data.get("schema") != SCHEMA or data.get("version") != VERSION:
        fail(f"not a {SCHEMA} table of version {VERSION}")
    for key in _TEXT:
        if not isinstance(data.get(key), str) or not data[key].strip():
            fail(f"{key!r} must be a non-empty string")
    try:
        date.fromisoformat(data["measured"])
    except ValueError:
        fail(f"'measured' must be a date YYYY-MM-DD, not {data['measured']!r}")
    if not isinstance(data.get("prefix"), int) or data["prefix"] < 1:
        fail("'prefix' must be a positive integer")
    seconds = data.get("seconds")
    if not isinstance(seconds, dict):
        fail("'seconds' must hold 'target' and 'draft'")
    target, draft = (_rungs(seconds.get(role), f"seconds.{role}", fail) for role in ("target", "draft"))
    _agrees(data.get("c"), draft[1] / target[1], "c", fail)
    t = _rungs(data.get("t"), "t", fail)
    if set(t) != set(target):
        fail("'t' must have the rungs of seconds.target")
    for rows, value in t.items():
        _agrees(value, target[rows] / target[1], f"t[{rows}]", fail)
    overhead = data.get("overhead_s")
    if overhead is not None and (not isinstance(overhead, (int, float)) or not 0 <= overhead < math.inf):
        fail("'overhead_s' must be null or a non-negative number")
    return GpuTable(**{k: data[k] for k in _TEXT}, prefix=data["prefix"], target_s=target, draft_s=draft,
                    overhead_s=None if overhead is None else float(overhead), file=file)


def _rungs(points, name: str, fail) -> dict[int, float]:
    """{rows: positive finite number} from JSON's string keys; rung 1 required."""
    if not isinstance(points, dict) or not points:
        fail(f"{name!r} must map row counts to numbers")
    out = {}
    for key, value in points.items():
        if not str(key).isdigit() or int(key) < 1:
            fail(f"{name!r}: {key!r} is not a positive row count")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            fail(f"{name!r}[{key}] must be a positive number, not {value!r}")
        out[int(key)] = float(value)
    if 1 not in out:
        fail(f"{name!r} must have the one-row rung '1'")
    return out


def _agrees(value, expected: float, name: str, fail) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isclose(value, expected,
                                                                                           rel_tol=_AGREE):
        fail(f"{name!r} is {value!r} but the seconds say {expected:.6g}")


def load(path: str | Path) -> GpuTable:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise GpuTableError(f"{path.name}: not readable JSON ({err})") from None
    return parse(data, path.name)


def load_tables(directory: str | Path = GPU_DIR) -> list[GpuTable]:
    """Every *.json in `directory` (none: an empty list), by file name; GpuTableError on the first invalid one."""
    directory = Path(directory)
    return [load(p) for p in sorted(directory.glob("*.json"))] if directory.is_dir() else []


@lru_cache(maxsize=1)
def _shipped() -> tuple[GpuTable, ...]:
    return tuple(load_tables(GPU_DIR))


def shipped() -> list[GpuTable]:
    """The tables shipped with the app (assets/gpu/), read once per process."""
    return list(_shipped())


def save(table: GpuTable, path: str | Path) -> Path:
    """Write `table` as a schema file (checked by reading it back the way `load` does)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = table.to_dict()
    parse(json.loads(json.dumps(data)), path.name)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def find(tables: list[GpuTable], target_name: str | None, draft_name: str | None) -> GpuTable | None:
    """The first table whose shapes match the run's target and draft (None: no table for that pair)."""
    if not target_name or not draft_name:
        return None
    return next((t for t in tables if t.matches(target_name, draft_name)), None)


# -- a run's trees priced on a GPU -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Prediction:
    iterations: int
    tokens: int                 # committed by those iterations
    seconds: float              # their draft forwards + verifications (+ overhead) on the GPU
    ar_seconds: float           # AR for the same tokens: one one-row target step each
    per_iteration: list[float]  # seconds of each iteration on the GPU
    estimated: int              # iterations without a cost record: rows estimated from the tree (older traces)

    @property
    def speedup(self) -> float:
        return self.ar_seconds / self.seconds if self.seconds > 0 else 0.0


def iteration_rows(record) -> tuple[list[int], int, bool]:
    """(rows of each draft forward, verified rows, estimated?) of one IterationRecord: from its cost record, else
    its drafted nodes spread evenly over its draft forwards, and the drafted nodes + the root verified."""
    if record.cost is not None:
        return list(record.cost.draft_rows), int(record.cost.verify_rows), False
    forwards, drafted = int(record.draft_forwards), int(record.drafted)
    rows = [drafted // forwards + (i < drafted % forwards) for i in range(forwards)] if forwards else []
    return [r for r in rows if r > 0] or ([1] * forwards), drafted + 1, True


def predict(table: GpuTable, iterations) -> Prediction:
    """`iterations` (a run's IterationRecords) priced by `table`, against AR's one-row step for the same tokens."""
    per, tokens, estimated = [], 0, 0
    for record in iterations:
        draft_rows, verify_rows, guessed = iteration_rows(record)
        per.append(table.iteration_s(draft_rows, verify_rows))
        tokens += len(record.new_tokens)
        estimated += guessed
    return Prediction(len(per), tokens, sum(per), tokens * table.target_s[1], per, estimated)
