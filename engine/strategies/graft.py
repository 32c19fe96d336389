"""Lookup grafting: context-lookup branches (engine/core/lookup.py) merged into a draft model's tree.

A strategy offers the switch by being a `BudgetedStrategy` (its tree builder `build_within(drafter, tree, budget)`
takes any budget) and adding GRAFT_PARAMS to its params (DynaTree, DySpec, DDTree). With `lookup` on, `make_strategy`
makes it of the strategy's grafted class (`grafted_class`: `LookupGrafted` in front of the strategy's own class), which
adds the lookup index, the gate and the tree's lookup branches, and is the strategy in everything else:

- Budget: the tree budget covers both. The model builds under `budget - reserve`, reserve = min(lookup_budget,
  budget // 2) (the model keeps at least half, also when the `auto` preset shrinks the budget); the lookup then fills
  what is left of `budget` (its reservation plus whatever the model did not use), so a tree never holds more than
  `budget` drafted nodes.
- Where branches attach: first under the root, merged through the model's nodes (a continuation that starts like a
  model path reuses those nodes, marked "both", and goes on below them); then, with room left, below the model's most
  probable leaf, looked up with that leaf's path as context (the model's best guess, continued from the context).
- The gate (`lookup_gate`, on by default with the switch), from this run's record (`LookupGate`, learned every
  iteration from what was committed) and the pair's measured cost table (engine/measure/costs.py; never wall time, so
  the choice is a function of the context and a seeded run repeats):
  - an iteration whose context the lookup matches may skip the draft model altogether and verify the lookup's tree
    alone (the whole budget), when that is expected to decode faster: tokens per predicted second, lookup alone at
    the current match length against the model's tree;
  - a model iteration gets no lookup rows when the lookup's expected tokens at this match length are worth less
    than the verification time its rows add, at the model's rate.
- Lossless: lookup children are deterministic ("topk") and are never added beside sampled siblings
  (engine/core/lookup.py). DynaTree, DySpec and DDTree draw "topk" children only, so a grafted tree holds "topk"
  children only and the rules that accept the model's trees accept it (greedy, token matching / NSS, NaiveTree,
  SpecInfer, Traversal; SpecTr and Khisti refuse "topk"). `child_modes_used` lists "topk" whenever the switch is on.
"""
from __future__ import annotations

import time
from dataclasses import asdict
from functools import cache

from engine.core.lookup import LookupIndex, build_lookup_tree, follow
from engine.core.reports import LookupReport
from engine.core.tree import DraftTree
from engine.strategies.base import BudgetedStrategy, Param, Strategy

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
    Param("lookup_gate", True, label="lookup gate (measured)",
          help="from this run's record of lookup hits and the pair's cost table: skip the draft model where the "
               "lookup tree alone decodes faster, and add no lookup rows where they cost more than they return"),
)
SMOOTHING = 0.3  # weight of the newest iteration in the gate's running means


