"""Context lookup: no draft model. The tree is a trie of what followed the recent tokens earlier in the prompt and
the generated text (engine/core/lookup.py), so a draft costs a dict lookup and works on a target-only pair.

Lookup proposals are deterministic given the committed context: children are "topk" (each a draw from the point mass
on its token), which greedy, token matching / NSS, NaiveTree, SpecInfer and Traversal check losslessly at any
temperature (Naive and Block too when `max_continuations` = 1, a single chain). SpecTr and Khisti need i.i.d. draws
and refuse it. The "paper" preset is prompt lookup decoding's (Saxena 2023; transformers' `prompt_lookup_num_tokens`):
one continuation of up to 10 tokens, matches of 3 tokens down to 1.
"""
import time

from engine.core.lookup import LookupIndex, build_lookup_tree, follow
from engine.core.reports import LookupReport
from engine.strategies.base import Param, Strategy, StrategyError


class Lookup(Strategy):
    name = "lookup"
    label = "Context lookup (no draft)"
    summary = ("A trie of the continuations that followed the latest tokens earlier in the prompt and output; no "
               "draft model, so the draft costs nothing.")
    uses_draft = False
    child_mode = "topk"  # deterministic proposals
    params = (
        Param("budget", 16, 1, 256, 1, "N_max (node budget)", "maximum drafted nodes per iteration"),
        Param("min_match", 2, 1, 16, 1, "min match", "shortest suffix of the context that may be looked up"),
        Param("max_match", 6, 1, 16, 1, "max match", "longest suffix of the context that is looked up"),
        Param("max_continuations", 4, 1, 32, 1, "continuations", "distinct continuations merged into the tree"),
        Param("max_len", 8, 1, 64, 1, "continuation length", "tokens taken after each match"),
    )
    presets = {
        "cpu": {"budget": 16, "min_match": 2, "max_match": 6, "max_continuations": 4, "max_len": 8},
        "paper": {"budget": 10, "min_match": 1, "max_match": 3, "max_continuations": 1, "max_len": 10},
    }

    def __init__(self, preset: str = "cpu", **overrides):
        super().__init__(preset, **overrides)
        self.index = LookupIndex(self.settings.min_match, self.settings.max_match)
        self.vocab_size, self.device = None, None  # of the target's rows, from the run's hooks

    def check(self) -> None:
        if self.settings.min_match > self.settings.max_match:
            raise StrategyError(f"min_match ({self.settings.min_match}) must not exceed max_match "
                                f"({self.settings.max_match})")
        self.chain = self.settings.max_continuations == 1  # one continuation: a single path, for the chain rules

    def begin(self, run) -> None:
        self.device = run.pair.device

    def before_build(self, committed: list[int], width: int) -> None:
        """Extend the index with the tokens committed since the last call (rebuild it if the context changed)."""
        self.index = follow(self.index, committed)
        self.vocab_size = width

    def build(self, drafter, tree) -> None:
        c = self.settings
        start = time.perf_counter()
        build_lookup_tree(tree, self.index, c.budget, c.max_continuations, c.max_len,
                          vocab_size=self.vocab_size, device=self.device)
        # the lookup's own work is the whole draft
        tree.lookup = LookupReport(seconds=time.perf_counter() - start, match=self.index.last_match)
