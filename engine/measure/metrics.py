"""Run metrics, computed from iteration records and wall times. The definitions, written here once (the README, docs/
and ARCHITECTURE.md link to this docstring; the app, the bench and the command line only read these numbers):

- **iteration**: one target verification pass (AR: one target forward, one token).
- **L̄** (`mean_tokens_per_iter`, block efficiency): committed tokens (accepted draft tokens + the bonus token) per
  iteration.
- **ℓ̄** (`mean_accepted_len`): accepted draft-path length per iteration, bonus excluded (L̄ = ℓ̄ + 1).
- **acceptance** (`acceptance_rate`): accepted draft tokens / drafted nodes, over the run.
- **acceptance by source** (`acceptance_by_source[s]`): for the drafted nodes that source s proposed ("model": the
  draft; "lookup": context lookup, engine/core/lookup.py; "both": a lookup continuation through a model node), accepted
  nodes / drafted nodes over the run, with both counts (a SourceAcceptance: drafted, accepted, rate); only sources that
  drafted something appear (a run without lookup has "model" alone).
- **per-depth acceptance** (`per_depth_acceptance[d - 1]`): the fraction of iterations whose accepted length is >= d.
- `mean_drafted`, `mean_draft_forwards`: drafted nodes and draft forwards per iteration.
- **TTFT** (`ttft_s`): prefill + the first new token.
- **TPOT** (`tpot_s`): (total − TTFT) / (T − 1) for T new tokens.
- **tokens/s** (`tokens_per_s`): new tokens / the wall time of the whole generation, prefill included (`total_s`).
  Time a consumer holds a `DecodeRun` between its steps (the app drawing figures) is left out (`DecodeRun.paused_s`).
- **speedup**: tokens/s ÷ AR tokens/s measured in the same process, with the same dtype, attention and stopping rule
  (`compare_outputs`' `speedup_vs_ar`). `python -m engine bench` divides by the faster of its two ARs, the eager one
  and `ar-compiled` (engine/bench/compiled.py); the app and `generate --compare-ar` use the eager AR.
- **exact match** (`compare_outputs`): the output equals AR's token for token; otherwise the first divergence and the
  target's top-2 logit margin there.
- **stage times** (`stage_s`, a StageTimes): seconds per stage summed over iterations: draft, build, verify, commit,
  record, and their total.
- **cost drift** (`cost_drift`): measured ÷ predicted seconds of drafting and of verification over the run, from the
  per-iteration cost records (`IterationRecord.cost`), first iteration left out; beyond ×DRIFT_TOLERANCE either way
  (and at least DRIFT_MIN_ITERATIONS iterations) the cached cost table no longer describes the machine.
- **calibration** (`calibration`): tested nodes binned by draft probability q, against the fraction accepted.
"""
from __future__ import annotations

from typing import Any

from engine.core.trace import (ACCEPTED, REJECTED, STAGES, Comparison, IterationCost, IterationRecord, RunMetrics,
                               RunResult, SourceAcceptance, StageTimes)
# Measured/predicted beyond x1.3 or /1.3 (a tolerance, not a machine constant): the cost table no longer describes the
# machine. Run-to-run noise on a quiet machine stays within ~10 %.
DRIFT_TOLERANCE = 1.3
DRIFT_MIN_ITERATIONS = 4


def run_metrics(iterations: list[IterationRecord], new_tokens: int, total_s: float, ttft_s: float) -> RunMetrics:
    n = len(iterations)
    drafted = sum(it.drafted for it in iterations)
    accepted = [it.accepted for it in iterations]
    max_len = max(accepted, default=0)
    return RunMetrics(
        new_tokens=new_tokens,
        iterations=n,
        total_s=total_s,
        ttft_s=ttft_s,
        tpot_s=(total_s - ttft_s) / (new_tokens - 1) if new_tokens > 1 else None,
        tokens_per_s=new_tokens / total_s if total_s > 0 else None,
        # L-bar: committed tokens (accepted + bonus) per target verification pass.
        mean_tokens_per_iter=sum(it.committed for it in iterations) / n if n else None,
        # l-bar: accepted draft-path length, bonus excluded.
        mean_accepted_len=sum(accepted) / n if n else None,
        acceptance_rate=sum(accepted) / drafted if drafted else None,
        acceptance_by_source=acceptance_by_source(iterations),
        per_depth_acceptance=[sum(a >= d for a in accepted) / n for d in range(1, max_len + 1)] if n else [],
        mean_drafted=drafted / n if n else None,
        mean_draft_forwards=sum(it.draft_forwards for it in iterations) / n if n else None,
        stage_s=stage_sums([it.times for it in iterations]),
        cost_drift=cost_drift(iterations),
    )


def stage_sums(times: list[StageTimes]) -> StageTimes:
    """Seconds per stage summed over iterations (or runs)."""
    return StageTimes(**{f: sum(getattr(t, f) for t in times) for f in (*STAGES, "total")})


SOURCES = ("model", "lookup", "both")


def acceptance_by_source(iterations: list[IterationRecord]) -> dict[str, SourceAcceptance]:
    """Accepted / drafted nodes per proposing source (the docstring's definition); sources with no node left out."""
    counts = {s: [0, 0] for s in SOURCES}
    for it in iterations:
        for node in it.nodes:
            if node.source in counts:
                counts[node.source][0] += 1
                counts[node.source][1] += node.status == ACCEPTED
    return {s: SourceAcceptance(drafted=d, accepted=a, rate=a / d) for s, (d, a) in counts.items() if d}


