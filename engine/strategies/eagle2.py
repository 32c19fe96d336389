"""EAGLE-2 beam search (Li et al., the baseline of salf-talf App. B): expand the deepest layer, then re-rank.

Expansion: the root's top-k children form layer 1; then `depth` expansion steps each take the k nodes of the deepest
layer with the highest path probability V (product of draft probabilities from the root), expand them in ONE draft
forward and add each one's top-k children. `depth` counts expansion steps after the root's top-k, as in EAGLE-2's
code (its `for i in range(depth)` loop after the first top-k) and so in the salf-talf paper's setting depth = 7: the
tree has depth + 1 layers and costs depth + 1 draft forwards (EAGLE-2's first one comes with the target's features,
which our separate draft model cannot use).
Re-ranking: keep the N nodes with the highest V. A child's V never exceeds its parent's, and ties go to the
shallower (then earlier) node, so the kept set is prefix-closed. Candidates live in the real tree while the draft
works (the drafter needs their ids); the rest are pruned at the end and the drafter's rows remapped.
"""
import torch

from engine.strategies.base import Param, Strategy
from engine.strategies.sizing import SizeCost, accepted_within, most_probable


class Eagle2(Strategy):
    name = "eagle2"
    label = "EAGLE-2 beam"
    summary = "The root's top-k, then `depth` steps expanding the deepest layer's top-k; the N most probable kept."
    params = (
        Param("n", 24, 1, 1024, 1, "N (tree size)", "nodes kept after re-ranking (root excluded)"),
        Param("k", 4, 1, 64, 1, "k (beam width)", "nodes expanded per layer, and children per expanded node"),
        Param("depth", 3, 0, 32, 1, "depth (expansion steps)",
              "expansion steps after the root's top-k: the tree has depth + 1 layers, depth + 1 draft forwards"),
    )
    auto_param = "n"  # the size the "auto" preset tunes from measured costs
    presets = {
        "cpu": {"n": 8, "k": 2, "depth": 2},
        "paper": {"n": 60, "k": 10, "depth": 7},
    }

    def cost_at(self, sample, size: int) -> SizeCost:
        """N only re-ranks: the beam's depth + 1 draft forwards are the same at every N, and N = size keeps the size
        most probable candidates."""
        kept = most_probable(sample, size)
        return SizeCost(len(kept), accepted_within(sample, kept), list(sample.draft_rows), len(kept) + 1)

    def build(self, drafter, tree) -> None:
        c = self.settings
        k = c.k
        layer = self.add_top_children(tree, 0, drafter.expand([0])[0], k)
        for _ in range(c.depth):
            beam = sorted(layer, key=lambda v: (-tree.path_q[v], v))[:k]
            if not beam:
                break
            dists = drafter.expand(beam)
            layer = []
            for node, dist, top in zip(beam, dists, self.level_tops(dists, k)):
                layer += self.add_top_children(tree, node, dist, k, top=top)
        ranked = sorted(range(1, len(tree)), key=lambda v: (-tree.path_q[v], tree.depths[v], v))
        if len(ranked) > c.n:
            drafter.remap(tree.prune([0] + ranked[: c.n]))

    def device_plan(self) -> list[tuple[int, int]]:
        """The root's forward, then `depth` forwards of the k-node beam, k children per node."""
        return [(1, self.settings.k)] + [(self.settings.k, self.settings.k)] * self.settings.depth

    def device_budget(self) -> int:
        return self.settings.k + self.settings.depth * self.settings.k ** 2

    def device_next(self, tree, added, width) -> tuple[torch.Tensor, torch.Tensor]:
        """The beam: the k new nodes of highest path probability, ties to the earlier node."""
        real = added != tree.dump
        order = torch.sort(tree.path_q[added].masked_fill(~real, -1.0), descending=True, stable=True).indices
        return added[order[:width]], real[order[:width]]

    def device_finish(self, tree) -> None:
        """Re-rank: keep the N nodes of highest path probability (ties: shallower, then earlier), the root too."""
        n = tree.capacity
        ids = torch.arange(n, device=tree.device)
        ranked = (ids > 0) & (ids < tree.count)
        by_depth = torch.sort(tree.depths[:n].masked_fill(~ranked, n), stable=True).indices
        order = by_depth[torch.sort(tree.path_q[by_depth].masked_fill(~ranked[by_depth], -1.0), descending=True,
                                    stable=True).indices]
        position = torch.empty_like(order)
        position[order] = ids
        tree.keep_only(ranked & (position < self.settings.n) | (ids == 0), min(n, self.settings.n + 1))
