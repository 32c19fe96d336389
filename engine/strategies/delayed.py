"""Delayed tree expansion (Thomas et al. §5, Def. 5.2): a (K, L1, L2) tree.

A trunk of L1 draft tokens (sampled, or greedy), then K i.i.d. draft paths of L2 tokens from the trunk's end,
all drawn at the draft temperature T from q^(1/T) (renormalised; q is the drafter's processed distribution).
Delaying the branching point spends the i.i.d. width deep in the tree, where draft and target disagree most.
The K paths are sampled in parallel: each step is ONE draft forward over the distinct current path ends; an end
reached by m paths draws m i.i.d. children. Paths that draw the same token share one node (`DraftTree.add_draw`),
and the tree keeps every node's draws in their true order (`tree.draw_order`, a merged node once per draw), which
the i.i.d. rules (SpecInfer, SpecTr, Khisti) need: tried grouped by first appearance they would be biased. Sampled
nodes record child_mode "iid" and the exact distribution they drew from in child_dist. Draws use the run's sampling
generator when the decoder gives the drafter one (temperature > 0), else the strategy's own, seeded with `seed` in
each run's fresh strategy: runs repeat either way.
With `without_replacement` the K branch tokens at a node are distinct instead: the i-th is drawn from q with the
earlier siblings' tokens removed and renormalised (child mode "without_replacement", for SpecInfer's
without-replacement variant; rules that need i.i.d. children refuse it).
With `neural_selector` (the paper's §6) the shape is chosen per iteration, right after the draft's root forward
(which every shape begins with), by the trained selector of the run's rule family (engine/strategies/selector.py,
assets/selector/); K, L1, L2 are then ignored. The choice and its predicted tokens/s go to the iteration's
`selector` report (engine/core/reports.py), the shape also to its params. Losslessness never depends on it: every
choice is a delayed tree.
"""
from dataclasses import asdict

import torch

from engine.core.reports import SelectorChoice
from engine.strategies import selector as neural
from engine.strategies.base import Param, Strategy, StrategyError


