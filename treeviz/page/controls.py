"""Strategy parameter controls, built from each strategy's declared Params, and the one dict they reach /run as.

Every strategy gets a group of controls (only the selected strategy's group is visible). Before a run the visible
group's values are collected by name into a JSON dict (`params`), which is what /run takes: API callers pass
`params={"d0": 3}` and leave out what they do not change (the preset fills it in).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import gradio as gr

from engine.strategies import STRATEGIES, make_strategy
from engine.strategies.base import Param
from engine.verify import VERIFIERS, compatible_verifiers


def verifier_choices(strategy_name: str) -> list[str]:
    """"auto" plus the rules that can check this strategy's trees (its default child-drawing mode)."""
    return ["auto"] + compatible_verifiers(make_strategy(strategy_name))


def verifier_options(names: list[str]) -> list[tuple[str, str]]:
    """Dropdown (label, value) pairs: the rule's own label, so caveats in it (Khisti's weights) reach the user."""
    return [(f"{n}: {VERIFIERS[n].label}" if n in VERIFIERS else n, n) for n in names]


def _control(strategy: str, p: Param, value) -> gr.components.Component:
    common = {"label": p.label or p.name, "info": p.help or None, "elem_id": f"tv-param-{strategy}-{p.name}"}
    if p.kind is bool:
        return gr.Checkbox(value=bool(value), **common)
    if p.minimum is not None and p.maximum is not None:
        return gr.Slider(p.minimum, p.maximum, value=value, step=p.step or (1 if p.kind is int else 0.01), **common)
    return gr.Number(value=value, precision=0 if p.kind is int else None, **common)


@dataclass
class ParamControls:
    """The controls of every strategy: `entries` [(strategy, Param, component)], one visible group per strategy."""
    entries: list[tuple[str, Param, gr.components.Component]] = field(default_factory=list)
    groups: dict[str, gr.Group] = field(default_factory=dict)

    @classmethod
    def build(cls, selected: str) -> "ParamControls":
        out = cls()
        for name, strategy in STRATEGIES.items():
            values = strategy.preset_values("auto")  # the page opens on auto: it starts from the cpu values
            with gr.Group(visible=(name == selected)) as group:
                if not strategy.params:
                    gr.Markdown("_No parameters._")
                for p in strategy.params:
                    out.entries.append((name, p, _control(name, p, values[p.name])))
            out.groups[name] = group
        return out

    @property
    def components(self) -> list[gr.components.Component]:
        return [c for _, _, c in self.entries]

    def collect(self, strategy: str, *values) -> dict:
        """The selected strategy's values by parameter name (the `params` dict /run takes)."""
        return {p.name: v for (s, p, _), v in zip(self.entries, values) if s == strategy}

    def preset_updates(self, strategy: str, preset: str) -> list:
        cls = STRATEGIES.get(strategy)
        if cls is None or preset not in cls.preset_names():
            return [gr.skip()] * len(self.entries)
        values = cls.preset_values(preset)
        return [gr.update(value=values[p.name]) if s == strategy else gr.skip() for s, p, _ in self.entries]

    def strategy_updates(self, strategy: str, verifier: str) -> list:
        """summary, preset, verifier, then each group's visibility."""
        cls = STRATEGIES.get(strategy)
        if cls is None:
            return [gr.skip()] * (3 + len(self.groups))
        presets = cls.preset_names()
        rules = verifier_choices(strategy)  # only rules that can check this strategy's trees are offered
        return ([gr.update(value=cls.summary or ""),
                 gr.update(choices=presets, value="auto" if "auto" in presets else presets[0]),
                 gr.update(choices=verifier_options(rules), value=verifier if verifier in rules else "auto")]
                + [gr.update(visible=(s == strategy)) for s in self.groups])
