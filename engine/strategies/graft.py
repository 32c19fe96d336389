"""Lookup grafting: context-lookup branches (engine/lookup.py) merged into a draft model's tree.

A strategy takes the switch by listing `LookupGraft` first among its bases, adding GRAFT_PARAMS to its params and
naming its own tree builder `build_model` (DynaTree, DySpec, DDTree). With `lookup` on:

- Budget: the tree budget covers both. The model builds under `budget - reserve`, reserve = min(lookup_budget,
  budget // 2) (the model keeps at least half, also when the `auto` preset shrinks the budget); the lookup then fills
  what is left of `budget` (its reservation plus whatever the model did not use), so a tree never holds more than
  `budget` drafted nodes.
- Where branches attach: first under the root, merged through the model's nodes (a continuation that starts like a
  model path reuses those nodes, marked "both", and goes on below them); then, with room left, below the model's most
  probable leaf, looked up with that leaf's path as context (the model's best guess, continued from the context).
- Lossless: lookup children are deterministic ("topk") and are never added beside sampled siblings
  (engine/lookup.py). DynaTree, DySpec and DDTree draw "topk" children only, so a grafted tree holds "topk" children
  only and the rules that accept the model's trees accept it (greedy, token matching / NSS, NaiveTree, SpecInfer,
  Traversal; SpecTr and Khisti refuse "topk"). `child_modes_used` lists "topk" whenever the switch is on.
"""
from __future__ import annotations

from typing import Any

from engine.lookup import LookupIndex, build_lookup_tree, follow
from engine.strategies.base import Param
from engine.tree import DraftTree

MAX_MATCH = 6    # longest context suffix looked up
MAX_LEN = 8      # tokens taken after each match

GRAFT_PARAMS = (
    Param("lookup", False, label="graft lookup",
          help="merge continuations looked up in the prompt and output into the model's tree (same node budget)"),
    Param("lookup_budget", 4, 0, 256, 1, "lookup nodes",
          "nodes of the budget reserved for lookup (at most half): the model builds with the rest, lookup fills what "
          "the model leaves"),
    Param("lookup_min_match", 2, 1, MAX_MATCH, 1, "lookup min match",
          f"shortest suffix of the context that may be looked up (the longest is {MAX_MATCH})"),
    Param("lookup_continuations", 2, 1, 32, 1, "lookup continuations",
          f"distinct continuations (up to {MAX_LEN} tokens each) merged in per attachment point"),
)


class LookupGraft:
    """Mixin for a model strategy (before `Strategy` in the bases); the strategy implements `build_model`."""
    config: dict[str, Any]
    child_mode: str

    def __init__(self, preset: str = "cpu", **overrides: Any):
        super().__init__(preset, **overrides)
        self.uses_context = bool(self.config["lookup"])  # the decoder calls see_context only then
        if self.uses_context:
            self.child_modes_used = tuple(dict.fromkeys((*self.child_modes_used, "topk")))
        self.index = LookupIndex(self.config["lookup_min_match"], MAX_MATCH)
        self.vocab_size, self.device = None, None

    def build_model(self, drafter, tree: DraftTree) -> None:
        raise NotImplementedError

    def see_context(self, tokens: list[int], vocab_size: int | None = None, device=None) -> None:
        """Extend the index with the tokens committed since the last call (rebuilt when the context changed: a new
        run)."""
        self.index = follow(self.index, tokens)
        self.vocab_size, self.device = vocab_size or self.vocab_size, device or self.device

    def build(self, drafter, tree: DraftTree) -> None:
        """The model's tree under the budget less the lookup reservation, then the lookup branches (switch on)."""
        if not self.config["lookup"]:
            self.build_model(drafter, tree)
            return
        budget = self.config["budget"]
        self.config["budget"] = budget - min(self.config["lookup_budget"], budget // 2)
        try:
            self.build_model(drafter, tree)
        finally:
            self.config["budget"] = budget
        self.graft(tree, budget - tree.num_drafted)

    def graft(self, tree: DraftTree, room: int) -> list[int]:
        """Merge lookup branches into `tree` within `room` new nodes: under the root, then below the model's most
        probable leaf. Returns the new node ids; tree.extra["lookup_match"] holds the root's match length."""
        if not self.index.tokens:  # never saw the context (a build outside the decoder)
            return []
        conts = self.config["lookup_continuations"]
        leaf = best_leaf(tree)
        added = build_lookup_tree(tree, self.index, room, conts, MAX_LEN, vocab_size=self.vocab_size,
                                  device=self.device)
        match = tree.extra["lookup_match"]
        if leaf is not None and room > len(added):
            added += build_lookup_tree(tree, self.index, room - len(added), conts, MAX_LEN, under=leaf,
                                       vocab_size=self.vocab_size, device=self.device)
            tree.extra["lookup_match_leaf"] = tree.extra["lookup_match"]
        tree.extra["lookup_match"] = match
        return added


def best_leaf(tree: DraftTree) -> int | None:
    """The model's most probable leaf (highest path probability; the earliest on ties), or None for a bare root."""
    leaves = [v for v in range(1, len(tree)) if not tree.children[v]]
    return max(leaves, key=lambda v: (tree.path_q[v], -v), default=None)
