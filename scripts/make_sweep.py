"""Precompute one trade-off sweep (engine.bench.sweep) and write it as JSON, for the app to show before any model loads.

    python -m scripts.make_sweep --pair default      # the real offline pair: minutes of CPU; run it on a quiet
                                                    # machine (the measured times are the curve)
    python -m scripts.make_sweep --pair tiny-random --tokens 8 --out /tmp/sweeps   # seconds; what the tests use

The sweep runs the strategy at --points sizes of its size knob (the default range of engine.bench.sweep.size_values) and
AR once, on the first prompt of --kind, greedy, and writes sweep_<kind>_<strategy>.json into --out. The files go in
a subfolder of assets/traces/ because the gallery lists every *.json directly in assets/traces/ as a run trace.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from engine.bench.sweep import DEFAULT_POINTS, run_sweep
from engine.core.prompts import PROMPT_SETS, load_prompt_set
from engine.models import load_pair
from engine.models.devices import machine_label
from engine.recipe import RunSpec, split_pair

OUT_DIR = Path(__file__).resolve().parent.parent / "assets" / "traces" / "sweeps"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="default", help="a pair name (engine.models.PAIRS) or 'TARGET + DRAFT'")
    parser.add_argument("--strategy", default="dynatree", help="a strategy with a size knob")
    parser.add_argument("--kind", default="code", choices=PROMPT_SETS, help="prompt set; its first prompt is used")
    parser.add_argument("--tokens", type=int, default=48, help="max new tokens per run")
    parser.add_argument("--points", type=int, default=DEFAULT_POINTS, help="sizes to sweep")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="folder to write sweep_<kind>_<strategy>.json in")
    parser.add_argument("--no-calibrate", action="store_true",
                        help="skip the cost table (the sweep then has no predicted tokens/s)")
    return parser.parse_args(argv)


def make_sweep(args: argparse.Namespace) -> Path:
    """Load the pair, run the sweep (printing progress), write the JSON; returns its path."""
    target, draft = split_pair(args.pair)
    pair = load_pair(target, draft, calibrate=not args.no_calibrate)
    spec = RunSpec(pair=args.pair, prompt=load_prompt_set(args.kind)[0]["prompt"], strategy=args.strategy,
                   max_new_tokens=args.tokens)
    started, last = time.perf_counter(), None
    for event in run_sweep(pair, spec, points=args.points):
        print(f"  {event['done']}/{event['total']} runs ({time.perf_counter() - started:.0f} s)", flush=True)
        last = event
    sweep = {**last["sweep"], "kind": args.kind, "made_at": time.time(), "machine": machine_label(pair.device)}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"sweep_{args.kind}_{args.strategy}.json"
    path.write_text(json.dumps(sweep, ensure_ascii=False, indent=1))
    print(f"wrote {path} (peak {sweep['param']} = {sweep['peak']})")
    return path


if __name__ == "__main__":
    make_sweep(parse_args())
