"""Lab probe behind docs/experiments/2026-12-06-zen4.md ("`auto` against the `cpu` preset"): what a verification of
n rows costs in real DynaTree runs, against what the cost table the `auto` sizer prices it with says.

    python -m scripts.lab.verify_rows                    # the app's configuration, 2 prompts per set, 96 tokens
    python -m scripts.lab.verify_rows --envelope         # then `auto` with every table read as its non-decreasing
                                                         # envelope in rows, against the table as measured

The sizer scales the table's verify seconds by one factor per run (measured ÷ predicted); where the table's shape is
wrong (some row counts dearer than runs find them), that choice of tree size follows the error.
"""
import argparse
import collections
import math
import statistics
import time

import engine.measure.costs as costs
from engine.core.prompts import load_prompt_set
from engine.core.trace import BONUS
from engine.cpu.packages import prepare_capture
from engine.measure import ladder
from engine.models import load_pair
from engine.recipe import RunSpec, generate

SETS = ("code", "chat", "prose")


def envelope_interpolate(points, rows):
    """ladder.interpolate over the non-decreasing envelope of `points` (more rows never priced below fewer)."""
    top, out = -math.inf, {}
    for r in sorted(points):
        top = out[r] = max(top, points[r])
    return ladder.interpolate(out, rows)


def runs(pair, prompts, preset, max_new_tokens):
    for prompt in prompts:
        yield generate(pair, RunSpec(pair="default", prompt=prompt, strategy="dynatree", preset=preset,
                                     max_new_tokens=max_new_tokens))


def verify_table(pair, prompts, max_new_tokens) -> None:
    by_rows = collections.defaultdict(list)
    for preset in ("cpu", "auto"):
        for result in runs(pair, prompts, preset, max_new_tokens):
            for rec in result.iterations:
                rows = sum(1 for n in rec.nodes if n.status != BONUS) + 1
                by_rows[rows].append((rec.times.verify, rec.position))
    print("rows  n  measured ms (median)  table ms at median context  ratio")
    for rows in sorted(by_rows):
        seconds = statistics.median(t for t, _ in by_rows[rows]) * 1e3
        context = int(statistics.median(p for _, p in by_rows[rows]))
        table = pair.costs.predict([], rows, context)["verify_s"] * 1e3
        print(f"{rows:4d} {len(by_rows[rows]):3d} {seconds:10.1f} {table:10.1f} {seconds / table:6.2f}")


def envelope_table(pair, prompts, max_new_tokens) -> None:
    for repeat in range(2):
        for name, read in (("as measured", ladder.interpolate), ("envelope", envelope_interpolate)):
            costs.interpolate = read  # the name ModelCosts reads its tables through
            tokens = iterations = 0
            sizes, start = collections.Counter(), time.perf_counter()
            for result in runs(pair, prompts, "auto", max_new_tokens):
                tokens, iterations = tokens + len(result.output_ids), iterations + len(result.iterations)
                sizes.update(r.cost.auto["best_size"] for r in result.iterations
                             if r.cost is not None and (r.cost.auto or {}).get("best_size") is not None)
            print(f"{name}: {tokens / (time.perf_counter() - start):.2f} tok/s, {tokens / iterations:.2f} tokens per "
                  f"iteration, best sizes {sorted(sizes.items())}", flush=True)
    costs.interpolate = ladder.interpolate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-set", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--envelope", action="store_true")
    args = parser.parse_args()
    pair = load_pair("default", "default", draft_quant="auto", draft_vocab="auto", capture="auto")
    prepare_capture(pair, None, False)
    print(pair.describe(), flush=True)
    prompts = [p["prompt"] for s in SETS for p in load_prompt_set(s)[:args.per_set]]
    (envelope_table if args.envelope else verify_table)(pair, prompts, args.max_new_tokens)


if __name__ == "__main__":
    main()
