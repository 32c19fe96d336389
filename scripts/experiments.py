"""The source papers' experiments at this machine's scale, one subcommand each. Every experiment writes
OUT/<name>.md (a markdown table, with the command and settings that made it) and OUT/<name>.html (a Plotly figure).

    python -m scripts.experiments ablation     --out runs/exp   # DynaTree Table 4 + its D0 / B_max / tau sweeps
    python -m scripts.experiments calibration  --out runs/exp   # DySpec Hypothesis 1: draft q against acceptance
    python -m scripts.experiments delayed      --out runs/exp   # delayed-tree Figure 1: L-bar against K and L per rule
    python -m scripts.experiments salf         --out runs/exp   # SALF Table 4: the threshold sweep
    python -m scripts.experiments ddtree       --out runs/exp   # DDTree: the node-budget sweep
    python -m scripts.experiments dyspec-dfs   --out runs/exp   # DySpec: attention blocks touched, BFS vs DFS order
    python -m scripts.experiments scaling      --out runs/exp   # DynaTree Figs 6, 9: prompt and generation length

Common flags: --pair (default: the offline default pair), --dtype, --prompts N (per set: code, chat, prose; default
1), --tokens (new tokens per run), --temperature. Every configuration runs on the same prompts, with AR decoded on
each prompt right before that prompt's configurations (interleaved, so machine drift cancels in the ratios); a warm-up
run is excluded. L-bar = committed tokens per target pass, speedup = tokens/s over AR's on the same prompts.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


import plotly.graph_objects as go

from engine.bench.tables import run_method, throughput
from engine.core.prompts import PROMPT_SETS, load_prompt_set
from engine.core.sampling import Sampling
from engine.measure.metrics import calibration, run_metrics
from engine.models import PAIRS, load_pair
from engine.verify import theory


# -- running configurations ---------------------------------------------------------------------------------------
def sweep(pair, configs, prompts, tokens, sampling, prompt_override=None):
    """configs: (label, strategy, params, rule or None). Returns per-config rows and every run's result."""
    run_method(pair, configs[0][1], prompts[0], 8, params={configs[0][1]: configs[0][2]}, sampling=sampling)
    ar, runs = [], {label: [] for label, *_ in configs}
    for prompt in prompts:
        ar.append(run_method(pair, "ar", prompt, tokens, sampling=sampling))
        for label, strategy, params, rule in configs:
            runs[label].append(run_method(pair, strategy, prompt, tokens, params={strategy: params},
                                          verifier=rule, sampling=sampling))
    ar_tps = throughput(ar)
    rows = []
    for label, strategy, params, rule in configs:
        results = [o["result"] for o in runs[label]]
        iters = [it for r in results for it in r.iterations]
        m = run_metrics(iters, sum(len(r.output_ids) for r in results), sum(r.metrics.total_s for r in results),
                        0.0)
        rows.append({"config": label, "strategy": strategy, "params": params, "rule": rule,
                     "L_bar": m.mean_tokens_per_iter, "acceptance": m.acceptance_rate,
                     "drafted": m.mean_drafted, "draft_forwards": m.mean_draft_forwards,
                     "tokens_per_s": throughput(runs[label]), "speedup": throughput(runs[label]) / ar_tps,
                     "ar_tokens_per_s": ar_tps})
    return rows, {label: [o["result"] for o in outs] for label, outs in runs.items()}


COLUMNS = [("config", "configuration", "{}"), ("L_bar", "L̄", "{:.2f}"), ("acceptance", "accept", "{:.2f}"),
           ("drafted", "nodes/iter", "{:.1f}"), ("draft_forwards", "draft fwd/iter", "{:.1f}"),
           ("tokens_per_s", "tok/s", "{:.2f}"), ("speedup", "× AR", "{:.2f}×")]


