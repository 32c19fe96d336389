"""Verification rules side by side under sampling: block efficiency (L̄) and tokens/s, like Tables 2-3 of the
delayed-tree-expansion paper.

    python -m scripts.rules_bench --pair default --temperatures 0.6,1.0 --prompt-set all --max-new-tokens 24 \
        [--limit N] [--json OUT]

Each row is a tree shape with one rule: sampled chains (delayed with K=1, L1=0; linear's cpu preset, a chain drawn
from q that stops below a path probability) under Naive / Block (/ Traversal);
i.i.d. (K, L1, L2) trees under NaiveTree / SpecInfer / SpecTr / Khisti / Traversal; the same trees drawn without
replacement under SpecInfer; DynaTree's deterministic top-k trees under token matching / Traversal. For every prompt,
AR samples at the same temperature right before that prompt's rows (interleaved, so machine drift cancels; warm-up
excluded). Every prompt of the set by default.

For the top-down i.i.d. rules, the "alpha" columns compare the measured chance that the walk descends past the
branching node with the delayed-tree paper's Appendix C rate for that node's own p, q and K (for Khisti: the
Algorithm 10 lower bound of our p/q-tournament selection), averaged over the branching nodes the runs met.
"""
import argparse
import json
import sys
from pathlib import Path


from engine.bench.tables import run_method, summarise, throughput
from engine.core.prompts import PROMPT_SETS, load_prompt_set
from engine.core.sampling import Sampling
from engine.models import PAIRS, load_pair
from engine.verify import VERIFIERS, theory

THEORY = {**theory.ACCEPTANCE, **theory.LOWER_BOUNDS}


def recording(rule: str):
    """The rule, also recording at each i.i.d. branching node (measured descent 0/1, Appendix C rate)."""
    cls = VERIFIERS[rule]
    if rule not in THEORY or not hasattr(cls, "solve"):
        return rule, None
    seen = []

    class Recording(cls):
        def solve(self, tree, p, draws, rng, accept):
            child, token, resampled = super().solve(tree, p, draws, rng, accept)
            node = tree.parents[draws[0][0]]
            if len(draws) > 1 and tree.child_mode.get(node) == "iid":
                descended = child is not None or tree.child_with_token(node, token) is not None
                seen.append((float(descended), THEORY[rule](p, draws[0][1], len(draws))))
            return child, token, resampled
    return Recording(), seen

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
    # linear at T > 0 is speculative sampling: a chain drawn from q, min(1, p/q) and the residual
    ("linear (cpu)", "linear", {}, "naive"),
    ("linear (cpu)", "linear", {}, "block"),
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
    ap.add_argument("--limit", type=int, default=0, help="prompts per set (0: every prompt)")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--trees", help="';'-separated tree labels to run (default: every row), e.g. 'iid (3,2,2)'")
    ap.add_argument("--json", help="write every measurement to this file")
    args = ap.parse_args()
    rows = [r for r in ROWS if not args.trees or r[0] in args.trees.split(";")]
    if not rows:
        ap.error(f"--trees matches no row; the trees are: {'; '.join(dict.fromkeys(r[0] for r in ROWS))}")

    pair = load_pair(*PAIRS[args.pair], dtype=args.dtype)
    sets = list(PROMPT_SETS) if args.prompt_set == "all" else [args.prompt_set]
    prompts = [(s, e["prompt"]) for s in sets for e in load_prompt_set(s)[: args.limit or None]]
    temps = [float(t) for t in args.temperatures.split(",")]
    for _, strategy, params, rule in rows[:1]:  # warm-up, excluded
        run_method(pair, strategy, prompts[0][1], 8, params={strategy: params}, verifier=rule,
                   sampling=Sampling(temperature=temps[0], seed=args.seed))

    table = []
    for t in temps:
        sampling = Sampling(temperature=t, top_p=args.top_p, seed=args.seed)
        ar, outs = [], {i: [] for i in range(len(rows))}
        recorders = [recording(rule) for _, _, _, rule in rows]
        for _, prompt in prompts:  # AR right before this prompt's rows: drift cancels in the ratio
            ar.append(run_method(pair, "ar", prompt, args.max_new_tokens, sampling=sampling))
            for i, (label, strategy, params, rule) in enumerate(rows):
                outs[i].append(run_method(pair, strategy, prompt, args.max_new_tokens, params={strategy: params},
                                          verifier=recorders[i][0], sampling=sampling))
        ar_tps = throughput(ar)
        for i, (label, strategy, params, rule) in enumerate(rows):
            summary = summarise(args.prompt_set, strategy, outs[i], ar_tps)
            seen = recorders[i][1] or []
            row = {"temperature": t, "tree": label, "strategy": strategy, "params": params, "rule": rule,
                   "block_efficiency": summary["mean_tokens_per_iter"], "tokens_per_s": summary["tokens_per_s"],
                   "speedup": summary["speedup"], "ar_tokens_per_s": ar_tps,
                   "iterations": sum(len(o["result"].iterations) for o in outs[i]),
                   "alpha_measured": sum(d for d, _ in seen) / len(seen) if seen else None,
                   "alpha_theory": sum(a for _, a in seen) / len(seen) if seen else None,
                   "branching_nodes": len(seen)}
            table.append(row)
            print(f"T={t:.1f} {label:18s} {rule:15s} L̄={row['block_efficiency']:5.2f} "
                  f"{row['tokens_per_s']:5.2f} tok/s ({row['speedup']:4.2f}× AR {ar_tps:4.2f})",
                  file=sys.stderr, flush=True)

    head = f"{'tree':18s} {'rule':15s}" + "".join(
        f" | T={t:.1f}: {'L̄':>5s} {'tok/s':>6s} {'speedup':>7s} {'alpha':>5s} {'theory':>6s}" for t in temps)
    print(head)
    print("-" * len(head))
    alpha = lambda x: f"{x:5.2f}" if x is not None else "    -"  # noqa: E731
    for label, _, _, rule in rows:
        cells = [r for r in table if r["tree"] == label and r["rule"] == rule]
        print(f"{label:18s} {rule:15s}" + "".join(
            f" |        {r['block_efficiency']:5.2f} {r['tokens_per_s']:6.2f} {r['speedup']:6.2f}× "
            f"{alpha(r['alpha_measured'])} {alpha(r['alpha_theory'])} " for r in cells))
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "rows": table}, indent=1))


if __name__ == "__main__":
    main()
