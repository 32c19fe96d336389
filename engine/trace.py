"""Per-iteration records and whole-run traces: plain JSON-able data, the only thing the UI and the benchmarks read.

An exported trace replays with no models loaded. SCHEMA_VERSION changes whenever a field changes meaning.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1

# Node outcomes. "rejected": a child of an accepted node that the target did not pick; "unreached": below a
# rejected node, so verification never looked at it; "bonus": the token the target emitted after the accepted path
# (a pseudo-node hung under the last accepted node when it is not itself in the tree).
ROOT, ACCEPTED, BONUS, REJECTED, UNREACHED = "root", "accepted", "bonus", "rejected", "unreached"


@dataclass
class NodeRecord:
    id: int
    parent: int
    token: int
    text: str
    depth: int
    q: float | None          # draft probability of the token given its parent (None: the draft never scored it)
    rank: int | None         # rank among the parent's draft candidates, 0 = most probable
    path_q: float | None     # cumulative draft probability of the root-to-node path
    p: float | None          # target probability of the token given its parent (None for the root)
    status: str
    accept_prob: float | None = None  # probability the verification rule accepted it with (sampling rules)
    resampled: bool = False            # emitted token drawn from a residual distribution
    draws: int = 1                     # i.i.d. draws at the parent this node stands for (merged duplicates)


@dataclass
class IterationRecord:
    index: int
    position: int                        # P: committed tokens before the root
    nodes: list[NodeRecord]
    accepted_path: list[int]             # node ids, root first
    bonus_token: int
    bonus_text: str
    new_tokens: list[int]                # committed this iteration (accepted path + bonus), after stop truncation
    drafted: int                         # drafted nodes (root excluded)
    accepted: int                        # accepted draft tokens (bonus excluded)
    draft_forwards: int
    params: dict[str, Any]               # strategy parameters in force for this iteration
    times: dict[str, float]              # seconds: draft, build, verify, commit, other, total
    extra: dict[str, Any] = field(default_factory=dict)  # strategy-specific signals (e.g. SALF's round sums)

    @property
    def committed(self) -> int:
        return len(self.new_tokens)


@dataclass
class RunResult:
    prompt: str
    prompt_ids: list[int]
    output_ids: list[int]
    output_text: str
    strategy: str
    params: dict[str, Any]
    config: dict[str, Any]               # models, device, dtype, sampling, stopping
    iterations: list[IterationRecord]
    metrics: dict[str, Any]
    stop_reason: str = ""
    comparison: dict[str, Any] | None = None  # vs an AR run of the same prompt: exact_match, first_divergence, ...
    token_sources: list[dict[str, Any]] = field(default_factory=list)  # per output token: iteration, kind

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, **asdict(self)}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), ensure_ascii=False, indent=1))


class TraceError(ValueError):
    """A trace file that cannot be read as a treeviz trace."""


def run_from_dict(data: dict[str, Any]) -> RunResult:
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise TraceError(f"trace schema version {version!r} is not supported (this treeviz reads {SCHEMA_VERSION})")
    try:
        fields = {k: v for k, v in data.items() if k != "schema_version"}
        iterations = []
        for it in fields.pop("iterations"):
            nodes = [NodeRecord(**n) for n in it.pop("nodes")]
            iterations.append(IterationRecord(nodes=nodes, **it))
        return RunResult(iterations=iterations, **fields)
    except (KeyError, TypeError) as err:
        raise TraceError(f"not a treeviz trace: {err}") from None


def load_run(path: str | Path) -> RunResult:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TraceError(f"cannot read trace {path}: {err}") from None
    if not isinstance(data, dict):
        raise TraceError("not a treeviz trace: the file does not hold a JSON object")
    return run_from_dict(data)
