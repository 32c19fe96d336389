"""The decoding loop (ARCHITECTURE.md): draft a tree, verify it in one target forward, keep, commit, repeat.

    run = Decoder(pair, make_strategy("dynatree")).run("def fib(n):", max_new_tokens=64)
    for record in run:          # one IterationRecord per target verification pass, while decoding
        ...
    result = run.result         # RunResult: output, metrics, every record

A `Decoder` is a recipe (a pair, a strategy, a verification rule, sampling settings, how forwards run, plug-ins); it
only starts runs. A `DecodeRun` owns everything one run holds (its own copy of the strategy, both models' steps and
caches, the output so far) and is the loop: start, prefill, then one `iterate` per tree, each record completed
outside the decode time. The run calls its strategy and plug-ins only through the hooks of
engine/strategies/base.py `RunHooks` (context lookup, the neural selector's features, the `auto` sizer live in their
own modules; the recipe, engine/recipe.py, hands in the plug-ins).

Conventions: the root of each tree is the last committed token, not yet in either KV cache; tree nodes sit at
positions P + depth (P = target cache length); the target sees an additive ancestor-only mask; after verification
both caches keep the accepted rows by copying them into place (no re-forward).
"""
from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from engine.core import device_draft, kv
from engine.core.drafter import Drafter, softmax_processor
from engine.core.prompts import Prompt, PromptError, encode_prompt, prompt_text
from engine.core.sampling import Sampling
from engine.core.steps import DynamicSteps, pair_static_steps
from engine.core.tensor_tree import TensorTree
from engine.core.trace import IterationRecord, RunConfig, RunResult, RunSampling, TokenSource, known
from engine.core.tree import DraftTree
from engine.measure.clock import StageClock
from engine.measure.metrics import run_metrics
from engine.models.devices import machine_label
from engine.records import complete_record, iteration_cost, iteration_record, margins
from engine.runtime import synchronize
from engine.strategies.base import RunHooks, RunInfo, Strategy
from engine.verify import Verdict, VerificationError, Verifier, default_verifier

if TYPE_CHECKING:
    from engine.models import ModelPair

# A run plug-in: given the run that begins, its hooks, or None where it does not apply to this run (e.g.
# engine/measure/autosize.py `auto_sizing`).
Plugin = Callable[[RunInfo], "RunHooks | None"]


@dataclass
class StopRule:
    max_new_tokens: int = 64
    eos_ids: tuple[int, ...] = ()  # empty: EOS does not stop
    stop_strings: tuple[str, ...] = ()

    def cut(self, tokenizer, generated: list[int], new: list[int]) -> tuple[list[int], str]:
        """Truncate `new` (appended to `generated`) where decoding must stop; returns (kept, reason or "")."""
        room = self.max_new_tokens - len(generated)
        kept, reason = new[:room], ("max_new_tokens" if len(new) >= room else "")
        for i, token in enumerate(kept):
            if token in self.eos_ids:
                kept, reason = kept[: i + 1], "eos"
                break
        if self.stop_strings:
            start = max(0, len(generated) - 8)  # a stop string may begin in tokens already committed
            for i in range(len(kept)):
                tail = tokenizer.decode(generated[start:] + kept[: i + 1])
                if any(s in tail for s in self.stop_strings):
                    return kept[: i + 1], "stop_string"
        return kept, reason


