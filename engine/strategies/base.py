"""The one interface every tree strategy implements.

A strategy grows a `DraftTree` for one iteration by asking the `Drafter` to expand batches of nodes (one draft
forward per batch). It declares its parameters (so the CLI and the app build their controls from them; they also
make its typed settings, `Settings`, one dataclass field per Param, which `__init__` fills in), a "cpu"
preset tuned on a 2-core CPU, a "paper" preset with the source paper's values, an "auto" preset whose size knob
(`auto_param`) the `auto` sizer retunes every iteration from the measured cost table, and how it draws children
(which decides the verification rules that can check its trees losslessly when sampling).

A run talks to its strategy, and to its plug-ins, through `RunHooks` only (the run began, before a tree, the draft's
rows, after the target's logits, after verification, the record made): context lookup sees the committed tokens, the
neural selector taps its features, and the `auto` sizer (engine/measure/autosize.py) resizes the tree, each in its
own module.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, make_dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from engine.core.drafter import Drafter
from engine.core.sampling import Sampling
from engine.core.tree import DraftTree
from engine.strategies.sizing import Sample, SizeCost, by_levels

if TYPE_CHECKING:
    from engine.core.trace import IterationRecord


class StrategyError(ValueError):
    """A parameter value that makes no sense for the strategy."""


@dataclass(frozen=True)
class Param:
    name: str
    default: Any
    minimum: float | None = None
    maximum: float | None = None
    step: float | None = None
    label: str = ""
    help: str = ""

    @property
    def kind(self) -> type:
        return type(self.default)

    def coerce(self, value: Any) -> Any:
        kind = self.kind
        try:
            if kind is bool:
                value = value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes", "on")
            elif kind is int:
                if float(value) != int(float(value)):
                    raise ValueError
                value = int(float(value))
            else:
                value = float(value)
        except (TypeError, ValueError):
            raise StrategyError(f"{self.name} must be a {kind.__name__}, got {value!r}") from None
        if kind is not bool:
            if self.minimum is not None and value < self.minimum:
                raise StrategyError(f"{self.name} = {value} is below its minimum {self.minimum}")
            if self.maximum is not None and value > self.maximum:
                raise StrategyError(f"{self.name} = {value} is above its maximum {self.maximum}")
        return value


class PairView(Protocol):
    """What a hook reads of the run's pair (engine/models/pair.py ModelPair, a room above this one)."""
    device: torch.device
    target: torch.nn.Module
    draft: torch.nn.Module | None


class CostTable(Protocol):
    """What a hook reads of the pair's measured cost table (engine/measure/costs.py PairCosts, a room above)."""

    @property
    def c(self) -> float | None: ...

    def t(self, rows: int) -> float: ...

    def predict(self, draft_rows: list[int], verify_rows: int, context: int | None = None) -> dict[str, float]: ...


class ModelSteps(Protocol):
    """A model's forwards and KV cache (engine/core/steps.py DynamicSteps or StaticSteps)."""
    length: int
    last_hidden: torch.Tensor | None

    def forward(self, tokens: list[int], positions, visible: torch.Tensor | None = None,
                last: int = 0) -> torch.Tensor: ...

    def keep(self, start: int, rows: list[int]) -> None: ...


@dataclass(frozen=True)
class RunInfo:
    """What a run hands its hooks when it begins (`RunHooks.begin`)."""
    pair: PairView
    strategy: "Strategy"        # the run's own strategy (a fresh copy of the decoder's)
    target: ModelSteps          # the target's forwards, its KV cache, `last_hidden`
    drafter: Drafter | None     # the draft side; None for a strategy without a draft model
    costs: CostTable | None     # the measured cost table as this run's forwards run, or None
    sampling: Sampling
    rule: str                   # the verification rule's name


class RunHooks:
    """The points where a run calls out to its strategy and its plug-ins (the `auto` sizer, engine/measure/autosize.py),
    in this order. Every hook is optional: the defaults do nothing, so a plug-in overrides only what it uses."""

    def begin(self, run: RunInfo) -> None:
        """The run began (before the prefill): its models' steps, drafter, costs, sampling and rule."""

    def before_build(self, committed: list[int], width: int) -> None:
        """Before each tree: every committed token so far (prompt + generated, ending with the next tree's root) and
        the width of the target's logits rows (a draft distribution a strategy records must match it)."""

    def rests(self) -> bool:
        """Whether this iteration drafts nothing (an AR step: the tree is the root alone)."""
        return False

    def watches_draft_rows(self) -> bool:
        """Whether `drafted` should see the draft's rows (asked once, after `begin`): watching makes the root's
        forward keep one more row and keeps a tree's choices on the host."""
        return False

    def drafted(self, nodes: list[int], dists: torch.Tensor) -> None:
        """Every processed draft row as the drafter makes it (q [k, V] of `nodes`); node DREW_ROOT (-1,
        engine/core/drafter.py) is the row before the root, which drew it."""

    def after_target(self, logits: torch.Tensor, row: int) -> None:
        """After each target forward (the prefill's too, `row` -1), before verification is committed: its logits and
        the row whose distribution drew the next root."""

    def observe(self, accepted: int, drafted: int) -> None:
        """After a built tree is verified and kept (not after a rested iteration): accepted draft tokens out of drafted
        nodes."""

    def recorded(self, record: "IterationRecord") -> None:
        """The iteration's record, times and cost filled in, after the iteration's clock stopped; may add to it."""


