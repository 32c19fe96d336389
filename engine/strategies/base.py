"""The one interface every tree strategy implements.

A strategy grows a `DraftTree` for one iteration by asking the `Drafter` to expand batches of nodes (one draft
forward per batch). It declares its parameters (so the CLI and the app build their controls from them), a "cpu"
preset tuned on a 2-core CPU, a "paper" preset with the source paper's values, an "auto" preset whose size knob
(`auto_param`) the decoder retunes every iteration from the measured cost table, and how it draws children
(which decides the verification rules that can check its trees losslessly when sampling).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from engine.drafter import Drafter
from engine.tree import DraftTree


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


class Strategy:
    name: ClassVar[str]
    label: ClassVar[str]
    summary: ClassVar[str]
    params: ClassVar[tuple[Param, ...]] = ()
    presets: ClassVar[dict[str, dict[str, Any]]] = {}  # "cpu" (default values), "paper", "auto"
    # The size knob the "auto" preset tunes per iteration from measured costs (engine/autosize.py); None: the
    # strategy has no single size knob and "auto" runs its starting values unchanged.
    auto_param: ClassVar[str | None] = None
    uses_draft: ClassVar[bool] = True
    child_mode: ClassVar[str] = "topk"  # "topk" (deterministic), "iid", or "without_replacement"
    # Every mode its trees may contain (a strategy may mix them, e.g. a greedy trunk under i.i.d. branches).
    child_modes_used: tuple[str, ...] = ()

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
        self.config = {key: known[key].coerce(value) for key, value in values.items()}
        self.check()
        self.reset()

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

    def reset(self) -> None:
        """Forget per-run state (history adaptation). Called before every run."""

    def current_params(self) -> dict[str, Any]:
        """Parameters in force for the next iteration (they may change under history adaptation)."""
        return dict(self.config)

    def build(self, drafter: Drafter, tree: DraftTree) -> None:
        raise NotImplementedError

    def observe(self, accepted: int, drafted: int) -> None:
        """Feedback after verification: accepted draft tokens out of drafted nodes."""

    # -- shared helpers ------------------------------------------------------------------------------------------
    @staticmethod
    def add_top_children(tree: DraftTree, node: int, dist: torch.Tensor, k: int, min_path_q: float = 0.0,
                         budget: int | None = None) -> list[int]:
        """Add the k most probable children of `node` under `dist`, skipping those whose path probability would fall
        below `min_path_q`, and never exceeding `budget` drafted nodes in the tree. Returns the new node ids."""
        tree.child_dist[node] = dist
        tree.child_mode[node] = "topk"
        if k <= 0:
            return []
        probs, tokens = torch.topk(dist, k)
        added = []
        for rank, (p, token) in enumerate(zip(probs.tolist(), tokens.tolist())):
            if budget is not None and tree.num_drafted >= budget:
                break
            if tree.path_q[node] * p < min_path_q:
                break  # sorted by probability: every later sibling is below the threshold too
            added.append(tree.add(node, token, p, rank))
        return added
