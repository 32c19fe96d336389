"""What a strategy reports about one iteration's tree beside the tree itself, as typed records: the DraftTree
(engine/core/tree.py) carries them while it is built, the IterationRecord (engine/core/trace.py) keeps them in the
trace. Typed, so a reader (the `auto` sizer, the metrics, the figures) names a field instead of a string key."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LookupReport:
    """What the context lookup did (engine/core/lookup.py): the lookup strategy's whole draft, or the branches
    grafted onto a model strategy's tree (engine/strategies/graft.py)."""
    seconds: float = 0.0                  # its own work: index queries and tree building (no model forward)
    alone: bool = False                   # a grafted strategy verified the lookup's tree alone (model skipped)
    match: int = 0                        # length of the context suffix matched at the root (0: none)
    match_leaf: int | None = None         # the same below the model's most probable leaf, where the graft looked


@dataclass
class SelectorChoice:
    """The delayed tree's shape as its neural selector chose it for one iteration (engine/strategies/selector.py)."""
    k: int
    l1: int
    l2: int
    predicted_block_efficiency: float | None = None
    predicted_s: float | None = None      # the cost table's seconds for this shape (None without a table)
    predicted_tokens_per_s: float | None = None
    rule: str | None = None               # the rule family the selector was trained for
