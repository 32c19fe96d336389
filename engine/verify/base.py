"""The one interface every verification rule implements.

A rule walks the draft tree with the target's logits (one row per tree node, in node order: row i holds the target's
next-token logits after node i) and returns the accepted path and the bonus token. Sampling rules see the target's
processed distributions p (same temperature / top-k / top-p as the draft's q, see engine/core/sampling.py) through
`TargetDists`, which processes only the rows a rule visits, and draw every random number from one seeded
torch.Generator, so a run is reproducible.

Rules declare which ways of drawing children they can check losslessly; an incompatible strategy/rule pair is refused.
The draft distribution q of an expanded node is `tree.child_dist[node]` (the processed distribution that drew its
children) and `tree.child_mode[node]` says how the children were drawn:
- "iid": each child an independent draw from q; duplicates allowed, either as separate sibling nodes (each with its
  own subtree) or as one node standing for several draws (`DraftTree.add_draw`; `tree.draw_order(node)` lists the
  draws in their true order, a merged child once per draw, which keeps the order exchangeable);
- "without_replacement": the i-th child drawn from q with the earlier siblings' tokens removed and q renormalised;
- "topk": chosen deterministically; as a draw, the i-th child comes from the point mass on its token.
`child_draws` turns all three into one list of (child, distribution it was drawn from), which is what the
probability-ratio rules need.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch

from engine.core.tree import DraftTree

MODES = ("topk", "iid", "without_replacement")
TINY = 1e-12


class VerificationError(ValueError):
    """A rule asked to check a tree whose children were drawn in a way it cannot verify losslessly."""


@dataclass
class Verdict:
    path: list[int]                     # accepted node ids, root first
    bonus: int                          # token emitted after the path
    accept_prob: dict[int, float] = field(default_factory=dict)  # node -> probability it was accepted with
    resampled: bool = False             # the bonus came from a residual distribution


class TargetDists:
    """The target's processed next-token distribution per tree row, computed on first use and cached."""

    def __init__(self, logits: torch.Tensor, process: Callable[[torch.Tensor], torch.Tensor]):
        self.logits, self.process, self.rows = logits, process, {}

    def __getitem__(self, node: int) -> torch.Tensor:
        if node not in self.rows:
            self.rows[node] = self.process(self.logits[node : node + 1])[0]
        return self.rows[node]


def softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits.float(), dim=-1)


# -- helpers shared by the rules (torch tensors only: the tests run this same code on tiny vocabularies) ------------
def child_draws(tree: DraftTree, node: int) -> list[tuple[int, torch.Tensor]]:
    """(child, distribution the child was drawn from given its earlier siblings), in draw order."""
    draws = tree.draw_order(node)
    if not draws:
        return []
    mode, q = tree.child_mode.get(node, "topk"), tree.child_dist.get(node)
    if q is None:
        raise VerificationError(f"node {node} has children but no recorded draft distribution")
    out = []
    for child in draws:
        token = tree.tokens[child]
        if mode == "topk":
            out.append((child, point_mass(q, token)))
        elif mode == "iid":
            out.append((child, q))
        elif mode == "without_replacement":
            out.append((child, q))
            q = without(q, token)
        else:
            raise VerificationError(f"node {node}: unknown child mode {mode!r}; expected one of {MODES}")
    return out


def point_mass(like: torch.Tensor, token: int) -> torch.Tensor:
    out = torch.zeros_like(like)
    out[token] = 1.0
    return out


def without(q: torch.Tensor, token: int) -> torch.Tensor:
    """q with `token` removed, renormalised: the next draw's distribution when drawing without replacement."""
    out = q.clone()
    out[token] = 0.0
    mass = float(out.sum())
    return out / mass if mass > TINY else out


def residual(p: torch.Tensor, q: torch.Tensor, weight: float = 1.0) -> tuple[torch.Tensor, float]:
    """(norm(max(weight * p - q, 0)), its mass before normalising). When the mass is zero (an event of probability
    zero for the rules) the distribution is p itself."""
    r = (weight * p - q).clip(min=0.0)
    mass = float(r.sum())
    return (r / mass if mass > TINY else p), mass


def ratio(p: torch.Tensor, q: torch.Tensor, token: int) -> float:
    """min(1, p(token) / q(token)): the speculative-sampling acceptance probability."""
    pt, qt = float(p[token]), float(q[token])
    return 1.0 if pt >= qt else pt / qt