class LookupGate:
    """Whether an iteration drafts with the lookup alone, and whether a model iteration gets lookup rows, from this
    run's record.

    After every iteration the tokens it committed are compared with what was proposed at that root, per match length
    of the lookup there: how many leading tokens of the lookup's best continuation were right (what a lookup-only
    tree would have had accepted: at least that many, since the iteration may have stopped first), and how many of
    those lay beyond the path the model's own nodes had right (what grafting added: the lookup's marginal gain; it is
    learned whether or not the lookup was grafted, so leaving it out does not stop the learning). Beside them, the
    model iterations' tokens per predicted second. An iteration goes lookup-only when (1 + expected lookup tokens) /
    its predicted seconds beats the model's rate; a model iteration gets lookup rows when their expected gain beats
    what the model earns in the seconds those rows add. Until there is a record, the model drafts and lookup is
    grafted."""

    def __init__(self):
        self.lookup_tokens: dict[int, float] = {}  # match length -> running mean of tokens the lookup had right
        self.graft_gain: dict[int, float] = {}  # match length -> ... of those beyond the model's own right path
        self.any_gain: float | None = None  # the same over every match length (a short run sees few of each)
        self.model_rate: float | None = None  # running mean of a model iteration's tokens per predicted second
        # the last iteration: (lookup only, match, the lookup's best continuation, predicted seconds, its tree)
        self.last: tuple[bool, int, list[int], float, DraftTree] | None = None

    def learn(self, committed: list[int]) -> None:
        """The tokens the last iteration committed (accepted + bonus)."""
        if self.last is None or not committed:
            return
        alone, match, continuation, seconds, tree = self.last
        if match:
            right = _common(continuation, committed)
            self.lookup_tokens[match] = _mean(self.lookup_tokens.get(match), right)
            if not alone:
                gain = max(0, right - len(model_right_path(tree, committed)))
                self.graft_gain[match] = _mean(self.graft_gain.get(match), gain)
                self.any_gain = _mean(self.any_gain, gain)
        if not alone and seconds > 0:
            self.model_rate = _mean(self.model_rate, len(committed) / seconds)
        self.last = None

    def worth_grafting(self, match: int, extra_s: float) -> bool:
        """Whether lookup rows that add `extra_s` predicted seconds of verification to a model iteration are expected
        to add more tokens than the model's rate earns in that time: the record at this match length, else over all
        match lengths. With no record yet, yes (as with the gate off)."""
        expected = self.graft_gain.get(match, self.any_gain)
        if expected is None or self.model_rate is None:
            return True
        return expected > self.model_rate * extra_s

    def lookup_only(self, match: int, seconds: float) -> bool:
        """Whether a lookup-only tree at this match length, predicted to take `seconds`, decodes faster."""
        expected = self.lookup_tokens.get(match)
        if not match or expected is None or self.model_rate is None or seconds <= 0:
            return False
        return (1.0 + expected) / seconds > self.model_rate


def _common(proposed: list[int], committed: list[int]) -> int:
    """How many leading tokens of `proposed` were committed."""
    return next((i for i, (a, b) in enumerate(zip(proposed, committed)) if a != b), min(len(proposed), len(committed)))


def model_right_path(tree: DraftTree, committed: list[int]) -> list[int]:
    """The leading committed tokens the model's own nodes (source "model" or "both") hold as a path from the root
    (a lookup node, or none, ends it)."""
    path, node = [], 0
    for token in committed:
        child = tree.child_with_token(node, token)
        if child is None or tree.source[child] not in ("model", "both"):
            break
        path.append(token)
        node = child
    return path


