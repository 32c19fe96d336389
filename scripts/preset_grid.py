"""Small parameter sweep for one strategy: throughput relative to AR on a few prompts of each set.

    python -m scripts.preset_grid --pair default --dtype fp32 --strategy dynatree --grid budget=12,24 d_max=6,8 \
        --limit 1 --max-new-tokens 64
    python -m scripts.preset_grid --plan plan.txt   # one "strategy key=v1,v2 key=v1" per line, all in one process

Used to choose the "cpu" presets; prints one line per configuration (speedup per set and their geometric mean,
L-bar, draft forwards, drafted nodes). AR is measured once, in the same process, warm-up excluded.
"""
import argparse
import itertools
import math
from pathlib import Path


from engine.bench.tables import run_method
from engine.core.prompts import PROMPT_SETS, load_prompt_set
from engine.models import PAIRS, load_pair


def parse_grid(items):
    grid = {}
    for item in items:
        key, values = item.split("=", 1)
        grid[key] = [v for v in values.split(",")]
    return grid


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", default="default", choices=list(PAIRS))
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--strategy")
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--grid", nargs="*", default=[])
    ap.add_argument("--plan", help="file of lines 'strategy key=v1,v2 ...' to sweep one after another")
    ap.add_argument("--sets", default=",".join(PROMPT_SETS))
    ap.add_argument("--limit", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    if args.plan:
        plan = [line.split() for line in Path(args.plan).read_text().splitlines() if line.strip()]
        plan = [(words[0], parse_grid(words[1:])) for words in plan if not words[0].startswith("#")]
    elif args.strategy:
        plan = [(args.strategy, parse_grid(args.grid))]
    else:
        ap.error("give --strategy (with --grid) or --plan")

    pair = load_pair(*PAIRS[args.pair], dtype=args.dtype)
    prompts = [(s, e["prompt"]) for s in args.sets.split(",") for e in load_prompt_set(s)[: args.limit]]
    run_method(pair, "ar", prompts[0][1], 4)  # warm-up
    ar = {i: run_method(pair, "ar", p, args.max_new_tokens) for i, (_, p) in enumerate(prompts)}
    for strategy, grid in plan:
        for values in itertools.product(*grid.values()) if grid else [()]:
            params = dict(zip(grid, values))
            line, speedups = [], []
            for i, (set_name, prompt) in enumerate(prompts):
                out = run_method(pair, strategy, prompt, args.max_new_tokens, args.preset, {strategy: params})
                m = out["result"].metrics
                speedup = (out["new_tokens"] / out["total_s"]) / (ar[i]["new_tokens"] / ar[i]["total_s"])
                speedups.append(speedup)
                line.append(f"{set_name}: {speedup:4.2f}x L={m.mean_tokens_per_iter:.2f} "
                            f"fwd={m.mean_draft_forwards:.1f} n={m.mean_drafted:.0f}")
            geo = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
            print(f"{strategy} {params}  geo {geo:4.2f}x | " + " | ".join(line), flush=True)


if __name__ == "__main__":
    main()