def markdown(rows, columns=COLUMNS) -> str:
    head = "| " + " | ".join(title for _, title, _ in columns) + " |"
    rule = "|" + "---|" * len(columns)
    body = ["| " + " | ".join("-" if r.get(key) is None else fmt.format(r[key]) for key, _, fmt in columns) + " |"
            for r in rows]
    return "\n".join([head, rule, *body])


def bars(rows, title, x="config") -> go.Figure:
    fig = go.Figure([go.Bar(name="speedup vs AR", x=[r[x] for r in rows], y=[r["speedup"] for r in rows]),
                     go.Bar(name="L̄ (tokens / target pass)", x=[r[x] for r in rows], y=[r["L_bar"] for r in rows])])
    fig.update_layout(title=title, barmode="group", template="plotly_white")
    return fig


# -- the experiments ---------------------------------------------------------------------------------------------
def ablation(pair, prompts, args):
    """DynaTree Table 4: fixed tree (D0, B_mid) -> + dynamic breadth & depth -> + history; then sweeps."""
    off = {"dynamic_breadth": False, "dynamic_depth": False, "history": False}
    configs = [("fixed tree (D0, B_mid)", "dynatree", off, None),
               ("+ dynamic breadth & depth", "dynatree", {"history": False}, None),
               ("+ history (DynaTree)", "dynatree", {}, None)]
    configs += [(f"D0 = {d}", "dynatree", {"d0": d}, None) for d in (2, 3, 5)]
    configs += [(f"B_max = {b}", "dynatree", {"b_max": b}, None) for b in (2, 4)]
    configs += [(f"tau = {t}", "dynatree", {"tau": t}, None) for t in (0.02, 0.1)]
    rows, _ = sweep(pair, configs, prompts, args.tokens, sampling_of(args))
    return rows, markdown(rows), bars(rows, "DynaTree ablation and sweeps (cpu preset, one knob at a time)")


def calibration_experiment(pair, prompts, args):
    """DySpec Hypothesis 1 on top-k trees: nodes binned by draft probability against the fraction accepted."""
    configs = [("DynaTree", "dynatree", {}, None), ("DySpec", "dyspec", {}, None)]
    _, results = sweep(pair, configs, prompts, args.tokens, sampling_of(args))
    fig, rows = go.Figure(), []
    fig.add_trace(go.Scatter(x=[0, 1], y=[0, 1], mode="lines", name="y = x", line={"dash": "dot"}))
    for label in results:
        cells = calibration([it for r in results[label] for it in r.iterations])
        rows += [{"config": label, **c} for c in cells]
        fig.add_trace(go.Scatter(x=[c["mean_q"] for c in cells], y=[c["accepted"] for c in cells],
                                 mode="lines+markers", name=label, text=[f"{c['nodes']} nodes" for c in cells]))
    fig.update_layout(title="Draft probability against acceptance (DySpec Hypothesis 1)", template="plotly_white",
                      xaxis_title="draft probability q (bin mean)", yaxis_title="fraction accepted")
    columns = [("config", "strategy", "{}"), ("lo", "q from", "{:.1f}"), ("hi", "q to", "{:.1f}"),
               ("nodes", "nodes tested", "{}"), ("mean_q", "mean q", "{:.3f}"), ("accepted", "accepted", "{:.3f}")]
    return rows, markdown(rows, columns), fig


