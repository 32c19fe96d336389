"""Fixed tree: branch B at every node down to depth D, pruning paths of low draft probability, under a budget."""
import torch

from engine.strategies.base import Param, Strategy


class FixedTree(Strategy):
    name = "fixed"
    label = "Fixed tree"
    summary = "Top-B children at every node to depth D; paths with cumulative draft probability < tau are pruned."
    params = (
        Param("depth", 5, 1, 32, 1, "D (depth)", "maximum tree depth"),
        Param("branch", 2, 1, 16, 1, "B (branching)", "children per expanded node"),
        Param("tau", 0.1, 0.0, 1.0, 0.01, "tau (pruning)", "drop nodes whose cumulative draft probability is below tau"),
        Param("budget", 32, 1, 1024, 1, "N_max (node budget)", "maximum drafted nodes per iteration"),
    )
    auto_param = "budget"  # the size the "auto" preset tunes from measured costs
    presets = {
        "cpu": {"depth": 4, "branch": 2, "tau": 0.1, "budget": 32},
        "paper": {"depth": 8, "branch": 3, "tau": 0.1, "budget": 256},
    }

    def build(self, drafter, tree) -> None:
        c = self.settings
        frontier = [0]
        for _ in range(c.depth):
            if not frontier or tree.num_drafted >= c.budget:
                break
            dists = drafter.expand(frontier)
            # Most probable parents first, so the budget goes to the likeliest paths.
            order = sorted(range(len(frontier)), key=lambda i: -tree.path_q[frontier[i]])
            tops = self.level_tops(dists, c.branch)
            next_frontier = []
            for i in order:
                next_frontier += self.add_top_children(
                    tree, frontier[i], dists[i], c.branch, c.tau, c.budget, tops[i])
            frontier = next_frontier

    def device_plan(self) -> list[tuple[int, int]]:
        return self.level_widths(self.settings.depth, self.settings.branch, self.settings.budget)

    def device_choose(self, tree, frontier, valid, probs) -> torch.Tensor:
        return self.device_likely(tree, frontier, probs, self.settings.tau)