def lookup_work(iterations: list[IterationRecord]) -> dict[str, float]:
    """The context lookup's own cost and use ({} when no iteration looked anything up): "share", the seconds of its
    index queries and tree building (record.lookup.seconds) over the iterations' total seconds; "alone", the
    fraction of iterations a grafted strategy drafted with the lookup only (engine/strategies/graft.py)."""
    looked = [it for it in iterations if it.lookup is not None]
    total = sum(it.times.total for it in looked)
    if not looked or total <= 0:
        return {}
    return {"share": sum(it.lookup.seconds for it in looked) / total,
            "alone": sum(it.lookup.alone for it in looked) / len(looked)}


def cost_ratios(costs: list[IterationCost]) -> dict[str, float]:
    """Measured ÷ predicted seconds of the draft and of the verification, summed over cost records (the decoder's
    per-iteration `IterationRecord.cost`); a stage nothing was predicted for is left out."""
    sums = {"draft": (sum(c.measured_draft_s for c in costs), sum(c.predicted_draft_s for c in costs)),
            "verify": (sum(c.measured_verify_s for c in costs), sum(c.predicted_verify_s for c in costs))}
    return {stage: measured / predicted for stage, (measured, predicted) in sums.items() if predicted > 0}


def cost_drift(iterations: list[IterationRecord]) -> dict[str, float]:
    """How far a run's measured times are from the cost table's predictions: {"draft": ratio, "verify": ratio,
    "iterations": n}, 1.0 meaning the table describes the machine as it runs now ({} without cost records). The first
    iteration, whose draft forward also reads the prompt, is left out. A table measured in another hour can be off by
    a near-uniform factor: the VMs this runs on drift 15-50 % between hours, a GPU's host-bound steps up to 2×."""
    costs = [c for c in map(drift_evidence, iterations) if c is not None]
    return {**cost_ratios(costs), "iterations": len(costs)} if costs else {}


def drift_evidence(iteration: IterationRecord) -> IterationCost | None:
    """The iteration's cost record where it can tell drift: none for the first iteration, whose draft forward also
    reads the prompt, or for an iteration without one."""
    return iteration.cost if iteration.index > 0 else None


def drift_off(drift: dict[str, float]) -> str:
    """The stages off the table beyond DRIFT_TOLERANCE, e.g. "draft 1.45×, verify 1.32×" ("": none, or too few
    iterations to say)."""
    if drift.get("iterations", 0) < DRIFT_MIN_ITERATIONS:
        return ""
    return ", ".join(f"{stage} {ratio:.2f}×" for stage, ratio in drift.items()
                     if stage != "iterations" and not 1 / DRIFT_TOLERANCE <= ratio <= DRIFT_TOLERANCE)


def drift_warning(drift: dict[str, float]) -> str | None:
    """A sentence for the user when a run's times are off the cost table by more than DRIFT_TOLERANCE."""
    ratios = drift_off(drift)
    if not ratios:
        return None
    return (f"measured times are {ratios} the cost table's: the machine's speed has changed since the table was "
            "measured (python -m engine costs --recalibrate measures it again). auto presets correct for this as "
            "they run, and speedups stay valid because AR runs on the same machine.")


def compare_outputs(run: RunResult, reference: RunResult) -> Comparison:
    """Does `run` reproduce `reference` (an AR run of the same prompt) token for token? If not, where first, and how
    close the target's top-2 logits were there (a near-tie explains a bf16/fp16 flip)."""
    a, b = run.output_ids, reference.output_ids
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), None)
    if first is None and len(a) != len(b):
        first = n
    out = Comparison(exact_match=first is None, first_divergence=first, compared_tokens=n)
    if first is not None:
        if first < len(reference.token_sources):
            out.reference_margin = reference.token_sources[first].margin
        if first < len(run.token_sources):
            out.run_margin = run.token_sources[first].margin
    if reference.metrics.tokens_per_s and run.metrics.tokens_per_s:
        out.speedup_vs_ar = run.metrics.tokens_per_s / reference.metrics.tokens_per_s
    return out


def calibration(iterations: list[IterationRecord], bins: int = 10) -> list[dict[str, Any]]:
    """DySpec's Hypothesis 1 (a draft token's chance of acceptance is about its draft probability q), measured: every
    node the verification tested binned by q into equal bins on [0, 1], with the fraction accepted. Bins with no node
    are left out. Tested: accepted or rejected (unreached nodes were never looked at); under a sampling rule, which
    records the acceptance probability of every node it tests, a rejected sibling without one was never tried (an
    earlier sibling was accepted first)."""
    counts = [[0, 0, 0.0] for _ in range(bins)]  # tested, accepted, sum of q
    for it in iterations:
        sampled = any(node.accept_prob is not None for node in it.nodes)
        for node in it.nodes:
            tested = node.status == ACCEPTED or (node.status == REJECTED and
                                                 (not sampled or node.accept_prob is not None))
            if tested and node.q is not None:
                cell = counts[min(int(node.q * bins), bins - 1)]
                cell[0] += 1
                cell[1] += node.status == ACCEPTED
                cell[2] += node.q
    return [{"lo": i / bins, "hi": (i + 1) / bins, "nodes": n, "accepted": a / n, "mean_q": q / n}
            for i, (n, a, q) in enumerate(counts) if n]
