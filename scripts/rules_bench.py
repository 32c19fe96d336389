"""Verification rules side by side under sampling: block efficiency (L̄) and tokens/s, like Tables 2-3 of the
delayed-tree-expansion paper.

    python scripts/rules_bench.py --pair default --temperatures 0.6,1.0 --prompt-set all --limit 1 \
        --max-new-tokens 48 [--json OUT]

Each row is a tree shape with one rule: sampled chains (delayed with K=1, L1=0) under Naive / Block / Traversal;
i.i.d. (K, L1, L2) trees under NaiveTree / SpecInfer / SpecTr / Khisti / Traversal; the same trees drawn without
replacement under SpecInfer; DynaTree's deterministic top-k trees under token matching / Traversal. AR samples at
the same temperature in the same process (warm-up excluded), so speedups are like for like.
"""
import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.bench import run_method, summarise, throughput  # noqa: E402
from engine.models import PAIRS, load_pair  # noqa: E402
from engine.prompts import PROMPT_SETS, load_prompt_set  # noqa: E402
from engine.sampling import Sampling  # noqa: E402

CHAIN = {"k": 1, "l1": 0, "l2": 4}
IID = {"k": 3, "l1": 2, "l2": 2, "greedy_trunk": False}  # the paper's sampled trunk
ROWS = [  # (label, strategy, params, rule)
    ("chain L=4", "delayed", CHAIN, "naive"),
    ("chain L=4", "delayed", CHAIN, "block"),
    ("chain L=4", "delayed", CHAIN, "traversal"),
    ("iid (3,2,2)", "delayed", IID, "naive_tree"),
    ("iid (3,2,2)", "delayed", IID, "specinfer"),
    ("iid (3,2,2)", "delayed", IID, "spectr"),
    ("iid (3,2,2)", "delayed", IID, "khisti"),
    ("iid (3,2,2)", "delayed", IID, "traversal"),
    ("w/o repl. (3,2,2)", "delayed", {**IID, "without_replacement": True}, "specinfer"),
    ("top-k DynaTree", "dynatree", {}, "token_matching"),
    ("top-k DynaTree", "dynatree", {}, "traversal"),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="default", choices=list(PAIRS))
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--temperatures", default="0.6,1.0")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-set", default="all", help="code | chat | prose | all")
    ap.add_argument("--limit", type=int, default=1, help="prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--json", help="write every measurement to this file")
    args = ap.parse_args()

    pair = load_pair(*PAIRS[args.pair], dtype=args.dtype)
    sets = list(PROMPT_SETS) if args.prompt_set == "all" else [args.prompt_set]
    prompts = [(s, e["prompt"]) for s in sets for e in load_prompt_set(s)[: args.limit]]
    temps = [float(t) for t in args.temperatures.split(",")]
    for _, strategy, params, rule in ROWS[:1] + ROWS[-2:-1]:  # warm-up, excluded
        run_method(pair, strategy, prompts[0][1], 8, params={strategy: params}, verifier=rule,
                   sampling=Sampling(temperature=temps[0], seed=args.seed))

    table = []
    for t in temps:
        sampling = Sampling(temperature=t, top_p=args.top_p, seed=args.seed)
        ar = [run_method(pair, "ar", p, args.max_new_tokens, sampling=sampling) for _, p in prompts]
        ar_tps = throughput(ar)
        for label, strategy, params, rule in ROWS:
            outs = [run_method(pair, strategy, p, args.max_new_tokens, params={strategy: params}, verifier=rule,
                               sampling=sampling) for _, p in prompts]
            summary = summarise(args.prompt_set, strategy, outs, ar_tps)
            row = {"temperature": t, "tree": label, "strategy": strategy, "params": params, "rule": rule,
                   "block_efficiency": summary["mean_tokens_per_iter"], "tokens_per_s": summary["tokens_per_s"],
                   "speedup": summary["speedup"], "ar_tokens_per_s": ar_tps,
                   "iterations": sum(len(o["result"].iterations) for o in outs)}
            table.append(row)
            print(f"T={t:.1f} {label:18s} {rule:15s} L̄={row['block_efficiency']:5.2f} "
                  f"{row['tokens_per_s']:5.2f} tok/s ({row['speedup']:4.2f}× AR {ar_tps:4.2f})",
                  file=sys.stderr, flush=True)

    head = f"{'tree':18s} {'rule':15s}" + "".join(f" | T={t:.1f}: {'L̄':>5s} {'tok/s':>6s} {'speedup':>7s}"
                                                  for t in temps)
    print(head)
    print("-" * len(head))
    for label, _, _, rule in ROWS:
        cells = [r for r in table if r["tree"] == label and r["rule"] == rule]
        print(f"{label:18s} {rule:15s}" + "".join(
            f" |        {r['block_efficiency']:5.2f} {r['tokens_per_s']:6.2f} {r['speedup']:6.2f}×" for r in cells))
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "rows": table}, indent=1))


if __name__ == "__main__":
    main()
