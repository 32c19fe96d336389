"""Exact output laws of verification rules, by enumerating every random outcome.

A rule's randomness comes only from `rng.accept(probability)` and `rng.choice(probs)` (engine/verify/base.py), and a
tree's draws from `rng.sample(dist, count, replacement)`. `outcomes(fn)` runs `fn(rng)` once per path through those
decisions, replaying a prefix of choices and taking each new decision's first option while queueing the others, and
yields (probability of the path, what fn returned). Summing over the paths gives a law exactly (up to float64
rounding), so a biased rule is caught however small its bias, with no statistics.

The toy language model: next-token distributions P (target) and Q (draft) for every context, on a vocabulary of a
few tokens embedded in a wider tensor of zeros (as a trimmed draft vocabulary or a top-p cut would leave it), with
some entries zero. The rules run on these torch tensors exactly as they do on a real model's rows.
"""
from __future__ import annotations

import itertools
import os
from collections import defaultdict

import torch

from engine.core.tree import DraftTree

WIDTH = 6  # tensor length; the first `vocab` entries carry the tiny vocabulary
DEVICE = os.environ.get("TREEVIZ_TEST_DEVICE", "cpu")  # "cuda": the same proofs on a GPU's tensors
ROOT_TOKEN = WIDTH - 1  # never drawn: P and Q are zero there


class Replay:
    """One path through the decisions: replays `prefix`, then takes option 0 of each new decision and queues the
    prefixes of its alternatives on `pending`."""

    def __init__(self, prefix: list[int], pending: list[list[int]]):
        self.prefix, self.pending, self.taken, self.weight = prefix, pending, [], 1.0

    def _pick(self, options: list[tuple[object, float]]):
        at = len(self.taken)
        if at < len(self.prefix):
            index = self.prefix[at]
        else:
            index = 0
            self.pending.extend(self.taken + [alt] for alt in range(1, len(options)))
        self.taken.append(index)
        value, weight = options[index]
        self.weight *= weight
        return value

    def accept(self, probability: float) -> bool:
        a = min(max(float(probability), 0.0), 1.0)
        return self._pick([(v, w) for v, w in ((True, a), (False, 1.0 - a)) if w > 0])

    def choice(self, probs: torch.Tensor) -> int:
        probs = probs.double()
        total = float(probs.sum())
        return self._pick([(int(i), float(probs[i]) / total) for i in probs.nonzero().flatten()])

    def sample(self, dist: torch.Tensor, count: int, replacement: bool) -> list[int]:
        """`count` draws in order: i.i.d., or sequentially without replacement (the law of torch.multinomial)."""
        out, dist = [], dist.double()
        for _ in range(count):
            out.append(self.choice(dist))
            if not replacement:
                dist = dist.clone()
                dist[out[-1]] = 0.0
        return out


def outcomes(fn):
    """Yield (probability, fn(rng)) for every path through fn's random decisions."""
    pending = [[]]
    while pending:
        rng = Replay(pending.pop(), pending)
        result = fn(rng)
        yield rng.weight, result


class ToyModel:
    """Target and draft next-token distributions per context (a tuple of tokens), float64 tensors of WIDTH."""

    def __init__(self, vocab: int, seed: int, zeros: bool = True, first: tuple | None = None):
        self.vocab, self.seed, self.zeros, self.cache = vocab, seed, zeros, {}
        if first is not None:  # fixed (p, q) at the empty context, e.g. the reproduction
            self.cache[()] = tuple(self._pad(torch.tensor(d, dtype=torch.float64)) for d in first)

    def _pad(self, d: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(WIDTH, dtype=torch.float64, device=DEVICE)
        out[: len(d)] = (d / d.sum()).to(DEVICE)
        return out

    def _make(self, ctx: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(hash((self.seed,) + ctx) % 2**31)
        pair = []
        for _ in range(2):
            d = torch.rand(self.vocab, generator=g, dtype=torch.float64) ** 2 + 0.01
            if self.zeros and float(torch.rand((), generator=g)) < 0.5:
                d[int(torch.randint(self.vocab, (), generator=g))] = 0.0
            pair.append(self._pad(d))
        return pair[0], pair[1]

    def dists(self, ctx: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        if ctx not in self.cache:
            self.cache[ctx] = self._make(ctx)
        return self.cache[ctx]

    def p(self, ctx: tuple) -> torch.Tensor:
        return self.dists(ctx)[0]

    def q(self, ctx: tuple) -> torch.Tensor:
        return self.dists(ctx)[1]

    def joint(self, length: int) -> dict[tuple, float]:
        """The target's law of the next `length` tokens."""
        law = {}
        for seq in itertools.product(range(self.vocab), repeat=length):
            prob = 1.0
            for i, t in enumerate(seq):
                prob *= float(self.p(seq[:i])[t])
            if prob > 0:
                law[seq] = prob
        return law


def contexts_of(tree: DraftTree) -> list[tuple]:
    """Each node's context: the tokens from the root's child down to the node (the root's own token is the prompt)."""
    out = [()]
    for node in range(1, len(tree)):
        out.append(out[tree.parents[node]] + (tree.tokens[node],))
    return out


class Rows:
    """`p[node]` for a rule's walk: the target's distribution after the node's context."""

    def __init__(self, model: ToyModel, contexts: list[tuple]):
        self.model, self.contexts = model, contexts

    def __getitem__(self, node: int) -> torch.Tensor:
        return self.model.p(self.contexts[node])


class FakeDrafter:
    """The draft side for real strategies' `build`: q of each node's context (no generator: strategies sample with
    the draws the test routes through the enumerator)."""
    generator = None

    def __init__(self, model: ToyModel, tree: DraftTree):
        self.model, self.tree, self.forwards = model, tree, 0

    def expand(self, nodes: list[int]) -> list[torch.Tensor]:
        self.forwards += 1
        contexts = contexts_of(self.tree)
        return [self.model.q(contexts[n]) for n in nodes]

    def remap(self, mapping) -> None:
        pass


def emitted_law(verifier, build, model: ToyModel, length: int):
    """Exact law of the first `length` emitted tokens when `build(rng)` draws a tree and `verifier` walks it; tokens
    the iteration does not emit are completed with the target's own conditionals (what the next iterations emit,
    which follow the target whenever the rule is lossless). Also returns P(the walk accepts a child of the root)."""
    law, deeper = defaultdict(float), 0.0

    def trial(rng):
        tree = build(rng)
        verifier.check_tree(tree)
        verdict = verifier.walk(tree, Rows(model, contexts_of(tree)), rng)
        assert all(tree.parents[b] == a for a, b in zip(verdict.path, verdict.path[1:]))
        return tuple(tree.tokens[v] for v in verdict.path[1:]) + (verdict.bonus,)

    for weight, out in outcomes(trial):
        deeper += weight * (len(out) > 1)
        for tail in itertools.product(range(model.vocab), repeat=max(0, length - len(out))):
            seq, prob = (out + tail)[:length], weight
            for i in range(len(out), len(seq)):
                prob *= float(model.p(seq[:i])[seq[i]])
            if prob > 0:
                law[seq] += prob
    return dict(law), deeper


def max_error(law: dict, target: dict) -> float:
    return max(abs(law.get(k, 0.0) - target.get(k, 0.0)) for k in set(law) | set(target))
