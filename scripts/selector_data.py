"""Training data for the delayed-tree neural selector, and its training (engine/training/selector_train.py).

    python -m scripts.selector_data collect --pair default   # real runs -> ~/.cache/treeviz/selector/
    python -m scripts.selector_data train                    # -> assets/selector/{specinfer,spectr}.safetensors

collect: decodes the training prompts of the shipped sets (every prompt but the last HELD_OUT of each set, which the
evaluation keeps) at each temperature with a `cover` strategy: every iteration drafts one cover tree (a trunk of
L1_MAX draws and K_MAX branches of L2_MAX draws at every trunk depth, so every action's delayed tree is a part of
it) and the decoder verifies it with SpecInfer, so the run follows the target's distribution like any other. At every
root it stores the selector's features and, per rule, each action's block efficiency by Eq. 3 (Appendix D branching
probabilities over the target's p and the draft's q at every node) and its Eq. 11 seconds from the measured cost
table. Files: <cache>/<pair>-train.safetensors and <pair>-heldout.safetensors (the held-out prompts, for the offline
evaluation that `train` prints).
train: fits one selector per rule family on the training roots and reports, by the same estimator on held-out roots,
its tokens/s against the best single fixed action and the baseline.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.core.prompts import PROMPT_SETS, load_prompt_set
from engine.core.sampling import Sampling
from engine.decoder import Decoder
from engine.models import PAIRS, load_pair
from engine.strategies import selector as neural
from engine.strategies.base import Strategy
from engine.training import selector_train
from engine.verify import SpecInfer

CACHE = Path.home() / ".cache" / "treeviz" / "selector"
HELD_OUT = 2  # last prompts of each set: never trained on
TOP = 128  # support kept per node for the estimator (see `compact`)


def split_prompts(split: str, limit: int | None = None, sets=PROMPT_SETS) -> list[tuple[str, object]]:
    """(name, prompt) of the training or held-out prompts, the sets interleaved."""
    per_set = []
    for name in sets:
        entries = load_prompt_set(name)
        chosen = entries[:-HELD_OUT] if split == "train" else entries[-HELD_OUT:]
        per_set.append([(f"{name}/{e['name']}", e["prompt"]) for e in chosen][:limit])
    return [entry for group in zip(*per_set) for entry in group]


class Cover(Strategy):
    """Drafts the cover tree of every action (engine.training.selector_train.grow_cover) and keeps the root's features."""
    name, label, summary = "cover", "Selector cover tree", "every (K, L1, L2) delayed tree at once"
    child_mode = "iid"
    presets = {"cpu": {}}
    sample = None  # the latest tree's (features, cover, first draft forward's rows, costs)

    def begin(self, run) -> None:
        self.taps = neural.FeatureTaps.of_run(run)

    def watches_draft_rows(self) -> bool:
        return True

    def drafted(self, nodes, dists) -> None:
        self.taps.see_rows(nodes, dists)

    def after_target(self, logits, row: int) -> None:
        self.taps.after_target(logits, row)

    def build(self, drafter, tree) -> None:
        root = drafter.expand([0])[0]
        tree.child_dist[0], tree.child_mode[0] = root, "iid"
        features = self.taps.features(drafter, root)
        draw = lambda dist, count: torch.multinomial(dist, count, replacement=True,  # noqa: E731
                                                     generator=drafter.generator).tolist()
        cover = selector_train.grow_cover(drafter, tree, draw)
        self.sample = (features, cover, drafter.row_counts[0], self.taps.costs)


def compact(tree, p_rows: torch.Tensor, top: int = TOP) -> tuple[dict, dict, list[int]]:
    """Each expanded node's p and q on a short support: the `top` most likely tokens of each, the node's children,
    and three buckets for the rest of the vocabulary (float64): one both p and q hold with the tail's true overlap
    sum(min(p, q)), one with the rest of p's tail, one with the rest of q's. The formulas then run on ~2 * top
    entries instead of the full vocabulary, and the first rejection step (sum of min(p, q), the residual's mass) is
    exact; later residual steps can only under-count the tail's overlap. (One lumped bucket instead would have
    counted min(p_tail, q_tail) as overlap: an overestimate of up to the tail's mass at every step.) Returns p, q
    per node and each node's token as an index into its parent's support."""
    p, q, tokens = {}, {}, [0] * len(tree)
    nodes = [n for n in tree.child_dist if tree.children[n]]
    p_all, q_all = p_rows[nodes], torch.stack([tree.child_dist[n] for n in nodes])
    tops = torch.cat([p_all.topk(top, dim=-1).indices, q_all.topk(top, dim=-1).indices], dim=-1)  # one topk each
    overlap = torch.minimum(p_all, q_all).double().sum(-1)  # over the whole vocabulary
    for i, node in enumerate(nodes):
        children = torch.tensor([tree.tokens[c] for c in tree.children[node]])
        support = torch.unique(torch.cat([tops[i], children]))
        where = {int(t): j for j, t in enumerate(support.tolist())}
        ps, qs = p_all[i, support].double(), q_all[i, support].double()
        p_tail, q_tail = (1 - ps.sum()).clamp(min=0), (1 - qs.sum()).clamp(min=0)
        shared = (overlap[i] - torch.minimum(ps, qs).sum()).clamp(min=0)
        shared = torch.minimum(shared, torch.minimum(p_tail, q_tail))
        zero = torch.zeros((), dtype=torch.float64)
        p[node] = torch.cat([ps, torch.stack([shared, p_tail - shared, zero])])
        q[node] = torch.cat([qs, torch.stack([shared, zero, q_tail - shared])])
        for child in tree.children[node]:
            tokens[child] = where[tree.tokens[child]]
    return p, q, tokens