def delayed_experiment(pair, prompts, args):
    """Delayed-tree Figure 1: block efficiency of (K, 0, L) trees per rule, measured, with Appendix C's
    1 + alpha(p, q, K) for L = 1 (one level: the tree's exact expected block efficiency) averaged over the roots."""
    sampling = sampling_of(args, default=1.0)
    configs, rows = [], []
    for rule in ("naive_tree", "specinfer", "spectr", "traversal"):
        configs += [(f"{rule} K={k} L={length}", "delayed", {"k": k, "l1": 0, "l2": length}, rule)
                    for k in (1, 2, 4) for length in (1, 2)]
    measured, _ = sweep(pair, configs, prompts, args.tokens, sampling)
    for row in measured:
        row["K"], row["L"] = row["params"]["k"], row["params"]["l2"]
        rows.append(row)
    predicted = predicted_efficiency(pair, prompts, sampling)
    for row in rows:
        row["theory"] = predicted.get((row["rule"], row["K"])) if row["L"] == 1 else None
    fig = go.Figure()
    for rule in ("naive_tree", "specinfer", "spectr", "traversal"):
        for length in (1, 2):
            pts = [r for r in rows if r["rule"] == rule and r["L"] == length]
            fig.add_trace(go.Scatter(x=[r["K"] for r in pts], y=[r["L_bar"] for r in pts], mode="lines+markers",
                                     name=f"{rule}, L={length} (measured)"))
        if rule in theory.ACCEPTANCE:
            pts = [r for r in rows if r["rule"] == rule and r["L"] == 1]
            fig.add_trace(go.Scatter(x=[r["K"] for r in pts], y=[r["theory"] for r in pts], mode="lines",
                                     line={"dash": "dot"}, name=f"{rule}, L=1 (Appendix C)"))
    fig.update_layout(title=f"Block efficiency against K and L (T = {sampling.temperature:g})",
                      template="plotly_white", xaxis_title="K (i.i.d. draft paths)", yaxis_title="L̄")
    columns = COLUMNS[:2] + [("theory", "1 + α (App. C)", "{:.2f}")] + COLUMNS[2:]
    return rows, markdown(rows, columns), fig


def predicted_efficiency(pair, prompts, sampling):
    """Mean over the prompts' first positions of 1 + alpha(p, q, K), from the two models' real distributions."""
    import torch
    from engine.core.prompts import encode_prompt
    out = {}
    for prompt in prompts:
        ids = torch.tensor([encode_prompt(pair.tokenizer, prompt)], device=pair.device)
        with torch.inference_mode():
            p = sampling.process(pair.target(ids).logits[:, -1].float())[0]
            q = sampling.process(pair.draft(ids).logits[:, -1].float())[0]
        for rule, formula in theory.ACCEPTANCE.items():
            for k in (1, 2, 4):
                out.setdefault((rule, k), []).append(1 + formula(p, q, k))
    return {key: sum(v) / len(v) for key, v in out.items()}


def salf(pair, prompts, args):
    configs = [(f"th = {th}", "salf", {"th": th}, None) for th in (0.0, 0.2, 0.4, 0.6, 0.8)]
    rows, _ = sweep(pair, configs, prompts, args.tokens, sampling_of(args))
    return rows, markdown(rows), bars(rows, "SALF threshold sweep (th = 0: optimal tree search)")


def ddtree(pair, prompts, args):
    configs = [(f"budget {b}", "ddtree", {"budget": b}, None) for b in (4, 8, 16, 32)]
    rows, _ = sweep(pair, configs, prompts, args.tokens, sampling_of(args))
    return rows, markdown(rows), bars(rows, "DDTree node-budget sweep")


def dyspec_dfs(pair, prompts, args):
    """DySpec's DFS order: the same trees numbered depth-first touch fewer blocks of the attention mask."""
    configs = [("BFS order", "dyspec", {"dfs_order": False, "budget": args.budget}, None),
               ("DFS order", "dyspec", {"dfs_order": True, "budget": args.budget}, None)]
    rows, results = sweep(pair, configs, prompts, args.tokens, sampling_of(args))
    for row in rows:
        counts = [mask_blocks(it, args.block) for r in results[row["config"]] for it in r.iterations]
        row["blocks"] = sum(counts) / len(counts)
    columns = COLUMNS[:1] + [("blocks", f"mask blocks ({args.block}×{args.block}) / iter", "{:.1f}")] + COLUMNS[1:]
    fig = go.Figure(go.Bar(x=[r["config"] for r in rows], y=[r["blocks"] for r in rows]))
    fig.update_layout(title=f"Non-empty {args.block}×{args.block} blocks of the tree attention mask per iteration",
                      template="plotly_white")
    return rows, markdown(rows, columns), fig


