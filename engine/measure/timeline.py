"""Teaching numbers read back from a finished run's records: when each output token appeared, how many draft tokens
each iteration accepted, and how unsure the draft was where it branched. Pure Python over engine.core.trace records (no
tensors, no models), so a gallery trace gives them with nothing loaded.

Times are the run's own measurements: the first token appears at the run's TTFT (the prefill), and every later
iteration's committed tokens at the TTFT plus the measured seconds (`IterationRecord.times.total`) of every
iteration up to and including it. The decoder times each iteration from its first draft forward to its commit, so the
only time outside them is the loop between iterations (microseconds): the last token lands within a fraction of a
percent of the run's measured decode time, `metrics.total_s`.
"""
from __future__ import annotations

import math
from typing import Any

from engine.core.trace import IterationRecord, NodeRecord, RunResult
from engine.measure.metrics import compare_outputs

PREFILL, ACCEPTED, BONUS = "prefill", "accepted", "bonus"


def token_timeline(run: RunResult) -> list[dict[str, Any]]:
    """One entry per output token, in output order: {"time_s", "token", "text", "kind", "iteration"}, where kind is
    "prefill" (the first token), "accepted" (a draft token the target kept) or "bonus" (the target's own token)."""
    sources = run.token_sources
    events: list[dict[str, Any]] = []
    clock = float(run.metrics.ttft_s or 0.0)
    if run.output_ids:
        events.append(_event(run, 0, clock, PREFILL, -1))
    # Iteration timers leave out the loop's bookkeeping between iterations (a fraction of a percent on real models,
    # up to ~10 % on tiny ones): spread it over the iterations in proportion to their time, so the last token lands
    # at the measured decode time.
    timed = sum(float(it.times.total) for it in run.iterations)
    total = float(run.metrics.total_s or 0.0)
    stretch = (total - clock) / timed if timed > 0 and total > clock else 1.0
    for it in run.iterations:
        clock += float(it.times.total) * stretch
        for j in range(it.committed):
            i = len(events)
            if i >= len(run.output_ids):
                break
            events.append(_event(run, i, clock, ACCEPTED if j < it.accepted else BONUS, it.index))
    if sources and len(sources) != len(events):  # a trace whose records and sources disagree cannot be replayed
        raise ValueError(f"the run's records commit {len(events)} tokens but its token sources list {len(sources)}")
    return events


def _event(run: RunResult, i: int, time_s: float, kind: str, iteration: int) -> dict[str, Any]:
    """Token i at `time_s`; its text and kind as the engine recorded them in token_sources where they are there."""
    source = run.token_sources[i] if i < len(run.token_sources) else None
    text = source.text if source is not None else None
    if text is None:  # an old trace without per-token text: the token id stands in
        text = f"⟨{run.output_ids[i]}⟩"
    return {"time_s": time_s, "token": run.output_ids[i], "text": text,
            "kind": source.kind if source is not None else kind, "iteration": iteration}


def decode_time(run: RunResult) -> float:
    """The run's measured decode time in seconds (prefill included): engine.measure.metrics's total_s."""
    return float(run.metrics.total_s)


def speedup(run: RunResult, ar: RunResult) -> float | None:
    """How many times faster `run` decoded than the AR run `ar` of the same prompt: engine.measure.metrics's
    speedup_vs_ar (tokens/s over AR's tokens/s), which is AR's decode time ÷ the run's when both wrote the same number
    of tokens."""
    return compare_outputs(run, ar).speedup_vs_ar


# -- how many draft tokens each iteration kept -------------------------------------------------------------------------
def accepted_length_counts(iterations: list[IterationRecord]) -> list[int]:
    """counts[k] = iterations that accepted exactly k draft tokens (bonus excluded), k = 0 .. the longest."""
    counts = [0] * (max((it.accepted for it in iterations), default=-1) + 1)
    for it in iterations:
        counts[it.accepted] += 1
    return counts


# -- the draft's uncertainty where it branched -------------------------------------------------------------------------
def top_k_entropy(entries: list[list]) -> float | None:
    """Entropy in nats of a top-k list [[token, probability, text], ...] as records keep it (NodeRecord.next_q),
    with the probability outside the list lumped into one outcome. Lumping can only lower entropy, so this is a lower
    bound on the full distribution's entropy: exact when the top k hold all the mass. None for an empty list."""
    if not entries:
        return None
    probs = [float(e[1]) for e in entries if float(e[1]) > 0]
    rest = 1.0 - sum(probs)
    if rest > 1e-6:
        probs.append(rest)
    return -sum(p * math.log(p) for p in probs)


def parent_entropies(iteration: IterationRecord) -> dict[int, float | None]:
    """For every node of the iteration, the (top-k truncated) entropy of the draft's q at its parent: how unsure the
    draft was when it proposed this node and its siblings. None for the root, and where the draft did not expand the
    parent (no next_q recorded, e.g. the bonus under a leaf, or a trace older than schema 2)."""
    by_id: dict[int, NodeRecord] = {n.id: n for n in iteration.nodes}
    out: dict[int, float | None] = {}
    for node in iteration.nodes:
        parent = by_id.get(node.parent)
        out[node.id] = top_k_entropy(parent.next_q) if parent is not None else None
    return out