class Delayed(Strategy):
    name = "delayed"
    label = "Delayed tree expansion"
    summary = "A trunk of L1 draft tokens, then K i.i.d. sampled draft paths of L2 tokens from its end."
    child_mode = "iid"  # per instance: "without_replacement" when that option is on
    # A trained engine.strategies.selector.Selector; None: the shipped one of the run's rule, loaded at the first
    # choice. A caller (a test, an evaluation) may set its own; each run's copy of the strategy keeps it.
    selector: neural.Selector | None = None
    params = (
        Param("k", 3, 1, 16, 1, "K (branches)", "i.i.d. paths drawn at the branching point"),
        Param("l1", 2, 0, 32, 1, "L1 (trunk length)", "draft tokens before the branching point"),
        Param("l2", 2, 0, 32, 1, "L2 (branch length)", "draft tokens on each i.i.d. path"),
        Param("temperature", 1.0, 0.05, 4.0, 0.05, "draft temperature", "children drawn from q^(1/T), renormalised"),
        Param("greedy_trunk", False, label="greedy trunk",
              help="take the draft's argmax on the trunk instead of sampling"),
        Param("seed", 0, 0, 2**31 - 1, 1, "seed", "draft sampler seed when decoding greedily (else the run's seed)"),
        Param("without_replacement", False, label="draw without replacement",
              help="branch tokens at a node are distinct: each drawn with the earlier siblings removed"),
        Param("neural_selector", False, label="neural selector",
              help="choose (K, L1, L2) per iteration with the trained selector (K, L1, L2 above are then ignored)"),
    )
    presets = {
        "cpu": {"k": 4, "l1": 2, "l2": 1, "temperature": 1.0, "greedy_trunk": False},
        # The paper's selector chooses from K in 1..4, L1, L2 in 0..8; a fixed mid-range tree with full width.
        "paper": {"k": 4, "l1": 4, "l2": 4, "temperature": 1.0, "greedy_trunk": False},
    }

    def __init__(self, preset: str = "cpu", **overrides):
        super().__init__(preset, **overrides)
        self.generator = None  # created on the draft's device at the first draw
        self.chosen: SelectorChoice | None = None  # the selector's latest choice
        self.taps: neural.FeatureTaps | None = None  # the root's features, with the selector (from `begin`)

    def check(self) -> None:
        c = self.settings
        if c.neural_selector and c.without_replacement:
            raise StrategyError("the neural selector was trained on i.i.d. branches: turn off without_replacement")
        if c.l1 + c.l2 == 0 and not c.neural_selector:
            raise StrategyError("L1 + L2 must be at least 1: a (K, 0, 0) tree drafts nothing (use the 'ar' strategy)")
        self.child_mode = "without_replacement" if c.without_replacement else "iid"
        self.chain = c.k == 1 and not c.neural_selector  # one path: chain rules (Naive, Block) can check it
        greedy_trunk = c.greedy_trunk and (c.l1 > 0 or c.neural_selector)
        self.child_modes_used = ("topk", self.child_mode) if greedy_trunk else (self.child_mode,)

    def begin(self, run) -> None:
        """With the selector: tap the root's features (engine/strategies/selector.py FeatureTaps)."""
        if self.settings.neural_selector:
            self.taps = neural.FeatureTaps.of_run(run)

    def watches_draft_rows(self) -> bool:
        return self.taps is not None

    def drafted(self, nodes: list[int], dists: torch.Tensor) -> None:
        self.taps.see_rows(nodes, dists)

    def after_target(self, logits: torch.Tensor, row: int) -> None:
        if self.taps is not None:
            self.taps.after_target(logits, row)

    def current_params(self) -> dict:
        params = asdict(self.settings)
        if self.chosen is not None:
            params.update(k=self.chosen.k, l1=self.chosen.l1, l2=self.chosen.l2)
        return params

    def choose(self, drafter, root_dist: torch.Tensor) -> tuple[int, int, int]:
        """The selector's (K, L1, L2) from the root's features (its `taps`, from the run), recorded for the iteration."""
        taps = self.taps
        if taps is None:
            raise StrategyError("the neural selector needs the run's root features (engine.decoder.DecodeRun)")
        if self.selector is None:
            self.selector = neural.shipped(taps.rule)
        seconds = neural.action_seconds(taps.costs, drafter.row_counts[0]) if taps.costs is not None else None
        self.chosen = self.selector.choose(taps.features(drafter, root_dist), seconds)
        return self.chosen.k, self.chosen.l1, self.chosen.l2

    def _draw(self, drafter, dist: torch.Tensor, count: int) -> tuple[torch.Tensor, list[int]]:
        """The distribution actually drawn from, and `count` tokens from it: i.i.d., or without replacement (in draw
        order, fewer if q has fewer tokens with nonzero mass)."""
        t = self.settings.temperature
        if t != 1.0:
            dist = torch.softmax(dist.log() / t, dim=-1)  # in log space: q^(1/T) underflows for small T
        generator = drafter.generator
        if generator is None:
            if self.generator is None or self.generator.device != dist.device:
                self.generator = torch.Generator(device=dist.device).manual_seed(self.settings.seed)
            generator = self.generator
        replacement = not self.settings.without_replacement
        if not replacement:
            count = min(count, int((dist > 0).sum()))
        return dist, self.sample(dist, count, replacement, generator)

    @staticmethod
    def sample(dist: torch.Tensor, count: int, replacement: bool, generator: torch.Generator) -> list[int]:
        """`count` tokens from `dist` in draw order (without replacement: torch draws sequentially, so the order is
        the draw order too)."""
        return torch.multinomial(dist, count, replacement=replacement, generator=generator).tolist()

    def build(self, drafter, tree) -> None:
        c = self.settings
        k, l1, l2 = c.k, c.l1, c.l2
        root = {}  # with the selector: the root's q, already drawn by the root forward its features come from
        if c.neural_selector:
            root[0] = drafter.expand([0])[0]
            k, l1, l2 = self.choose(drafter, root[0])
            tree.selector = self.chosen

        def expand(nodes: list[int]) -> list[torch.Tensor]:
            return [root.pop(0)] if nodes == [0] and root else drafter.expand(nodes)

        def add(parent: int, dist: torch.Tensor, token: int) -> int:
            p = float(dist[token])
            return tree.add_draw(parent, token, p, int((dist > p).sum()))

        node = 0
        for _ in range(l1):  # trunk: one draw per node
            dist = expand([node])[0]
            if c.greedy_trunk:
                tree.child_dist[node], tree.child_mode[node] = dist, "topk"
                token = int(dist.argmax())
            else:
                dist, (token,) = self._draw(drafter, dist, 1)
                tree.child_dist[node], tree.child_mode[node] = dist, self.child_mode
            node = add(node, dist, token)

        ends = {node: k}  # path end -> number of paths through it
        for _ in range(l2):
            nodes = list(ends)
            dists = expand(nodes)  # every distinct path end in one draft forward
            next_ends: dict[int, int] = {}
            for node, dist in zip(nodes, dists):
                dist, draws = self._draw(drafter, dist, ends[node])
                tree.child_dist[node], tree.child_mode[node] = dist, self.child_mode
                for token in draws:
                    child = add(node, dist, token)
                    next_ends[child] = next_ends.get(child, 0) + 1
            ends = next_ends