def mask_blocks(iteration, block: int) -> int:
    """Non-empty block×block tiles of the tree's ancestor mask, nodes in the order the target saw them."""
    tree = [n for n in iteration.nodes if n.status != "bonus"]
    parent = {n.id: n.parent for n in tree}
    tiles = set()
    for n in tree:
        node = n.id
        while node >= 0:  # n sees itself and its ancestors
            tiles.add((n.id // block, node // block))
            node = parent.get(node, -1)
    return len(tiles)


def scaling(pair, prompts, args):
    """DynaTree Figs 6 and 9: speedup as the prompt grows (each prompt's text repeated to 128 / 512 / 1024 tokens)
    and as the generation grows (half, once and twice --tokens)."""
    sampling, rows = sampling_of(args), []
    for length in (128, 512, 1024):
        longer = [lengthen(pair.tokenizer, p, length) for p in prompts]
        r, _ = sweep(pair, [("DynaTree", "dynatree", {}, None)], longer, args.tokens, sampling)
        rows.append({**r[0], "config": f"prompt {length} tokens", "axis": "prompt"})
    for tokens in (args.tokens // 2, args.tokens, args.tokens * 2):
        r, _ = sweep(pair, [("DynaTree", "dynatree", {}, None)], prompts, tokens, sampling)
        rows.append({**r[0], "config": f"{tokens} new tokens", "axis": "generation"})
    return rows, markdown(rows), bars(rows, "DynaTree against prompt and generation length")


def lengthen(tokenizer, prompt, tokens: int):
    """The prompt's text (for chat messages: the last message's) repeated and cut to about `tokens` tokens."""
    text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    text = tokenizer.decode((ids * (tokens // max(len(ids), 1) + 1))[:tokens])
    return text if isinstance(prompt, str) else prompt[:-1] + [{**prompt[-1], "content": text}]


EXPERIMENTS = {"ablation": ablation, "calibration": calibration_experiment, "delayed": delayed_experiment,
               "salf": salf, "ddtree": ddtree, "dyspec-dfs": dyspec_dfs, "scaling": scaling}


def sampling_of(args, default: float = 0.0) -> Sampling:
    t = args.temperature if args.temperature is not None else default
    return Sampling(temperature=t, seed=args.seed)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment", choices=list(EXPERIMENTS))
    ap.add_argument("--out", required=True, help="folder for <experiment>.md and <experiment>.html")
    ap.add_argument("--pair", default="default", choices=list(PAIRS))
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompts", type=int, default=1, help="prompts per set (code, chat, prose)")
    ap.add_argument("--tokens", type=int, default=48, help="new tokens per run")
    ap.add_argument("--temperature", type=float, help="default: 0 (greedy); the delayed experiment: 1.0")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget", type=int, default=24, help="dyspec-dfs: DySpec's node budget")
    ap.add_argument("--block", type=int, default=4, help="dyspec-dfs: attention-mask tile size")
    args = ap.parse_args(argv)
    pair = load_pair(*PAIRS[args.pair], dtype=args.dtype)
    prompts = [e["prompt"] for s in PROMPT_SETS for e in load_prompt_set(s)[: args.prompts]]
    rows, table, fig = EXPERIMENTS[args.experiment](pair, prompts, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m scripts.experiments " + " ".join(sys.argv[1:] if argv is None else argv)
    header = (f"# {args.experiment}\n\n`{command}`\n\n{pair.describe()}; {len(prompts)} prompts "
              f"({args.prompts} per set), {args.tokens} new tokens, AR interleaved per prompt.\n\n")
    (out / f"{args.experiment}.md").write_text(header + table + "\n")
    (out / f"{args.experiment}.json").write_text(json.dumps(rows, indent=1, default=str))
    fig.write_html(out / f"{args.experiment}.html", include_plotlyjs=True)  # opens offline
    print(header + table)


if __name__ == "__main__":
    main()