def _mean(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


class LookupGrafted(BudgetedStrategy):
    """Lookup branches grafted into a model strategy's trees, in front of that strategy's class (`grafted_class`):
    what grafting adds (the index, the gate, `build`, the hooks it needs: `begin`, `before_build`, `observe`; the
    child modes) is here, and each calls the strategy's own through `super()`; everything else is the strategy's."""

    def __init__(self, preset: str = "cpu", **overrides):
        super().__init__(preset, **overrides)
        self.child_modes_used = tuple(dict.fromkeys((*self.child_modes_used, "topk")))
        self.index = LookupIndex(self.settings.lookup_min_match, MAX_MATCH)
        self.gate = LookupGate()
        self.vocab_size, self.device, self.costs, self.alone = None, None, None, False

    def device_plan(self) -> None:
        """None: the lookup reads the committed tokens on the host, so a grafted tree builds there."""
        return None

    def begin(self, run) -> None:
        """The model strategy's own `begin`, and the pair's device and cost table for the lookup and its gate."""
        super().begin(run)
        self.device, self.costs = run.pair.device, run.costs

    def before_build(self, committed: list[int], width: int) -> None:
        """Extend the index with the tokens committed since the last call (rebuilt when the context changed: a new
        context, which also starts a new gate record); the gate learns from those tokens."""
        super().before_build(committed, width)
        seen = len(self.index.tokens)
        fresh = follow(self.index, committed)
        if fresh is not self.index or not seen:
            self.gate = LookupGate()
        else:
            self.gate.learn(committed[seen:])
        self.index = fresh
        self.vocab_size = width

    def build(self, drafter, tree: DraftTree) -> None:
        """The model's tree under the budget less the lookup reservation, then the lookup branches; or, where the gate
        says so, the lookup's tree alone under the whole budget. The tree's LookupReport (`tree.lookup`) records
        `alone` and `seconds`, what the lookup's own work took (index queries and grafting; no model forward)."""
        self.alone, budget = False, self.settings.budget
        start = time.perf_counter()
        best, match, alone_s = self.probe(len(tree), budget)
        self.alone = bool(self.settings.lookup_gate) and self.gate.lookup_only(match, alone_s)
        lookup_s = time.perf_counter() - start
        if not self.alone:
            self.build_within(drafter, tree, budget - min(self.settings.lookup_budget, budget // 2))
        start = time.perf_counter()
        self.graft(tree, self.room(tree, budget, match))
        tree.lookup.seconds, tree.lookup.alone = lookup_s + time.perf_counter() - start, self.alone
        seconds = alone_s if self.alone else self.predicted_s(drafter.row_counts, len(tree))
        self.gate.last = (self.alone, match, best, seconds, tree)

    def probe(self, rows: int, budget: int) -> tuple[list[int], int, float]:
        """The lookup's best continuation at the root, its match length, and the predicted seconds of verifying a
        lookup-only tree (at most the budget, or every continuation's tokens)."""
        found = self.index.continuations(1, MAX_LEN) if self.index.tokens else []
        best, match = (found[0][0], self.index.last_match) if found else ([], 0)
        size = rows + min(budget, self.settings.lookup_continuations * MAX_LEN)
        return best, match, self.predicted_s([], size)

    def room(self, tree: DraftTree, budget: int, match: int) -> int:
        """Nodes the lookup may add: what the budget leaves; none in a model iteration where the gate's record says
        the lookup's rows would cost more verification time than they return (the graft must not cost where it does
        not help)."""
        room = budget - tree.num_drafted
        if self.alone or not self.settings.lookup_gate or room <= 0:
            return room
        rows = len(tree) + min(room, self.settings.lookup_continuations * MAX_LEN)
        extra_s = self.predicted_s([], rows) - self.predicted_s([], len(tree))
        return room if self.gate.worth_grafting(match, extra_s) else 0

    def predicted_s(self, draft_rows: list[int], verify_rows: int) -> float:
        """An iteration's seconds as the pair's cost table predicts them (0 without a table: the gate stays shut)."""
        if self.costs is None:
            return 0.0
        return self.costs.predict(draft_rows, verify_rows, context=len(self.index.tokens))["total_s"]

    def observe(self, accepted: int, drafted: int) -> None:
        """The model strategy's feedback (DynaTree's history), except after a lookup-only iteration: the model
        drafted nothing then."""
        if not self.alone:
            super().observe(accepted, drafted)

    def graft(self, tree: DraftTree, room: int) -> list[int]:
        """Merge lookup branches into `tree` within `room` new nodes: under the root, then below the model's most
        probable leaf. Returns the new node ids; tree.lookup reports the match lengths at the root and at the leaf."""
        tree.lookup = LookupReport()
        if not self.index.tokens:  # never saw the context (a build outside the decoder)
            return []
        conts = self.settings.lookup_continuations
        leaf = best_leaf(tree)
        added = build_lookup_tree(tree, self.index, room, conts, MAX_LEN, vocab_size=self.vocab_size,
                                  device=self.device)
        tree.lookup.match = self.index.last_match
        if leaf is not None and room > len(added):
            added += build_lookup_tree(tree, self.index, room - len(added), conts, MAX_LEN, under=leaf,
                                       vocab_size=self.vocab_size, device=self.device)
            tree.lookup.match_leaf = self.index.last_match
        return added


def best_leaf(tree: DraftTree) -> int | None:
    """The model's most probable leaf (highest path probability; the earliest on ties), or None for a bare root."""
    leaves = [v for v in range(1, len(tree)) if not tree.children[v]]
    return max(leaves, key=lambda v: (tree.path_q[v], -v), default=None)


@cache
def grafted_class(model: type[BudgetedStrategy]) -> type[LookupGrafted]:
    """`model`'s grafted class, Grafted<Model>: LookupGrafted in front of it (one class per model, made once)."""
    return type(f"Grafted{model.__name__}", (LookupGrafted, model), {"__module__": __name__})


def grafted(strategy: Strategy) -> Strategy:
    """`strategy` as its grafted class, with the same preset and settings, when it offers the switch and has it on;
    else `strategy` itself."""
    if isinstance(strategy, BudgetedStrategy) and getattr(strategy.settings, "lookup", False):
        return grafted_class(type(strategy))(strategy.preset, **asdict(strategy.settings))
    return strategy

