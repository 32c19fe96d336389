"""Per-iteration records and whole-run traces: typed dataclasses that serialise to plain JSON, the only thing the UI
and the benchmarks read (by field; keys appear only in `to_dict` and `run_from_dict`).

An exported trace replays with no models loaded. SCHEMA_VERSION changes whenever a field is added or changes meaning,
so an older reader refuses a newer trace with a plain message instead of a confusing field error; this reader reads
every version in READABLE (fields a version lacks take their defaults).
"""
from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any

from engine.core.reports import LookupReport, SelectorChoice

# 2: NodeRecord.next_p / next_q (top-k next-token distributions per expanded node); 3: IterationRecord.cost (was
# extra["cost"], converted on load); 4: NodeRecord.source (older traces: "model", the root "root"); 5:
# IterationRecord.lookup and .selector (were extra["lookup_s" / "lookup_only" / "lookup_match" / "lookup_match_leaf"]
# and extra["selector"], converted on load); 6: the run's metrics, config, comparison, token sources and each
# iteration's times are typed (RunMetrics, RunConfig, Comparison, TokenSource, StageTimes); the JSON keeps the field
# names, metrics["stage_s"] gains "total", and a field an older trace lacks loads as its default (None where optional);
# 7: the stage "other" is "record", named for the method it times (older traces' "other" loads as "record")
SCHEMA_VERSION = 7
READABLE = (1, 2, 3, 4, 5, 6, 7)
TOP_K = 10  # entries in NodeRecord.next_p / next_q

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
    # The next-token distributions after this node, top TOP_K entries as [token, probability, text]: the target's p
    # (as the rule saw it) wherever the target scored this node's children or bonus, the draft's q where the draft
    # expanded it. Empty elsewhere (and in traces older than schema 2).
    next_p: list[list] = field(default_factory=list)
    next_q: list[list] = field(default_factory=list)
    # Who proposed the node: "model" (the draft), "lookup" (context lookup, engine/core/lookup.py), "both" (a lookup
    # continuation through a model node), "root"; the bonus pseudo-node: "target".
    source: str = "model"


# NodeRecord fields with defaults: a compact trace leaves them out where they hold the default
NODE_DEFAULTS = {f.name: f.default if f.default is not MISSING else f.default_factory()
                 for f in dataclass_fields(NodeRecord) if f.default is not MISSING or f.default_factory is not MISSING}


@dataclass
class IterationCost:
    """An iteration's draft and verify seconds as the measured cost table predicted them (engine/measure/costs.py),
    beside the seconds they took: the cost panel, the drift check and the `auto` sizer read them."""
    draft_rows: list[int]                # rows of each draft forward
    verify_rows: int                     # rows of the target's verification forward
    predicted_draft_s: float
    predicted_verify_s: float
    predicted_s: float                   # draft + verify
    measured_draft_s: float
    measured_verify_s: float
    measured_s: float                    # draft + verify
    auto: dict[str, Any] | None = None   # the `auto` preset's choice of the next size (engine/measure/autosize.py)


def known(cls, data: dict[str, Any] | None):
    """`cls` from a plain dict as a trace stores it: keys `cls` has no field for are dropped (an older or newer
    writer's), fields the dict lacks take their defaults."""
    names = {f.name for f in dataclass_fields(cls)}
    return cls(**{k: v for k, v in (data or {}).items() if k in names})


STAGES = ("draft", "build", "verify", "commit", "record")  # StageTimes' parts; total is their sum


@dataclass
class StageTimes:
    """Seconds of an iteration's stages (IterationRecord.times), or their sums over a run (RunMetrics.stage_s):
    drafting, tree building (the draft's seconds taken out), verification, the caches' commit of the accepted
    rows, the iteration's record; `total` = their sum, the iteration's wall time."""
    draft: float = 0.0
    build: float = 0.0
    verify: float = 0.0
    commit: float = 0.0
    record: float = 0.0
    total: float = 0.0

    @classmethod
    def from_dict(cls, data: dict[str, float] | None) -> StageTimes:
        """Schema < 6 run sums had no "total": it is the sum of the stages; schema < 7 called "record" "other"."""
        if data is not None and "other" in data:
            data = {("record" if k == "other" else k): v for k, v in data.items()}
        times = known(cls, data)
        if data is not None and "total" not in data:
            times.total = sum(getattr(times, stage) for stage in STAGES)
        return times


