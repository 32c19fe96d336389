"""The one run recipe: a `RunSpec` (plain, picklable data) -> a `Decoder` on a loaded pair.

The app, the bench, the command line and the scripts all build their runs here, so the rules that decide what a
run is live in one place: pair names (`split_pair`), "AR gets no explicit verification rule" (`make_rule`), the
sampling settings, and the chat fallback for tokenizers without a chat template (`prompt_for`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from engine.core.sampling import Sampling
from engine.core.trace import RunResult
from engine.decoder import Decoder, DecodeRun
from engine.measure.autosize import auto_sizing
from engine.models import PAIRS
from engine.strategies import make_strategy
from engine.verify import Verifier, make_verifier

AR = "ar"
WARM_UP_TOKENS = 8  # a short untimed run before a timed one: a run's first calls pay for allocation and kernel choice


@dataclass
class RunSpec:
    """Everything a run needs, as plain picklable data (it crosses ZeroGPU's process boundary)."""
    pair: str
    prompt: Any                        # str or chat messages
    strategy: str
    preset: str = "cpu"
    params: dict[str, Any] = field(default_factory=dict)
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    verifier: str = "auto"             # a rule's name, or "auto": the strategy's default rule
    stop_on_eos: bool = True
    stop_strings: tuple[str, ...] = ()
    # How model forwards run (engine/core/steps.py): "dynamic" (a growing cache), "static" (a preallocated cache,
    # row-count buckets) or "auto" (static exactly when the run takes the pair's captured steps); capture "auto"
    # takes them wherever the pair has them ready (engine/cpu/packages.py), "off" runs eagerly.
    steps: str = "auto"
    capture: str = "auto"
    # Where a tree's choices are made (engine/core/device_draft.py): "host", or "device" for the strategies that plan
    # their trees at temperature 0 (one read to the host per iteration).
    draft_phase: str = "host"

    def prompt_key(self) -> str:
        return json.dumps(self.prompt, sort_keys=True, ensure_ascii=False)

    def sampling(self) -> Sampling:
        return Sampling(temperature=float(self.temperature), top_k=int(self.top_k), top_p=float(self.top_p),
                        seed=int(self.seed))

    def as_method(self, method: str, params: dict | None = None) -> "RunSpec":
        """The same prompt and settings for another method ("dynatree", "dynatree@auto", "ar"): a Compare row."""
        name, _, preset = method.partition("@")
        return replace(self, strategy=name, preset=preset or ("auto" if name != self.strategy else self.preset),
                       params=dict(params or {}))

    def warm_up(self) -> "RunSpec":
        """The same run cut to WARM_UP_TOKENS new tokens: decoded, untimed, before this one is timed."""
        return replace(self, max_new_tokens=min(WARM_UP_TOKENS, self.max_new_tokens))


def split_pair(name: str) -> tuple[str, str | None]:
    """A pair name -> (target spec, draft spec): a named pair, "TARGET + DRAFT", or one model drafting for itself."""
    if name in PAIRS:
        return PAIRS[name]
    if " + " in name:
        target, draft = (s.strip() for s in name.split(" + ", 1))
        return target, draft
    return name, name


def make_rule(spec: RunSpec) -> Verifier | None:
    """The verification rule a spec names; None picks the strategy's default. AR has no draft to verify."""
    if spec.strategy == AR or spec.verifier in ("auto", "", None):
        return None
    return make_verifier(spec.verifier)


def prompt_for(pair, prompt):
    """Chat messages become plain text for a tokenizer without a chat template (e.g. the tiny test pair)."""
    if isinstance(prompt, list) and not getattr(pair.tokenizer, "chat_template", None):
        return "\n".join(str(m.get("content", "")) for m in prompt)
    return prompt


def make_decoder(pair, spec: RunSpec, verifier: Verifier | None = None) -> Decoder:
    """`verifier` overrides the spec's rule with an instance (scripts wrap rules to record what they accept)."""
    strategy = make_strategy(spec.strategy, spec.preset, **spec.params)
    rule = verifier if verifier is not None and spec.strategy != AR else make_rule(spec)
    plugins = (auto_sizing,) if strategy.auto else ()  # the "auto" preset: its sizer resizes the tree every iteration
    return Decoder(pair, strategy, verifier=rule, sampling=spec.sampling(), steps=spec.steps, capture=spec.capture,
                   draft_phase=spec.draft_phase, plugins=plugins)


def start_run(pair, spec: RunSpec, verifier: Verifier | None = None) -> DecodeRun:
    """A ready-to-iterate run of `spec` on `pair` (one `IterationRecord` per target pass; `.result` at the end)."""
    return make_decoder(pair, spec, verifier).run(
        prompt_for(pair, spec.prompt), max_new_tokens=int(spec.max_new_tokens), stop_on_eos=spec.stop_on_eos,
        stop_strings=tuple(spec.stop_strings))


def generate(pair, spec: RunSpec, verifier: Verifier | None = None) -> RunResult:
    """`spec` decoded to the end on `pair`."""
    return start_run(pair, spec, verifier).to_end()


def check_spec(spec: RunSpec) -> None:
    """Refuse a spec that cannot run (strategy, its parameters, sampling, the rule's name) before any model loads."""
    make_strategy(spec.strategy, spec.preset, **spec.params)
    spec.sampling()
    make_rule(spec)
