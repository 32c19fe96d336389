"""Evaluate the delayed-tree neural selector on held-out prompts: tokens/s and L-bar against the best single fixed
(K, L1, L2) and against `delayed`'s presets, with AR decoded on each prompt right before (interleaved).

    python -m scripts.selector_eval --pair default --prompts 2 --tokens 48 --temperatures 0.6 1.0 [--out FILE.md]

The held-out prompts are the last HELD_OUT of each shipped set (scripts/selector_data.py never trains on them). The
best fixed action is the one the training report found by the same estimator (the shipped weights' metadata
`offline_train.best_fixed`: highest summed E[tau + 1] over summed Eq. 11 seconds on the training roots).
For the selector it also prints the mean predicted tokens/s of its choices beside the measured one, and how many
distinct shapes it chose.
"""
from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path


from scripts.experiments import sweep
from scripts.selector_data import split_prompts

from engine.core.prompts import PROMPT_SETS
from engine.core.sampling import Sampling
from engine.models import PAIRS, load_pair
from engine.strategies import selector as neural
from engine.strategies import make_strategy


def configs(rule: str) -> list[tuple]:
    best = tuple(neural.shipped(rule).meta.get("offline_train", {}).get("best_fixed", neural.BASELINE))
    cpu, paper = (make_strategy("delayed", preset).settings for preset in ("cpu", "paper"))
    shape = lambda c: {"k": c.k, "l1": c.l1, "l2": c.l2}  # noqa: E731
    return [("delayed neural", "delayed", {"neural_selector": True}, rule),
            (f"delayed best fixed {best}", "delayed", dict(zip(("k", "l1", "l2"), best)), rule),
            (f"delayed cpu {tuple(shape(cpu).values())}", "delayed", shape(cpu), rule),
            (f"delayed paper {tuple(shape(paper).values())}", "delayed", shape(paper), rule)]


def selector_summary(results) -> str:
    records = [r for result in results for r in result.iterations]
    chosen = Counter((r.params["k"], r.params["l1"], r.params["l2"]) for r in records)
    predicted = [r.selector.predicted_tokens_per_s for r in records
                 if r.selector is not None and r.selector.predicted_tokens_per_s]
    top = ", ".join(f"{a}: {n}" for a, n in chosen.most_common(5))
    mean = f"{sum(predicted) / len(predicted):.2f}" if predicted else "n/a"
    return f"{len(chosen)} distinct shapes over {len(records)} iterations (most chosen {top}); " \
           f"mean predicted tokens/s per iteration {mean}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="default", choices=list(PAIRS))
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompts", type=int, default=2, help="held-out prompts per set (at most 2)")
    ap.add_argument("--sets", nargs="+", default=list(PROMPT_SETS), choices=list(PROMPT_SETS))
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.6, 1.0])
    ap.add_argument("--rule", default="specinfer", choices=list(neural.RULES))
    ap.add_argument("--weights", default=None,
                    help="folder of trained selectors (default: assets/selector/, trained for the default pair)")
    ap.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = ap.parse_args(argv)
    if args.weights:
        neural.WEIGHTS_DIR = Path(args.weights)  # where engine.strategies.selector.shipped() looks

    pair = load_pair(*PAIRS[args.pair], dtype=args.dtype)
    prompts = [prompt for _, prompt in split_prompts("heldout", args.prompts, args.sets)]
    lines = [f"Held-out prompts: {len(prompts)}, {args.tokens} new tokens each, rule {args.rule}, pair {args.pair}, "
             "AR interleaved per prompt.", ""]
    for temperature in args.temperatures:
        sampling = Sampling(temperature=temperature, seed=0)
        rows, runs = sweep(pair, configs(args.rule), prompts, args.tokens, sampling)
        lines += [f"T = {temperature:g} (AR {rows[0]['ar_tokens_per_s']:.2f} tokens/s)", "",
                  "| configuration | tokens/s | speedup | L-bar | acceptance |", "|---|---|---|---|---|"]
        lines += [f"| {r['config']} | {r['tokens_per_s']:.2f} | {r['speedup']:.2f}x | {r['L_bar']:.2f} | "
                  f"{r['acceptance']:.2f} |" for r in rows]
        lines += ["", "selector: " + selector_summary(runs["delayed neural"]), ""]
        print("\n".join(lines[-(len(rows) + 5):]), flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