@dataclass(frozen=True, eq=False)
class Decoder:
    """A run recipe: a pair, a strategy, a verification rule, sampling settings, how the forwards run, and the run
    plug-ins. `run` starts a DecodeRun with it; nothing in it changes while runs decode (each run decodes with a
    fresh copy of `strategy`, so two runs of one decoder start alike). A strategy on the "auto" preset resizes only
    with engine/measure/autosize.py `auto_sizing` among the plug-ins (engine/recipe.py `make_decoder` adds it)."""
    pair: "ModelPair" = field(repr=False)
    strategy: Strategy
    verifier: Verifier | None = None  # None: the strategy's default rule at these sampling settings
    sampling: Sampling | None = None  # None: greedy (temperature 0)
    # steps "auto" | "static" | "dynamic" (engine/core/steps.py): "auto" is static exactly when the run takes the
    # pair's captured steps; capture "auto" | "off": "auto" takes them wherever the pair has them ready
    # (engine/cpu/packages.py), so runs take the steps its cost table measured; "off" runs eagerly (the bench's
    # eager AR).
    steps: str = "auto"
    capture: str = "auto"
    # "host" | "device": where a tree's choices are made. "device" grows the tree of a strategy that plans it
    # (engine/core/device_draft.py) on the device and reads it back once per iteration, at temperature 0 with greedy
    # verification; other iterations stay on the host.
    draft_phase: str = "host"
    plugins: tuple[Plugin, ...] = ()
    captured: bool = field(init=False)
    static: bool = field(init=False)
    costs: Any = field(init=False, repr=False)  # the cost table priced as this decoder's forwards run, or None

    def __post_init__(self):
        pair, strategy, steps, capture = self.pair, self.strategy, self.steps, self.capture
        if strategy.uses_draft and pair.draft is None:
            raise ValueError(f"strategy {strategy.name!r} needs a draft model, and this pair has none")
        sampling = self.sampling or Sampling()
        verifier = self.verifier or default_verifier(strategy.child_mode, sampling.greedy)
        if verifier.greedy_only and not sampling.greedy:
            raise VerificationError(f"verification rule {verifier.name!r} is exact only at temperature 0; "
                                    f"at temperature {sampling.temperature:g} pick a sampling rule")
        verifier.check_strategy(strategy)
        if self.draft_phase not in ("host", "device"):
            raise ValueError(f"draft_phase must be host or device, not {self.draft_phase!r}")
        if steps not in ("auto", "static", "dynamic") or capture not in ("auto", "off"):
            raise ValueError(f"steps must be auto, static or dynamic and capture auto or off, not {steps!r} / "
                             f"{capture!r}")
        captured = capture == "auto" and pair.capture_ready
        costs = pair.costs if pair.costs is None or captured else pair.costs.eager()  # with captured steps, or eager
        for name, value in (("sampling", sampling), ("verifier", verifier), ("captured", captured),
                            ("static", steps == "static" or (steps == "auto" and captured)), ("costs", costs)):
            object.__setattr__(self, name, value)  # frozen: the derived settings are set once, here

    def run(self, prompt: Prompt, max_new_tokens: int = 64, stop_on_eos: bool = True,
            stop_strings: tuple[str, ...] = (), eos_token_ids: list[int] | None = None) -> "DecodeRun":
        """`eos_token_ids` overrides the pair's end-of-sequence tokens; `stop_on_eos=False` ignores them."""
        if not 1 <= int(max_new_tokens) <= 100_000:
            raise ValueError(f"max_new_tokens must be between 1 and 100000, got {max_new_tokens}")
        eos = tuple(eos_token_ids if eos_token_ids is not None else self.pair.eos_token_ids) if stop_on_eos else ()
        return DecodeRun(self, prompt, StopRule(int(max_new_tokens), eos, tuple(s for s in stop_strings if s)))

    def generate(self, prompt: Prompt, **kwargs) -> RunResult:
        return self.run(prompt, **kwargs).to_end()

    def model_steps(self, role: str, prompt_len: int, max_new_tokens: int):
        """A model's steps for a new run: the dynamic path, or the pair's static steps reset (built once per pair and
        reused by every later run that fits, engine/core/steps.py `pair_static_steps`: allocating a static cache and
        capturing its graphs takes seconds)."""
        if not self.static:
            return DynamicSteps(self.pair.target if role == "target" else self.pair.draft)
        return pair_static_steps(self.pair, role, prompt_len, max_new_tokens, self.captured)

    def steps_label(self) -> str:
        """How this decoder's forwards run: "captured (AOTInductor)", "CUDA graphs" or "eager"."""
        if not self.captured:
            return "eager"
        return "CUDA graphs" if self.pair.graphs else "captured (AOTInductor)"


