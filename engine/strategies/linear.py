"""Linear speculative decoding (Leviathan et al.): a single chain of up to K draft tokens.

Greedy decoding (temperature 0) drafts the draft's top-1 chain. Sampling (temperature > 0) is Leviathan et al.'s
speculative sampling: every chain token is drawn from the draft's processed distribution q (same temperature,
top-k, top-p as the target's p), with the run's seeded generator, so the chain rules (naive: accept with
min(1, p/q), else draw from the residual norm(max(p - q, 0))) verify it losslessly. A top-1 chain checked by
token matching at temperature > 0 would be lossless too, but it is not speculative sampling and accepts less.

`stop_below` ends the chain early at the first draft token whose probability is below it (kept, since its draft
forward is already paid for): where the draft is unsure, further draft steps are likely wasted. This is the idea
behind transformers' `assistant_confidence_threshold`, here as a fixed threshold.
"""
import torch

from engine.strategies.base import Param, Strategy


class Linear(Strategy):
    name = "linear"
    label = "Linear chain"
    summary = "One chain of up to K draft tokens (top-1 at T = 0, sampled from q at T > 0), one target pass."
    chain = True
    child_mode = "iid"  # sampled at T > 0; the greedy rule checks the T = 0 top-1 chain whatever the mode
    params = (
        Param("k", 5, 1, 64, 1, "K (chain length)", "draft tokens per iteration (at most)"),
        Param("stop_below", 0.0, 0.0, 1.0, 0.01, "stop below (draft confidence)",
              "end the chain after a draft token with probability below this (0 = always K)"),
    )
    auto_param = "k"  # the size the "auto" preset tunes from measured costs
    presets = {"cpu": {"k": 8, "stop_below": 0.5}, "paper": {"k": 5, "stop_below": 0.0}}

    @staticmethod
    def sample(dist: torch.Tensor, generator: torch.Generator) -> int:
        """One token drawn from `dist` (tests route this through their exact enumerator)."""
        return int(torch.multinomial(dist, 1, generator=generator))

    def build(self, drafter, tree) -> None:
        generator = drafter.generator  # the decoder gives the drafter one exactly when it samples
        node = 0
        for _ in range(self.settings.k):
            dist = drafter.expand([node])[0]
            if generator is None:
                node = self.add_top_children(tree, node, dist, 1)[0]
            else:
                token = self.sample(dist, generator)
                tree.child_dist[node], tree.child_mode[node] = dist, "iid"
                node = tree.add(node, token, float(dist[token]), int((dist > dist[token]).sum()))
            if tree.q[node] < self.settings.stop_below:
                break

    def device_plan(self) -> list[tuple[int, int]]:
        """K forwards of one row each: the top-1 chain (the device phase runs at temperature 0 only)."""
        return [(1, 1)] * self.settings.k

    def device_budget(self) -> int:
        return self.settings.k

    def device_expandable(self, tree, nodes) -> torch.Tensor:
        """The chain ends after a token whose q is below `stop_below`."""
        return tree.q[nodes] >= self.settings.stop_below
