"""AR baselines: each plain autoregressive run kept per (pair, prompt, settings that change AR, how its forwards
ran), with the time it was measured, so a later run on the same prompt compares against it at once and the page can
say so."""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, replace

from engine.core.trace import Comparison, RunResult
from engine.measure.metrics import compare_outputs
from engine.recipe import RunSpec


@dataclass
class Baseline:
    """AR's result beside a run: measured for this run (`reused` False) or taken from the cache."""
    result: RunResult
    measured_at: float                 # time.time() when AR finished
    reused: bool = False


class ARCache:
    """AR results by (pair, prompt, max new tokens, dtype, sampling), the oldest dropped past `size` entries. At
    temperature 0 AR is greedy, so top-p, top-k and the seed do not change it and are left out of the key."""

    def __init__(self, size: int = 64):
        self.size, self.entries = size, OrderedDict()  # key -> (result, time.time() when measured)

    @staticmethod
    def key(pair_name: str | None, dtype, spec: RunSpec, steps: str = "eager") -> tuple:
        """`steps`: how AR's forwards run (captured or eager): an eager AR never stands in for a captured one."""
        sampling = ((float(spec.temperature), float(spec.top_p), int(spec.top_k), int(spec.seed))
                    if float(spec.temperature) > 0 else (0.0,))
        return (pair_name, spec.prompt_key(), int(spec.max_new_tokens), str(dtype), steps, *sampling)

    def get(self, key: tuple) -> RunResult | None:
        baseline = self.baseline(key)
        return baseline.result if baseline is not None else None

    def baseline(self, key: tuple) -> Baseline | None:
        """The cached AR for `key` as a reused Baseline (None if absent); marks it recently used."""
        if key not in self.entries:
            return None
        self.entries.move_to_end(key)
        result, measured_at = self.entries[key]
        return Baseline(result, measured_at, reused=True)

    def put(self, key: tuple, result: RunResult, measured_at: float | None = None) -> Baseline:
        """Keep `result` (measured just now unless `measured_at` says otherwise) as a fresh Baseline."""
        measured_at = time.time() if measured_at is None else measured_at
        self.entries[key] = (result, measured_at)
        self.entries.move_to_end(key)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return Baseline(result, measured_at, reused=False)

    def __contains__(self, key: tuple) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)


def attach_comparison(result: RunResult, baseline: Baseline) -> None:
    """`result.comparison` against AR (output match, speedup), with where AR's figure came from: `ar_reused`, and
    `ar_measured_at` / `ar_age_s` (when AR was measured, and how long before this comparison)."""
    ar = baseline.result
    if result is ar:
        comparison = Comparison(exact_match=True, first_divergence=None, compared_tokens=len(ar.output_ids),
                                speedup_vs_ar=1.0)
    else:
        comparison = compare_outputs(result, ar)
    result.comparison = replace(comparison, ar_reused=baseline.reused, ar_measured_at=round(baseline.measured_at, 3),
                                ar_age_s=round(max(0.0, time.time() - baseline.measured_at), 3),
                                ar_steps=ar.config.steps)
