"""Tree strategies, one module each, all behind `engine.strategies.base.Strategy`.

Besides the strategies: base.py (the interface and `Param`), sizing.py (the size knobs `auto` turns), graft.py
(lookup drafts grafted onto a model strategy), selector.py (the delayed tree's neural selector at decode time).
May import: verification rules and the core (contract `engine-rooms`).
"""
from engine.strategies.ar import Autoregressive
from engine.strategies.base import Param, Strategy, StrategyError
from engine.strategies.ddtree import DDTree
from engine.strategies.delayed import Delayed
from engine.strategies.dynatree import DynaTree
from engine.strategies.dyspec import DySpec
from engine.strategies.eagle2 import Eagle2
from engine.strategies.fixed import FixedTree
from engine.strategies.graft import grafted
from engine.strategies.linear import Linear
from engine.strategies.lookup import Lookup
from engine.strategies.salf import SALF

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (Autoregressive, Linear, FixedTree, DynaTree, DySpec, SALF, Eagle2, DDTree, Delayed,
                              Lookup)
}


def make_strategy(name: str, preset: str = "cpu", **params) -> Strategy:
    """The strategy `name` under `preset` with `params` overriding it; with its `lookup` switch on, of its grafted
    class (engine/strategies/graft.py `grafted_class`)."""
    if name not in STRATEGIES:
        raise StrategyError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
    return grafted(STRATEGIES[name](preset, **params))


__all__ = ["STRATEGIES", "Param", "Strategy", "StrategyError", "make_strategy"]
