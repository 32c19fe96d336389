"""DynaTree (Chen, Liu, Li): confidence-aware adaptive tree under a node budget.

Four mechanisms, each switchable to rerun the paper's ablation (Table 4):
- dynamic breadth: node u gets B_min / B_mid / B_max children as its confidence c(u) = max q(.|u) is
  >= tau_h / in [tau_l, tau_h) / < tau_l (off: always B_mid);
- dynamic depth: u is expandable iff d(u) < D_max and p(u) >= rho_stop and (d(u) < D0 or p(u) > rho_deep),
  p(u) being the cumulative draft probability of the root-to-u path (off: iff d(u) < D0);
- pruning: children whose p falls below tau are not added; the node budget N_max is always strict (off: tau = 0);
- history: after each iteration, proportional control of (D0, tau_h, tau_l) toward a target acceptance a*
  (the paper's update, on its subset of parameters): e = mean(a over the last W iterations) - a*, then
  D0 <- clip(D0 + eta_D e, 1, D_max - 1) (used rounded), tau_h <- clip(tau_h - eta_h e, 0, 1),
  tau_l <- clip(tau_l - eta_h e, 0, tau_h). Above a* the tree gets deeper and narrower (more nodes count as
  confident); below, shallower and wider. It moves both ways, and back.
The acceptance a of an iteration is per path: accepted draft tokens / depth of the drafted tree, in [0, 1]. 1 when
the deepest path the tree offered was accepted whole, 0 when nothing was. The paper's Table 3 measure counts the
bonus token too, which lets it pass 100 %; we leave the bonus out, so a draft that is never right reads 0 at any
depth instead of 1 / D (which would reach a* = 0.7 on a one-level tree). Accepted / drafted is not usable: a tree
with b children per node accepts at most one in b of its nodes, so that ratio sits below any useful a* and the
controller could only ever shrink the tree.
The tree grows level by level with one batched draft forward per level; within a level the most probable
parents are served first so the budget goes where the draft is confident.
"""
from collections import deque
from dataclasses import asdict

import torch

from engine.strategies.base import BudgetedStrategy, Param, StrategyError
from engine.strategies.graft import GRAFT_PARAMS


