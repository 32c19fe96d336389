"""Linear speculative decoding (Leviathan et al.): a single chain of the draft's K most likely next tokens."""
from engine.strategies.base import Param, Strategy


class Linear(Strategy):
    name = "linear"
    label = "Linear chain"
    summary = "One chain of K greedy draft tokens, verified in one target pass."
    params = (Param("k", 5, 1, 64, 1, "K (chain length)", "draft tokens per iteration"),)
    presets = {"cpu": {"k": 5}, "paper": {"k": 5}}

    def build(self, drafter, tree) -> None:
        node = 0
        for _ in range(self.config["k"]):
            dist = drafter.expand([node])[0]
            node = self.add_top_children(tree, node, dist, 1)[0]