class Recording(SpecInfer):
    """SpecInfer that first turns the iteration's cover tree into each action's estimated block efficiency."""

    def __init__(self, rows: list):
        self.strategy: Cover | None = None  # the run's own Cover (`follow`)
        self.rows = rows

    def follow(self, run) -> None:
        """A run plug-in (engine/decoder.py Decoder.plugins) that only points this rule at the run's Cover."""
        self.strategy = run.strategy

    def verify(self, tree, logits, sampling=None, generator=None):
        if len(tree) > 1 and self.strategy.sample is not None:
            features, cover, first_rows, costs = self.strategy.sample
            p, q, tokens = compact(tree, sampling.process(logits.float()))
            memo: dict = {}
            efficiency = torch.tensor([[selector_train.block_efficiency(rule, cover.draws(a), tokens, p, q, memo)
                                        for a in neural.ACTIONS] for rule in neural.RULES])
            self.rows.append({"features": features, "efficiency": efficiency,
                              "seconds": neural.action_seconds(costs, first_rows)})
            self.strategy.sample = None
        return super().verify(tree, logits, sampling, generator)


def save(rows: list[dict], out: Path, info: dict) -> None:
    save_file({"target_hidden": torch.stack([r["features"].target_hidden for r in rows]),
               "draft_hidden": torch.stack([r["features"].draft_hidden for r in rows]),
               "scalars": torch.stack([r["features"].scalars for r in rows]),
               "efficiency": torch.stack([r["efficiency"] for r in rows]).float(),
               "seconds": torch.stack([r["seconds"] for r in rows]).float()}, str(out),
              metadata={"info": json.dumps(info)})


def collect(args) -> None:
    pair = load_pair(*PAIRS[args.pair], dtype=args.dtype)
    CACHE.mkdir(parents=True, exist_ok=True)
    for split in args.splits:
        rows: list[dict] = []
        out = CACHE / f"{args.pair}-{split}.safetensors"
        info = {"pair": args.pair, "target": pair.target_name, "draft": pair.draft_name, "rules": list(neural.RULES),
                "actions": [list(a) for a in neural.ACTIONS], "tokens": args.tokens, "top": TOP, "runs": []}
        for i, (name, prompt) in enumerate(split_prompts(split, args.limit)):
            for temperature in args.temperatures:
                start, before = time.perf_counter(), len(rows)
                sampling = Sampling(temperature=temperature, seed=args.seed + i)
                rule = Recording(rows)
                Decoder(pair, Cover(), rule, sampling, plugins=(rule.follow,)).generate(
                    prompt, max_new_tokens=args.tokens)
                info["runs"].append({"prompt": name, "temperature": temperature, "roots": len(rows) - before,
                                     "seconds": round(time.perf_counter() - start, 1)})
                save(rows, out, info)  # after every run: a long collection can be stopped and still used
                print(f"{split} {name:30s} T={temperature:g}: {len(rows) - before} roots in "
                      f"{info['runs'][-1]['seconds']}s ({len(rows)} in all)", flush=True)
        print(f"wrote {len(rows)} roots to {out}")


def load_data(path: Path, rule: str) -> tuple[dict, dict]:
    if not path.exists():
        raise SystemExit(f"no data at {path}: run `python -m scripts.selector_data collect` first")
    with safe_open(str(path), "pt") as f:
        info = json.loads(f.metadata()["info"])
        data = {k: f.get_tensor(k) for k in f.keys()}
    data["efficiency"] = data["efficiency"][:, info["rules"].index(rule)]
    return data, info


def train(args) -> None:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for rule in neural.RULES:
        data, info = load_data(CACHE / f"{args.pair}-train.safetensors", rule)
        start = time.perf_counter()
        meta = {"rule": rule, "pair": args.pair, "target": info["target"], "draft": info["draft"],
                "trained_on": f"{len(data['scalars'])} roots, {len(info['runs'])} runs of {info['tokens']} tokens"}
        net = selector_train.train(data, meta, epochs=args.epochs, log=print)
        print(f"{rule}: trained on {len(data['scalars'])} roots in {time.perf_counter() - start:.1f}s")
        for split in ("train", "heldout"):
            if not (CACHE / f"{args.pair}-{split}.safetensors").exists():
                continue
            held, _ = load_data(CACHE / f"{args.pair}-{split}.safetensors", rule)
            report = selector_train.evaluate(net, held)
            net.meta[f"offline_{split}"] = report
            print(f"  {split:7s} ({len(held['scalars'])} roots): " + ", ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in report.items()))
        net.save(out_dir / f"{rule}.safetensors")
        print(f"  wrote {out_dir / f'{rule}.safetensors'}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect", help="real runs -> per-root features and per-action targets")
    c.add_argument("--pair", default="default", choices=list(PAIRS))
    c.add_argument("--dtype", default="auto")
    c.add_argument("--tokens", type=int, default=40, help="new tokens per run")
    c.add_argument("--temperatures", type=float, nargs="+", default=[0.6, 1.0])
    c.add_argument("--limit", type=int, default=None, help="prompts per set (default: all training prompts)")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--splits", nargs="+", default=["train", "heldout"], choices=["train", "heldout"])
    t = sub.add_parser("train", help="fit the selectors on the collected roots")
    t.add_argument("--pair", default="default")
    t.add_argument("--epochs", type=int, default=300)
    t.add_argument("--out", default=str(neural.WEIGHTS_DIR))
    args = parser.parse_args(argv)
    {"collect": collect, "train": train}[args.command](args)


if __name__ == "__main__":
    main()
