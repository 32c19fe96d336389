"""DynaTree (Chen, Liu, Li): confidence-aware adaptive tree under a node budget.

Four mechanisms, each switchable to rerun the paper's ablation (Table 4):
- dynamic breadth: node u gets B_min / B_mid / B_max children as its confidence c(u) = max q(.|u) is
  >= tau_h / in [tau_l, tau_h) / < tau_l (off: always B_mid);
- dynamic depth: u is expandable iff d(u) < D_max and p(u) >= rho_stop and (d(u) < D0 or p(u) > rho_deep),
  p(u) being the cumulative draft probability of the root-to-u path (off: iff d(u) < D0);
- pruning: children whose p falls below tau are not added; the node budget N_max is always strict (off: tau = 0);
- history: after each iteration, the window mean of acceptance (accepted / drafted) against a* (0.7) with a
  +-0.1 dead band moves D0, tau_h and rho_deep one step toward more (above) or less (below) aggressive drafting.
The tree grows level by level with one batched draft forward per level; within a level the most probable
parents are served first so the budget goes where the draft is confident.
"""
from collections import deque

from engine.strategies.base import Param, Strategy, StrategyError

DEAD_BAND = 0.1


class DynaTree(Strategy):
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
              "history adaptation steers the window's acceptance (accepted / drafted) toward a*"),
        Param("dynamic_breadth", True, label="dynamic breadth"),
        Param("dynamic_depth", True, label="dynamic depth"),
        Param("pruning", True, label="probability pruning"),
        Param("history", True, label="history adaptation"),
    )
    auto_param = "budget"  # the size the "auto" preset tunes from measured costs
    presets = {
        "cpu": {"d0": 4, "d_max": 7, "budget": 24, "b_mid": 2, "b_max": 3, "tau": 0.05},
        "paper": {"d0": 5, "d_max": 8, "budget": 256, "b_mid": 2, "b_max": 3, "tau": 0.05},
    }

    def check(self) -> None:
        c = self.config
        if not c["tau_l"] <= c["tau_h"]:
            raise StrategyError(f"tau_l ({c['tau_l']}) must not exceed tau_h ({c['tau_h']})")
        if not c["b_min"] <= c["b_mid"] <= c["b_max"]:
            raise StrategyError("branch bounds must satisfy B_min <= B_mid <= B_max")
        if not c["d0"] < c["d_max"]:
            raise StrategyError(f"D0 ({c['d0']}) must be below D_max ({c['d_max']})")
        if not c["rho_stop"] <= c["rho_deep"]:
            raise StrategyError(f"rho_stop ({c['rho_stop']}) must not exceed rho_deep ({c['rho_deep']})")

    def reset(self) -> None:
        c = self.config
        self.state = {"d0": c["d0"], "tau_h": c["tau_h"], "rho_deep": c["rho_deep"]}
        self.recent = deque(maxlen=c["window"])

    def current_params(self) -> dict:
        return {**self.config, **self.state}

    def expandable(self, tree, node: int) -> bool:
        c, s = self.config, self.state
        d, p = tree.depths[node], tree.path_q[node]
        if not c["dynamic_depth"]:
            return d < s["d0"]
        return d < c["d_max"] and p >= c["rho_stop"] and (d < s["d0"] or p > s["rho_deep"])

    def breadth(self, confidence: float) -> int:
        c, s = self.config, self.state
        if not c["dynamic_breadth"]:
            return c["b_mid"]
        if confidence >= s["tau_h"]:
            return c["b_min"]
        if confidence < c["tau_l"]:
            return c["b_max"]
        return c["b_mid"]

    def build(self, drafter, tree) -> None:
        c = self.config
        tau = c["tau"] if c["pruning"] else 0.0
        frontier = [0]
        while frontier and tree.num_drafted < c["budget"]:
            dists = drafter.expand(frontier)
            order = sorted(range(len(frontier)), key=lambda i: -tree.path_q[frontier[i]])
            children = []
            for i in order:
                node, dist = frontier[i], dists[i]
                k = self.breadth(tree.confidence[node])
                children += self.add_top_children(tree, node, dist, k, tau, c["budget"])
            frontier = [n for n in children if self.expandable(tree, n)]

    def observe(self, accepted: int, drafted: int) -> None:
        if not self.config["history"] or drafted == 0:
            return
        self.recent.append(accepted / drafted)
        mean = sum(self.recent) / len(self.recent)
        s, d_max = self.state, self.config["d_max"]
        a_star = self.config["a_star"]
        # A step moves each parameter toward its bound and never past where it already is: a value configured
        # outside the paper's range (e.g. D0 = 1) is left alone by a step that would move it the wrong way.
        if mean > a_star + DEAD_BAND:  # accepting well: draft deeper and wider
            s["d0"] = max(s["d0"], min(s["d0"] + 1, d_max - 1))
            s["tau_h"] = min(s["tau_h"], round(max(s["tau_h"] - 0.05, 0.5), 4))
            s["rho_deep"] = min(s["rho_deep"], round(max(s["rho_deep"] - 0.05, 0.3), 4))
        elif mean < a_star - DEAD_BAND:  # accepting poorly: more conservative
            s["d0"] = min(s["d0"], max(s["d0"] - 1, 2))
            s["tau_h"] = max(s["tau_h"], round(min(s["tau_h"] + 0.05, 0.95), 4))
            s["rho_deep"] = max(s["rho_deep"], round(min(s["rho_deep"] + 0.05, 0.8), 4))