@dataclass
class TokenSource:
    """Where one output token came from: the iteration that committed it (-1: the prefill), how ("prefill",
    "accepted", "bonus"), the target's top-1 minus top-2 logit there, its text (None: a trace too old to record it)."""
    iteration: int
    kind: str
    margin: float | None = None
    text: str | None = None


@dataclass
class RunSampling:
    """The sampling settings a run ran with, as engine/core/sampling.py's Sampling holds them (a plain copy: the
    trace stays a leaf of engine.core)."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RunConfig:
    """What a run ran with: models, how their forwards ran, device, sampling, stopping. Fields an older trace did
    not record load as their defaults."""
    target: str | None = None
    draft: str | None = None             # None: a strategy with no draft model
    steps: str = "eager"                 # "eager", "CUDA graphs", "captured (AOTInductor)"
    device: str = ""
    dtype: str = ""
    machine: str | None = None
    verifier: str = ""
    sampling: RunSampling = field(default_factory=RunSampling)
    max_new_tokens: int | None = None
    stop_on_eos: bool = True
    stop_strings: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> RunConfig:
        config = known(cls, data)
        if isinstance(config.sampling, dict):
            config.sampling = known(RunSampling, config.sampling)
        return config


@dataclass
class SourceAcceptance:
    """Drafted and accepted nodes of one proposing source over a run (RunMetrics.acceptance_by_source)."""
    drafted: int
    accepted: int
    rate: float


@dataclass
class RunMetrics:
    """A run's numbers, defined once in engine/measure/metrics.py (run_metrics builds them). None: undefined for this
    run (tokens/s of a zero-second run, acceptance of a run that drafted nothing, speedup of a run not compared)."""
    new_tokens: int = 0
    iterations: int = 0
    total_s: float = 0.0
    ttft_s: float = 0.0
    tpot_s: float | None = None
    tokens_per_s: float | None = None
    mean_tokens_per_iter: float | None = None
    mean_accepted_len: float | None = None
    acceptance_rate: float | None = None
    acceptance_by_source: dict[str, SourceAcceptance] = field(default_factory=dict)  # only sources that drafted
    per_depth_acceptance: list[float] = field(default_factory=list)
    mean_drafted: float | None = None
    mean_draft_forwards: float | None = None
    stage_s: StageTimes = field(default_factory=StageTimes)
    cost_drift: dict[str, float] = field(default_factory=dict)  # {"draft": ratio, "verify": ratio, "iterations": n}
    speedup_vs_ar: float | None = None   # set by the bench (engine/bench/tables.py), which compares every method

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> RunMetrics:
        metrics = known(cls, data)
        metrics.stage_s = StageTimes.from_dict(metrics.stage_s if isinstance(metrics.stage_s, dict) else None)
        metrics.acceptance_by_source = {s: known(SourceAcceptance, a) for s, a in metrics.acceptance_by_source.items()}
        return metrics


@dataclass
class Comparison:
    """A run against an AR run of the same prompt (engine/measure/metrics.py compare_outputs), with where AR's
    figure came from where the app or the bench recorded it."""
    exact_match: bool = False
    first_divergence: int | None = None  # first differing token; None when equal
    compared_tokens: int = 0
    reference_margin: float | None = None  # AR's top-2 logit margin at the divergence
    run_margin: float | None = None
    speedup_vs_ar: float | None = None   # None where either run has no tokens/s
    # the app's AR cache (treeviz/serving/ar_cache.py): reused, when measured, how long ago
    ar_reused: bool | None = None
    ar_measured_at: float | None = None
    ar_age_s: float | None = None
    ar_steps: str | None = None
    runs_each: int | None = None         # the bench: runs per method, and AR's tokens/s it divided by
    ar_tokens_per_s: float | None = None


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
    times: StageTimes                    # seconds: draft, build, verify, commit, record, total
    extra: dict[str, Any] = field(default_factory=dict)  # strategy-specific signals (e.g. SALF's round sums)
    cost: IterationCost | None = None    # None without a cost table
    lookup: LookupReport | None = None   # the context lookup's work, where a lookup drafted (engine/core/reports.py)
    selector: SelectorChoice | None = None  # the delayed tree's neural selector's choice, where it chose

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
    config: RunConfig                    # models, device, dtype, sampling, stopping
    iterations: list[IterationRecord]
    metrics: RunMetrics
    stop_reason: str = ""
    comparison: Comparison | None = None  # vs an AR run of the same prompt
    token_sources: list[TokenSource] = field(default_factory=list)  # per output token

    def to_dict(self, compact: bool = False) -> dict[str, Any]:
        """Plain data; `compact` leaves out node fields at their defaults (they load back as defaults)."""
        data = {"schema_version": SCHEMA_VERSION, **asdict(self)}
        if compact:
            for it in data["iterations"]:
                it["nodes"] = [{k: v for k, v in node.items() if k not in NODE_DEFAULTS or NODE_DEFAULTS[k] != v}
                               for node in it["nodes"]]
        return data

    def to_json(self, compact: bool = False) -> str:
        if compact:
            return json.dumps(self.to_dict(compact=True), ensure_ascii=False, separators=(",", ":"))
        return json.dumps(self.to_dict(), ensure_ascii=False, indent=1)

    def save(self, path: str | Path, compact: bool = False) -> None:
        Path(path).write_text(self.to_json(compact))


class TraceError(ValueError):
    """A trace file that cannot be read as a treeviz trace."""


def run_from_dict(data: dict[str, Any]) -> RunResult:
    version = data.get("schema_version")
    if version not in READABLE:
        raise TraceError(f"trace schema version {version!r} is not supported (this treeviz reads "
                         f"{', '.join(map(str, READABLE))})")
    try:
        fields = {k: v for k, v in data.items() if k != "schema_version"}
        iterations = []
        for it in fields.pop("iterations"):
            nodes = [NodeRecord(**n) for n in it.pop("nodes")]
            if version < 4:  # no sources recorded: every drafted node came from the model
                for node in nodes:
                    node.source = ROOT if node.parent < 0 else "target" if node.status == BONUS else "model"
            cost = it.pop("cost", None) if version >= 3 else it.get("extra", {}).pop("cost", None)
            cost = IterationCost(**cost) if cost is not None else None
            lookup, selector = (it.pop("lookup", None), it.pop("selector", None)) if version >= 5 else reports_of(it)
            times = StageTimes.from_dict(it.pop("times"))
            iterations.append(IterationRecord(nodes=nodes, cost=cost, lookup=LookupReport(**lookup) if lookup else None,
                                              selector=SelectorChoice(**selector) if selector else None, times=times,
                                              **it))
        comparison = fields.pop("comparison", None)
        return RunResult(iterations=iterations, config=RunConfig.from_dict(fields.pop("config")),
                         metrics=RunMetrics.from_dict(fields.pop("metrics")),
                         comparison=known(Comparison, comparison) if comparison is not None else None,
                         token_sources=[known(TokenSource, t) for t in fields.pop("token_sources", [])], **fields)
    except (KeyError, TypeError, AttributeError, ValueError) as err:
        raise TraceError(f"not a treeviz trace: {err}") from None


def reports_of(iteration: dict[str, Any]) -> tuple[dict | None, dict | None]:
    """A schema < 5 iteration's lookup report and selector choice, taken out of its `extra` (fields of those names,
    which such a schema did not have, are ignored)."""
    iteration.pop("lookup", None), iteration.pop("selector", None)
    extra = iteration.get("extra", {})
    selector = extra.pop("selector", None)
    if "lookup_s" not in extra:
        return None, selector
    lookup = {"seconds": extra.pop("lookup_s"), "alone": bool(extra.pop("lookup_only", False)),
              "match": extra.pop("lookup_match", 0), "match_leaf": extra.pop("lookup_match_leaf", None)}
    return lookup, selector


def load_run(path: str | Path) -> RunResult:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TraceError(f"cannot read trace {path}: {err}") from None
    if not isinstance(data, dict):
        raise TraceError("not a treeviz trace: the file does not hold a JSON object")
    return run_from_dict(data)