class DecodeRun:
    """One decoding run and everything it holds while it decodes; iterate it to decode (one IterationRecord per
    tree). `result` is set when iteration ends."""

    def __init__(self, decoder: Decoder, prompt: Prompt, stop: StopRule):
        self.decoder, self.prompt, self.stop = decoder, prompt, stop
        self.result: RunResult | None = None
        # Seconds the consumer held the run between iterations (drawing figures, streaming): not decoding time, so
        # the run's wall time (tokens/s, TPOT) leaves them out and a streamed run compares fairly with a silent AR run.
        self.paused_s = 0.0
        self._paused_at: float | None = None
        self.started: float | None = None  # perf_counter() when decoding began (the prefill); None before it
        self.generated: list[int] = []  # committed output tokens so far
        self.records: list[IterationRecord] = []
        self.sources: list[TokenSource] = []  # per output token: where it came from
        self.stop_reason = ""  # set when decoding must stop ("eos", "max_new_tokens", "stop_string")
        self.tree: DraftTree | None = None  # the last iteration's tree and target logits, until `complete` reads them
        self.logits: torch.Tensor | None = None
        # set by `start`: the prompt's ids, the run's own strategy, both models' steps, the drafter (None for a
        # strategy without a draft model), the seeded generator (None when greedy), the hooks, the machine's label
        self.prompt_ids: list[int] = []
        self.strategy: Strategy = decoder.strategy
        self.target = None
        self.drafter: Drafter | None = None
        self.generator: torch.Generator | None = None
        self.hooks: list[RunHooks] = []
        self.machine = ""
        # set by `prefill`: the width of the target's logits rows, seconds to the first token
        self.width = 0
        self.ttft = 0.0

    def __iter__(self):
        # Inference mode per call, not across yields: a consumer (a Gradio generator handler) may resume this
        # generator on a different thread each time, and grad mode is thread-local.
        with torch.inference_mode():
            self.start()
            self.prefill()
        while not self.stop_reason:
            with torch.inference_mode():
                record = self.iterate()
            self._paused_at = time.perf_counter()  # the clock stops: completing the record is not decoding
            with torch.inference_mode():
                self.complete()
            yield record
            self.paused_s += time.perf_counter() - self._paused_at
            self._paused_at = None
        synchronize(self.decoder.pair.device)
        self.result = self.run_result(time.perf_counter() - self.started - self.paused_s)

    def to_end(self, between: Callable[[], None] | None = None) -> RunResult:
        """Decode to the end, unobserved, calling `between` after every iteration (it may raise to stop the run)."""
        for _ in self:
            if between is not None:
                between()
        return self.result

    def snapshot(self) -> RunResult | None:
        """The run so far as a RunResult: metrics over the iterations done, decoding wall time up to the last
        iteration (None before the prefill; the final result once decoding has ended). Lists are copied: the run
        keeps growing its own."""
        if self.result is not None or self.started is None:
            return self.result
        now = self._paused_at or time.perf_counter()
        return self.run_result(now - self.started - self.paused_s, reason="")

    # -- the run, stage by stage --------------------------------------------------------------------------------------
    def start(self) -> None:
        """The prompt's ids, a fresh copy of the strategy, both models' steps (empty caches), the drafter, the run's
        generator, and its hooks (the strategy, then the plug-ins that apply), told that the run began."""
        decoder, pair, sampling = self.decoder, self.decoder.pair, self.decoder.sampling
        self.prompt_ids = encode_prompt(pair.tokenizer, self.prompt)
        limit = getattr(pair.target.config, "max_position_embeddings", None)
        if limit and len(self.prompt_ids) + self.stop.max_new_tokens + 1 > limit:
            raise PromptError(f"prompt ({len(self.prompt_ids)} tokens) + max_new_tokens exceeds the model's "
                              f"{limit} positions")
        self.strategy = copy.deepcopy(decoder.strategy)  # what it learns while decoding stays in this run
        self.machine = machine_label(pair.device)  # what the run's speeds were measured on, once per run
        # At temperature > 0 the draft's q is the processed distribution (same rule as the target's p) and every
        # random draw of the run comes from one generator seeded with sampling.seed.
        self.generator = None if sampling.greedy else torch.Generator(device=pair.device).manual_seed(sampling.seed)
        process = softmax_processor if sampling.greedy else sampling.process
        self.drafter = None
        if self.strategy.uses_draft:
            steps = decoder.model_steps("draft", len(self.prompt_ids), self.stop.max_new_tokens)
            self.drafter = Drafter(pair.draft, process, self.generator, steps)
        # the target's forwards and its KV cache, which holds the committed tokens before the root (in neither cache)
        self.target = decoder.model_steps("target", len(self.prompt_ids), self.stop.max_new_tokens)
        info = RunInfo(pair, self.strategy, self.target, self.drafter, decoder.costs, sampling, decoder.verifier.name)
        plugins = [plugin(info) for plugin in decoder.plugins]
        self.hooks = [self.strategy, *(hooks for hooks in plugins if hooks is not None)]
        for hooks in self.hooks:
            hooks.begin(info)
        if self.drafter is not None:
            self.drafter.watchers = [hooks.drafted for hooks in self.hooks if hooks.watches_draft_rows()]

    def prefill(self) -> None:
        """The prompt fills the target cache; its last row gives the first token, the first root."""
        decoder, device, tok = self.decoder, self.decoder.pair.device, self.decoder.pair.tokenizer
        synchronize(device)
        self.started = time.perf_counter()
        logits = self.target.prefill(self.prompt_ids)
        self.width = int(logits.shape[-1])  # of the target's logits rows
        verdict = decoder.verifier.verify(DraftTree(root_token=-1), logits, decoder.sampling, self.generator)
        for hooks in self.hooks:
            hooks.after_target(logits, -1)
        first, self.stop_reason = self.stop.cut(tok, self.generated, [verdict.bonus])
        self.generated += first
        self.sources.append(TokenSource(iteration=-1, kind="prefill", margin=margins(logits)[0],
                                        text=tok.decode(first)))
        synchronize(device)
        self.ttft = time.perf_counter() - self.started  # seconds to the first token

    def iterate(self) -> IterationRecord:
        """One iteration: draft a tree, verify it in one target forward, commit the accepted rows, record the
        tokens. The record holds what decoding needs; `complete` adds what only its readers need. Each stage key
        (engine/core/trace.py STAGES) is named for the method it times: "commit" the caches committing the accepted
        rows, "record" the iteration's record."""
        committed = self.prompt_ids + self.generated
        root_pos = len(committed) - 1
        # the device phase reads the device once, in "verify": its stages are timed on the host, without a wait each
        clock = StageClock(torch.device("cpu") if self.decoder.draft_phase == "device" else self.decoder.pair.device)
        with clock("build"):
            tree, built = self.draft(committed)
            params = self.strategy.current_params()  # after build: a selector may have chosen this tree's shape in it
        with clock("verify"):
            tree, logits, verdict = self.verify(tree, root_pos)
        with clock("commit"):
            self.commit(tree, verdict.path, root_pos, built)
        with clock("record"):
            record = self.record(tree, verdict, root_pos, params)
        self.account(record, clock, built, len(tree))
        self.generated += record.new_tokens
        self.records.append(record)
        self.tree, self.logits = tree, logits
        return record

    def draft(self, committed: list[int]) -> tuple[DraftTree | TensorTree, bool]:
        """The iteration's tree, rooted at the last committed token, and whether the strategy built it: not when a
        hook rests this iteration (an AR step: the tree stays the root alone, and the tokens it commits ride along
        with the next tree's first draft forward). A tree grown on the device is a TensorTree until `verify`."""
        tree = DraftTree(root_token=committed[-1])
        for hooks in self.hooks:
            hooks.before_build(committed, self.width)
        if any(hooks.rests() for hooks in self.hooks):
            return tree, False
        plan = self.device_plan()
        if plan is not None:
            return device_draft.draft(self.drafter, self.strategy, plan, committed), True
        if self.drafter is not None:
            self.drafter.begin(tree, committed)
        self.strategy.build(self.drafter, tree)  # drafter None: a strategy without a draft (AR's build adds nothing)
        return tree, True

    def device_plan(self) -> list[tuple[int, int]] | None:
        """The strategy's plan (`Strategy.device_plan`; None for one whose choices need the host) when this run grows
        trees on the device (engine/core/device_draft.py): greedy verification (a sampling rule draws its coins on the
        host), a draft model, and no hook watching the draft's rows level by level; else None."""
        decoder, drafter = self.decoder, self.drafter
        if decoder.draft_phase != "device" or decoder.verifier.name != "greedy" or drafter is None or drafter.watchers:
            return None
        return self.strategy.device_plan()

    def verify(self, tree: DraftTree | TensorTree, root_pos: int) -> tuple[DraftTree, torch.Tensor, Verdict]:
        """One target forward over [root, n1..nk] at positions P + depth under the ancestor-only mask, then the
        rule's verdict; returns (the tree on the host, logits, verdict)."""
        decoder = self.decoder
        if isinstance(tree, TensorTree):
            tree, path, bonus, logits = device_draft.verify(tree, self.drafter, self.target, self.strategy, root_pos)
            verdict = Verdict(path=path, bonus=bonus)
        else:
            visible = kv.tree_visibility(root_pos, tree.ancestor_matrix()) if len(tree) > 1 else None
            logits = self.target.forward(tree.tokens, [root_pos + d for d in tree.depths], visible)
            verdict = decoder.verifier.verify(tree, logits, decoder.sampling, self.generator)
        for hooks in self.hooks:
            hooks.after_target(logits, verdict.path[-1])  # the row that drew the next root
        return tree, logits, verdict

    def commit(self, tree: DraftTree, path: list[int], root_pos: int, built: bool) -> None:
        """Both caches commit the root and the accepted rows (the rest are dropped); the hooks hear what a built tree
        had accepted."""
        self.target.keep(root_pos + 1, [root_pos + node for node in path[1:]])
        if not built:
            return
        if self.drafter is not None:
            self.drafter.finish(path)
        for hooks in self.hooks:
            hooks.observe(len(path) - 1, tree.num_drafted)

    def record(self, tree: DraftTree, verdict: Verdict, root_pos: int, params: dict) -> IterationRecord:
        """The tokens the verdict commits, cut where decoding must stop, in the iteration's record."""
        proposed = [tree.tokens[n] for n in verdict.path[1:]] + [verdict.bonus]
        new, self.stop_reason = self.stop.cut(self.decoder.pair.tokenizer, self.generated, proposed)
        return iteration_record(len(self.records), root_pos, tree, verdict, new, params)

    def account(self, record: IterationRecord, clock: StageClock, built: bool, rows: int) -> None:
        """The record's stage times (the draft's own seconds carved out of build), draft forwards and cost as the
        measured table prices it (none without a table); then the hooks see the record."""
        drafted = built and self.drafter is not None
        record.times = clock.times(draft=self.drafter.seconds if drafted else 0.0, within="build")
        record.draft_forwards = self.drafter.forwards if drafted else 0
        if self.decoder.costs is not None:
            record.cost = iteration_cost(self.decoder.costs, self.drafter.row_counts if drafted else [], rows,
                                         record.times, context=record.position)
        for hooks in self.hooks:
            hooks.recorded(record)

    def complete(self) -> None:
        """The last iteration's record made whole (p, top-10 p and q, texts) and its tokens' sources recorded: work
        for the views and traces, done outside the decode time (the run pauses its clock around it)."""
        if self.logits is None:
            return
        record, tree, logits = self.records[-1], self.tree, self.logits
        self.tree = self.logits = None
        tokenizer = self.decoder.pair.tokenizer
        complete_record(record, tokenizer, self.decoder.sampling, tree, logits)
        new = record.new_tokens
        kept_margins = margins(logits[record.accepted_path])[: len(new)]
        texts = tokenizer.batch_decode([[token] for token in new])
        for i, text in enumerate(texts):
            kind = "accepted" if i < record.accepted else "bonus"
            self.sources.append(TokenSource(iteration=record.index, kind=kind, margin=kept_margins[i], text=text))

    def run_result(self, total: float, reason: str | None = None) -> RunResult:
        """The run as a RunResult: at the end of decoding, and for `snapshot()` while it goes on (`reason` "": not
        stopped yet). Lists are copies."""
        decoder, prompt, stop = self.decoder, self.prompt, self.stop
        pair, strategy, generated = decoder.pair, self.strategy, list(self.generated)
        return RunResult(
            prompt=prompt_text(prompt), prompt_ids=self.prompt_ids, output_ids=generated,
            output_text=pair.tokenizer.decode(generated, skip_special_tokens=False),
            strategy=strategy.name, params=asdict(strategy.settings),
            config=RunConfig(target=pair.target_name, draft=pair.draft_name if strategy.uses_draft else None,
                             steps=decoder.steps_label(),
                             device=str(pair.device), dtype=str(pair.dtype).removeprefix("torch."),
                             machine=self.machine,
                             verifier=decoder.verifier.name, sampling=known(RunSampling, decoder.sampling.as_dict()),
                             max_new_tokens=stop.max_new_tokens,
                             stop_on_eos=bool(stop.eos_ids), stop_strings=list(stop.stop_strings)),
            iterations=list(self.records), metrics=run_metrics(self.records, len(generated), total, self.ttft),
            stop_reason=self.stop_reason if reason is None else reason, token_sources=list(self.sources))