class DynaTree(BudgetedStrategy):
    name = "dynatree"
    label = "DynaTree"
    summary = "Breadth from draft confidence, depth from path probability, pruning under a budget, history feedback."
    params = (
        Param("tau_h", 0.9, 0.0, 1.0, 0.01, "tau_h (high confidence)", "c(u) >= tau_h -> B_min children"),
        Param("tau_l", 0.4, 0.0, 1.0, 0.01, "tau_l (low confidence)", "c(u) < tau_l -> B_max children"),
        Param("b_min", 1, 1, 16, 1, "B_min", "children of a confident node"),
        Param("b_mid", 2, 1, 16, 1, "B_mid", "children of a node of middling confidence"),
        Param("b_max", 3, 1, 16, 1, "B_max", "children of an unsure node"),
        Param("d0", 5, 1, 63, 1, "D0 (base depth)", "below D0 every likely-enough node expands"),
        Param("d_max", 8, 1, 64, 1, "D_max (max depth)", "hard depth limit"),
        Param("rho_stop", 0.1, 0.0, 1.0, 0.01, "rho_stop (early stop)", "stop expanding paths with p < rho_stop"),
        Param("rho_deep", 0.5, 0.0, 1.0, 0.01, "rho_deep (deep expansion)", "beyond D0 expand only if p > rho_deep"),
        Param("tau", 0.05, 0.0, 1.0, 0.01, "tau (pruning)", "children with cumulative draft probability < tau are pruned"),
        Param("budget", 256, 1, 1024, 1, "N_max (node budget)", "maximum drafted nodes per iteration"),
        Param("window", 10, 1, 1000, 1, "W (history window)", "iterations averaged by history adaptation"),
        Param("a_star", 0.7, 0.0, 1.0, 0.01, "a* (target acceptance)",
              "history adaptation steers the window's acceptance (accepted tokens / tree depth) toward a*"),
        Param("eta_d", 2.0, 0.0, 64.0, 0.1, "eta_D (depth step)", "D0 moves by eta_D x (acceptance - a*)"),
        Param("eta_h", 0.1, 0.0, 1.0, 0.01, "eta_h (threshold step)",
              "tau_h and tau_l move by -eta_h x (acceptance - a*)"),
        Param("dynamic_breadth", True, label="dynamic breadth"),
        Param("dynamic_depth", True, label="dynamic depth"),
        Param("pruning", True, label="probability pruning"),
        Param("history", True, label="history adaptation"),
        *GRAFT_PARAMS,
    )
    auto_param = "budget"  # the size the "auto" preset tunes from measured costs
    presets = {
        # a* 0.9 on the CPU: a draft forward costs a larger share of a target step there than on the paper's GPUs, and
        # the deeper trees the paper's 0.7 grows did not pay for their draft forwards (docs/control.md)
        "cpu": {"d0": 4, "d_max": 7, "budget": 24, "b_mid": 2, "b_max": 3, "tau": 0.05, "a_star": 0.9},
        "paper": {"d0": 5, "d_max": 8, "budget": 256, "b_mid": 2, "b_max": 3, "tau": 0.05, "a_star": 0.7},
    }

    def check(self) -> None:
        c = self.settings
        if not c.tau_l <= c.tau_h:
            raise StrategyError(f"tau_l ({c.tau_l}) must not exceed tau_h ({c.tau_h})")
        if not c.b_min <= c.b_mid <= c.b_max:
            raise StrategyError("branch bounds must satisfy B_min <= B_mid <= B_max")
        if not c.d0 < c.d_max:
            raise StrategyError(f"D0 ({c.d0}) must be below D_max ({c.d_max})")
        if not c.rho_stop <= c.rho_deep:
            raise StrategyError(f"rho_stop ({c.rho_stop}) must not exceed rho_deep ({c.rho_deep})")

    def __init__(self, preset: str = "cpu", **overrides):
        super().__init__(preset, **overrides)
        c = self.settings  # history adaptation's state: each run's fresh copy starts from the settings
        self.state = {"d0": c.d0, "tau_h": c.tau_h, "tau_l": c.tau_l}
        self.level = float(c.d0)  # D0 before rounding: small steps add up instead of rounding away
        self.recent = deque(maxlen=c.window)
        self.depth = 0  # depth of the tree last built (the acceptance's denominator)

    def current_params(self) -> dict:
        return {**asdict(self.settings), **self.state}

    def expandable(self, tree, node: int) -> bool:
        c, s = self.settings, self.state
        d, p = tree.depths[node], tree.path_q[node]
        if not c.dynamic_depth:
            return d < s["d0"]
        return d < c.d_max and p >= c.rho_stop and (d < s["d0"] or p > c.rho_deep)

    def breadth(self, confidence: float) -> int:
        c, s = self.settings, self.state
        if not c.dynamic_breadth:
            return c.b_mid
        if confidence >= s["tau_h"]:
            return c.b_min
        if confidence < s["tau_l"]:
            return c.b_max
        return c.b_mid

    def build_within(self, drafter, tree, budget: int) -> None:
        c = self.settings
        tau = c.tau if c.pruning else 0.0
        frontier = [0]
        while frontier and tree.num_drafted < budget:
            dists = drafter.expand(frontier)
            order = sorted(range(len(frontier)), key=lambda i: -tree.path_q[frontier[i]])
            breadths = [self.breadth(tree.confidence[node]) for node in frontier]
            tops = self.level_tops(dists, self.widest())  # the device phase's K: the same order among ties
            children = []
            for i in order:
                children += self.add_top_children(tree, frontier[i], dists[i], breadths[i], tau, budget, tops[i])
            frontier = [n for n in children if self.expandable(tree, n)]
        self.depth = max(tree.depths)

    def widest(self) -> int:
        """The most children any node may get."""
        return self.settings.b_max if self.settings.dynamic_breadth else self.settings.b_mid

    def device_plan(self) -> list[tuple[int, int]]:
        c = self.settings
        return self.level_widths(c.d_max if c.dynamic_depth else self.state["d0"], self.widest(), c.budget)

    def device_choose(self, tree, frontier, valid, probs) -> torch.Tensor:
        c, s = self.settings, self.state
        confidence = probs[:, 0].double()  # the top-1 probability: max q, as the host path's `confidence`
        breadth = torch.full_like(frontier, c.b_mid)
        if c.dynamic_breadth:
            breadth = torch.where(confidence >= s["tau_h"], c.b_min, torch.where(confidence < s["tau_l"], c.b_max,
                                                                                  breadth))
        rank = torch.arange(probs.shape[1], device=probs.device)
        tau = c.tau if c.pruning else 0.0
        return (rank < breadth[:, None]) & self.device_likely(tree, frontier, probs, tau)

    def device_expandable(self, tree, nodes) -> torch.Tensor:
        c, s = self.settings, self.state
        d, p = tree.depths[nodes], tree.path_q[nodes]
        if not c.dynamic_depth:
            return d < s["d0"]
        return (d < c.d_max) & (p >= c.rho_stop) & ((d < s["d0"]) | (p > c.rho_deep))

    def device_built(self, tree) -> None:
        self.depth = max(tree.depths)

    def observe(self, accepted: int, drafted: int) -> None:
        if not self.settings.history or self.depth == 0:
            return
        self.recent.append(min(accepted / self.depth, 1.0))
        c, s = self.settings, self.state
        error = sum(self.recent) / len(self.recent) - c.a_star
        self.level = min(max(self.level + c.eta_d * error, 1.0), c.d_max - 1.0)
        s["d0"] = int(self.level + 0.5)
        s["tau_h"] = round(min(max(s["tau_h"] - c.eta_h * error, 0.0), 1.0), 6)
        s["tau_l"] = round(min(max(s["tau_l"] - c.eta_h * error, 0.0), s["tau_h"]), 6)
