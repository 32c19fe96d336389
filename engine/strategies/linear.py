"""Linear speculative decoding (Leviathan et al.): a single chain of the draft's K most likely next tokens.

`stop_below` ends the chain early at the first draft token whose probability is below it (kept, since its draft
forward is already paid for): where the draft is unsure, further draft steps are likely wasted. This is the idea
behind transformers' `assistant_confidence_threshold`, here as a fixed threshold.
"""
from engine.strategies.base import Param, Strategy


class Linear(Strategy):
    name = "linear"
    label = "Linear chain"
    summary = "One chain of up to K greedy draft tokens, verified in one target pass."
    chain = True
    params = (
        Param("k", 5, 1, 64, 1, "K (chain length)", "draft tokens per iteration (at most)"),
        Param("stop_below", 0.0, 0.0, 1.0, 0.01, "stop below (draft confidence)",
              "end the chain after a draft token with probability below this (0 = always K)"),
    )
    auto_param = "k"  # the size the "auto" preset tunes from measured costs
    presets = {"cpu": {"k": 8, "stop_below": 0.5}, "paper": {"k": 5, "stop_below": 0.0}}

    def build(self, drafter, tree) -> None:
        node = 0
        for _ in range(self.config["k"]):
            dist = drafter.expand([node])[0]
            node = self.add_top_children(tree, node, dist, 1)[0]
            if tree.q[node] < self.config["stop_below"]:
                break