def settings_class(name: str, params: tuple[Param, ...]) -> type:
    """A dataclass with one typed field per Param (its kind, its default): a strategy's settings, filled in from a
    preset and the caller's values (the CLI's, the app's) by `Strategy.__init__`."""
    return make_dataclass(f"{name}Settings", [(p.name, p.kind, field(default=p.default)) for p in params])


class Strategy(RunHooks):
    """A tree builder. The decoder keeps the configured instance and gives each run a fresh copy, so the attributes
    a strategy learns while decoding (history adaptation, the lookup index) start over with every run; it hears the
    run through the `RunHooks` it overrides."""
    name: ClassVar[str]
    label: ClassVar[str]
    summary: ClassVar[str]
    params: ClassVar[tuple[Param, ...]] = ()
    Settings: ClassVar[type]  # made from `params` when the class is defined: `self.settings` is one of these
    presets: ClassVar[dict[str, dict[str, Any]]] = {}  # "cpu" (default values), "paper", "auto"
    # The size knob the "auto" preset tunes per iteration from measured costs (engine/measure/autosize.py); None: the
    # strategy has no single size knob and "auto" runs its starting values unchanged.
    auto_param: ClassVar[str | None] = None
    uses_draft: ClassVar[bool] = True  # False: the run loads no draft model and `build` gets no drafter
    child_mode: ClassVar[str] = "topk"  # "topk" (deterministic), "iid", or "without_replacement"
    # Every mode its trees may contain: (child_mode,), set per instance before check(), where a strategy that mixes
    # modes (e.g. a greedy trunk under i.i.d. branches) says otherwise.
    child_modes_used: tuple[str, ...]
    # What the verification rules read (an instance may override it from its settings): whether its trees are always
    # one path (so the chain rules, Naive and Block, can check them).
    chain: bool = False

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        cls.Settings = settings_class(cls.__name__, cls.params)

    def __init__(self, preset: str = "cpu", **overrides: Any):
        known = {p.name: p for p in self.params}
        if preset not in self.preset_names():
            raise StrategyError(f"{self.name} has no preset {preset!r}; choose from {self.preset_names()}")
        values = self.preset_values(preset)
        self.preset = preset
        self.auto = preset == "auto" and self.auto_param is not None
        for key, value in overrides.items():
            if key not in known:
                raise StrategyError(f"{self.name} has no parameter {key!r}; it takes {sorted(known)}")
            values[key] = value
        self.settings = self.Settings(**{key: known[key].coerce(value) for key, value in values.items()})
        self.child_modes_used = (self.child_mode,)
        self.check()

    @classmethod
    def preset_names(cls) -> list[str]:
        return [*cls.presets, *(["auto"] if "auto" not in cls.presets else [])]

    @classmethod
    def preset_values(cls, preset: str) -> dict[str, Any]:
        """Every parameter's value under `preset`. "auto" starts from the cpu values (unless a strategy declares its
        own) and retunes auto_param as it runs."""
        values = {p.name: p.default for p in cls.params}
        values.update(cls.presets.get(preset, cls.presets.get("cpu", {})))
        return values

    def check(self) -> None:
        """Cross-parameter validation; raise StrategyError with a clear message."""

    def current_params(self) -> dict[str, Any]:
        """Parameters in force for the next iteration (they may change under history adaptation)."""
        return asdict(self.settings)

    def build(self, drafter: Drafter, tree: DraftTree) -> None:
        raise NotImplementedError

    def size(self) -> int | None:
        """The value of the size knob (`auto_param`) in force, or None for a strategy without one."""
        return None if self.auto_param is None else getattr(self.settings, self.auto_param)

    def resize(self, value: int) -> None:
        """Set the size knob (the `auto` sizer's only way in): coerced and validated like a user's value, so a size
        the strategy would refuse at construction raises StrategyError here too and leaves the settings unchanged."""
        if self.auto_param is None:
            raise StrategyError(f"{self.name} has no size knob")
        param = next(p for p in self.params if p.name == self.auto_param)
        before = getattr(self.settings, self.auto_param)
        setattr(self.settings, self.auto_param, param.coerce(value))
        try:
            self.check()
        except StrategyError:
            setattr(self.settings, self.auto_param, before)
            raise

    def sizes(self) -> range:
        """The values of the size knob `resize` accepts, as the `auto` sizer may try them (none without a knob)."""
        if self.auto_param is None:
            return range(0)
        param = next(p for p in self.params if p.name == self.auto_param)
        return range(int(max(param.minimum or 1, 1)), int(param.maximum or 1024) + 1)

    def cost_at(self, sample: Sample, size: int) -> SizeCost:
        """What this strategy would have drafted, kept and accepted with its size knob at `size`, judged from an
        observed tree (engine/strategies/sizing.py). Default: a level-by-level builder under a node budget keeps
        its first `size` nodes and pays one draft forward per level; strategies built otherwise override it."""
        return by_levels(sample, size)

    # -- the device draft phase (engine/core/device_draft.py) ----------------------------------------------------
    def device_plan(self) -> list[tuple[int, int]] | None:
        """The tree as draft forwards of fixed sizes, built without reading the device: per forward (its rows, the
        children per row it may add), the root's first. None (the default): this strategy's choices need the host
        (sampled children, a neural selector, a lookup), and it builds on the host path."""
        return None

    def device_choose(self, tree, frontier: torch.Tensor, valid: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """Which of each frontier row's top-K children (`probs` [W, K], descending) this strategy adds, as
        `add_top_children` would: bool [W, K], a prefix of each row (the budget is the tree's to cut). Default: every
        child the draft could have proposed."""
        return self.device_likely(tree, frontier, probs, 0.0)

    @staticmethod
    def device_likely(tree, frontier: torch.Tensor, probs: torch.Tensor, min_path_q: float) -> torch.Tensor:
        """`add_top_children`'s test as tensors: q > 0 and a path probability of at least `min_path_q`, multiplied
        in float64 as Python multiplies the host path's."""
        return (probs > 0) & (tree.path_q[frontier, None] * probs.double() >= min_path_q)

    def device_budget(self) -> int:
        """The most drafted nodes the device phase's tree holds (its tensors' size)."""
        return self.settings.budget

    def device_expandable(self, tree, nodes: torch.Tensor) -> torch.Tensor:
        """Whether each new node (tree.dump where none was added) is expanded by the next draft forward."""
        return torch.ones_like(nodes, dtype=torch.bool)

    def device_next(self, tree, added: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next draft forward's frontier of `width` rows and which rows are real, from the level's new nodes
        (`grow`'s slots): by default the expandable ones in id order, as a level-by-level builder takes them."""
        return tree.compact(added, (added != tree.dump) & self.device_expandable(tree, added), width)

    def device_finish(self, tree) -> None:
        """After the last level, before verification: a strategy that re-ranks its tree prunes it here."""

    def device_built(self, tree: DraftTree) -> None:
        """The tree the device phase built, on the host: what a strategy learns from its own build."""

    @staticmethod
    def level_widths(levels: int, branch: int, budget: int) -> list[tuple[int, int]]:
        """(rows, branch) per forward of a tree that may branch `branch` ways per level: the root alone, then never
        more rows than the level above could give or the budget holds."""
        plan, width = [], 1
        for _ in range(levels):
            plan.append((width, branch))
            width = min(width * branch, budget)
        return plan

    # -- shared helpers ------------------------------------------------------------------------------------------
    @staticmethod
    def add_top_children(tree: DraftTree, node: int, dist: torch.Tensor, k: int, min_path_q: float = 0.0,
                         budget: int | None = None, top: tuple[list, list] | None = None) -> list[int]:
        """Add the k most probable children of `node` under `dist`, skipping those whose path probability would fall
        below `min_path_q`, and never exceeding `budget` drafted nodes in the tree. Returns the new node ids. A token
        with q = 0 (cut by the run's top-k / top-p) is never added: the draft could not have proposed it. `top`: the
        node's (probabilities, tokens) in order, already read from `level_tops` (one host read for a whole level)."""
        tree.child_dist[node] = dist
        tree.child_mode[node] = "topk"
        if k <= 0:
            return []
        if top is None:
            probs, tokens = torch.topk(dist, k)
            top = (probs.tolist(), tokens.tolist())
        added = []
        for rank, (p, token) in enumerate(zip(top[0][:k], top[1][:k])):
            if budget is not None and tree.num_drafted >= budget:
                break
            if p <= 0.0 or tree.path_q[node] * p < min_path_q:
                break  # sorted by probability: every later sibling is zero or below the threshold too
            added.append(tree.add(node, token, p, rank))
        return added

    @staticmethod
    def level_tops(dists: torch.Tensor, k: int) -> list[tuple[list, list]]:
        """Per row of `dists` [n, V], its k most probable (probabilities, tokens): one topk and one read to the host
        for a whole level, where a read per node would wait on the device once per node."""
        if k <= 0:
            return [([], []) for _ in range(len(dists))]
        probs, tokens = torch.topk(dists, min(k, dists.shape[-1]), dim=-1)
        return list(zip(probs.tolist(), tokens.tolist()))


class BudgetedStrategy(Strategy):
    """A strategy whose tree fits any node budget it is given (`build_within`); `build` gives it its own `budget`.
    Lookup grafting (engine/strategies/graft.py) wraps such a strategy and gives it less."""

    def build(self, drafter: Drafter, tree: DraftTree) -> None:
        self.build_within(drafter, tree, self.settings.budget)

    def build_within(self, drafter: Drafter, tree: DraftTree, budget: int) -> None:
        """The strategy's own tree, at most `budget` drafted nodes."""
        raise NotImplementedError