class TorchRandom:
    """The rules' random numbers, all from one seeded torch.Generator (the decoder makes one per run)."""

    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator
        self.device = generator.device if generator is not None else torch.device("cpu")

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.generator, device=self.device))

    def accept(self, probability: float) -> bool:
        """True with the given probability (one uniform draw)."""
        return self.uniform() < probability

    def choice(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator))


class Verifier:
    name: ClassVar[str]
    label: ClassVar[str]
    child_modes: ClassVar[tuple[str, ...]]  # child drawing modes it verifies losslessly
    greedy_only: ClassVar[bool] = False     # True for the argmax rule, which is exact only at temperature 0

    def check_compatible(self, child_mode: str) -> None:
        if child_mode not in self.child_modes:
            raise VerificationError(
                f"verification rule {self.name!r} cannot check trees whose children are drawn {child_mode!r}; "
                f"it handles {', '.join(self.child_modes)}")

    def check_strategy(self, strategy) -> None:
        """Refuse, before decoding, a strategy whose trees this rule cannot check losslessly."""
        for mode in strategy.child_modes_used:
            self.check_compatible(mode)

    def check_tree(self, tree: DraftTree) -> None:
        """Refuse a tree this rule cannot check losslessly (every expanded node's child mode, rule-specific shape)."""
        for node, children in enumerate(tree.children):
            if children:
                self.check_compatible(tree.child_mode.get(node, "topk"))

    def verify(self, tree: DraftTree, logits: torch.Tensor, sampling=None,
               generator: torch.Generator | None = None) -> Verdict:
        """Verify `tree` against the target's logits [len(tree), V] under `sampling` (engine.core.sampling.Sampling;
        None: plain softmax), drawing random numbers from `generator`."""
        self.check_tree(tree)
        process = sampling.process if sampling is not None else softmax
        return self.walk(tree, TargetDists(logits, process), TorchRandom(generator))

    def walk(self, tree: DraftTree, p, rng: TorchRandom) -> Verdict:
        """The rule itself. `p[node]` is the target's processed distribution after `node` (a float tensor [V]); all
        randomness comes from `rng.accept(probability)` and `rng.choice(probs)`, which is what lets the tests
        enumerate every outcome of a rule exactly (tests/exact.py) on the same code path real models use."""
        raise NotImplementedError


class TopDown(Verifier):
    """The OT-based rules (NSS, Naive, SpecInfer, SpecTr, Khisti): from the root down, an OTLP solver turns the node's
    p, q and child draws into one token y distributed exactly as p; descend into the child holding y, or stop and
    emit y as the bonus. Each step's output follows p given the path so far, so the emitted sequence follows the
    target; the child subtrees are drawn independently of the solver's coins, so going down repeats the argument."""
    child_modes = MODES

    def walk(self, tree, p, rng) -> Verdict:
        path, accept = [0], {}
        while True:
            node = path[-1]
            draws = child_draws(tree, node)
            if not draws:
                return Verdict(path, rng.choice(p[node]), accept)
            child, token, resampled = self.solve(tree, p[node], draws, rng, accept)
            if child is None:
                child = tree.child_with_token(node, token)
            if child is None:
                return Verdict(path, token, accept, resampled)
            path.append(child)

    def solve(self, tree, p, draws, rng, accept) -> tuple[int | None, int, bool]:
        """One OTLP step: (accepted child or None, output token, whether it came from a residual). Record each tried
        child's acceptance probability in `accept`."""
        raise NotImplementedError


class ChainOnly:
    """Mixin for single-path rules: refuse trees in which a node has more than one child draw."""

    def check_strategy(self, strategy) -> None:
        super().check_strategy(strategy)
        if not strategy.chain:
            raise VerificationError(f"verification rule {self.name!r} checks a single draft chain; strategy "
                                    f"{strategy.name!r} drafts trees (use a tree rule such as 'traversal')")

    def check_tree(self, tree) -> None:
        super().check_tree(tree)
        for node in range(len(tree)):
            if len(tree.draw_order(node)) > 1:
                raise VerificationError(f"verification rule {self.name!r} checks a single draft chain, but node "
                                        f"{node} has {len(tree.draw_order(node))} children")
