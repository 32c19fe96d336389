"""The decoding loop (ARCHITECTURE.md): draft a tree, verify it in one target forward, commit, repeat.

    run = Decoder(pair, make_strategy("dynatree")).run("def fib(n):", max_new_tokens=64)
    for record in run:          # one IterationRecord per target verification pass, while decoding
        ...
    result = run.result         # RunResult: output, metrics, every record

Conventions: the root of each tree is the last committed token, not yet in either KV cache; tree nodes sit at
positions P + depth (P = target cache length); the target sees an additive ancestor-only mask; after verification
both caches keep the accepted rows by copying them into place (no re-forward).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.core import kv
from engine.core.drafter import Drafter, softmax_processor
from engine.core.prompts import Prompt, PromptError, encode_prompt, prompt_text
from engine.core.runtime import synchronize
from engine.core.sampling import Sampling
from engine.core.steps import DynamicSteps, pair_static_steps
from engine.core.trace import IterationRecord, RunConfig, RunResult, RunSampling, StageTimes, TokenSource, known
from engine.core.tree import DraftTree
from engine.measure.autosize import AutoSizer
from engine.measure.metrics import run_metrics
from engine.models.devices import machine_label
from engine.records import complete_record, iteration_cost, iteration_record, margins
from engine.strategies.base import Strategy
from engine.strategies.selector import FeatureTaps
from engine.verify import VerificationError, Verifier, default_verifier

if TYPE_CHECKING:
    from engine.models import ModelPair


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


@dataclass
class RunState:
    """Everything one run holds while it decodes; its DecodeRun owns it, the decoder's steps read and extend it."""
    prompt_ids: list[int]
    target: Any                         # the target's steps (engine/core/steps.py): its forwards and its KV cache,
                                        # which holds the committed tokens before the root (in neither cache)
    drafter: Drafter | None             # the draft side and its own cache; None for a strategy without a draft
    generator: torch.Generator | None   # every random draw of the run when sampling, seeded with sampling.seed
    taps: FeatureTaps | None            # the neural selector's features, only when the strategy wants them
    sizer: AutoSizer | None             # the "auto" preset: the size knob follows measured costs and acceptance
    started: float = 0.0                # perf_counter() when decoding began (the prefill)
    ttft: float = 0.0                   # seconds to the first token
    generated: list[int] = field(default_factory=list)         # committed output tokens so far
    records: list[IterationRecord] = field(default_factory=list)
    sources: list[TokenSource] = field(default_factory=list)  # per output token
    stop_reason: str = ""               # set when decoding must stop ("eos", "max_new_tokens", "stop_string")
    width: int | None = None            # the width of the target's logits rows (set by the prefill)
    pending: tuple | None = None        # the last iteration's (record, tree, logits), until `complete` reads them


@dataclass
class DecodeRun:
    """One decoding run; iterate it to decode. `result` is set when iteration ends."""
    decoder: "Decoder"
    prompt: Prompt
    stop: StopRule
    result: RunResult | None = field(default=None, init=False)
    state: RunState | None = field(default=None, init=False, repr=False)  # set once the prefill has run
    # Seconds the consumer held the run between steps (drawing figures, streaming): not decoding time, so the
    # run's wall time (tokens/s, TPOT) leaves them out and a streamed run compares fairly with a silent AR run.
    paused_s: float = field(default=0.0, init=False)
    _paused_at: float | None = field(default=None, init=False, repr=False)

    def __iter__(self):
        # Inference mode per step, not across yields: a consumer (a Gradio generator handler) may resume this
        # generator on a different thread each time, and grad mode is thread-local.
        decoder = self.decoder
        with torch.inference_mode():
            state = decoder.start(self.prompt, self.stop)
            decoder.prefill(state, self.stop)
        self.state = state
        while not state.stop_reason:
            with torch.inference_mode():
                record = decoder.step(state, self.stop)
            self._paused_at = time.perf_counter()  # the clock stops: completing the record is not decoding
            with torch.inference_mode():
                decoder.complete(state)
            yield record
            self.paused_s += time.perf_counter() - self._paused_at
            self._paused_at = None
        synchronize(decoder.pair.device)
        total = time.perf_counter() - state.started - self.paused_s
        self.result = decoder.result(self.prompt, self.stop, state, total)

    def snapshot(self) -> RunResult | None:
        """The run so far as a RunResult: metrics over the iterations done, decoding wall time up to the last step
        (None before the prefill; the final result once decoding has ended). Lists are copied: the run keeps
        growing its own."""
        if self.result is not None or self.state is None:
            return self.result
        now = self._paused_at or time.perf_counter()
        return self.decoder.result(self.prompt, self.stop, self.state, now - self.state.started - self.paused_s,
                                   reason="")


class Decoder:
    """A pair, a strategy, a verification rule and sampling settings: `run` decodes a prompt with them. The steps
    (`start`, `prefill`, `step`, `result`) are what a DecodeRun drives; they keep no state of their own."""

    def __init__(self, pair: "ModelPair", strategy: Strategy, verifier: Verifier | None = None,
                 sampling: Sampling | None = None, steps: str = "auto", capture: str = "auto"):
        """steps "auto" | "static" | "dynamic" (engine/core/steps.py): "auto" is static exactly when the run takes the
        pair's captured steps; capture "auto" | "off": "auto" takes them wherever the pair has them ready
        (engine/capture/packages.py), so runs take the steps its cost table measured; "off" runs eagerly (the bench's
        eager AR)."""
        if strategy.uses_draft and pair.draft is None:
            raise ValueError(f"strategy {strategy.name!r} needs a draft model, and this pair has none")
        self.pair, self.strategy = pair, strategy
        self.sampling = sampling or Sampling()  # default: greedy (temperature 0)
        self.verifier = verifier or default_verifier(strategy.child_mode, self.sampling.greedy)
        if self.verifier.greedy_only and not self.sampling.greedy:
            raise VerificationError(f"verification rule {self.verifier.name!r} is exact only at temperature 0; "
                                    f"at temperature {self.sampling.temperature:g} pick a sampling rule")
        self.verifier.check_strategy(strategy)
        if steps not in ("auto", "static", "dynamic") or capture not in ("auto", "off"):
            raise ValueError(f"steps must be auto, static or dynamic and capture auto or off, not {steps!r} / "
                             f"{capture!r}")
        self.captured = capture == "auto" and pair.capture_ready
        self.static = steps == "static" or (steps == "auto" and self.captured)
        # the cost table priced as this decoder's forwards run: with captured steps, or eager
        self.costs = pair.costs if pair.costs is None or self.captured else pair.costs.eager()

    def run(self, prompt: Prompt, max_new_tokens: int = 64, stop_on_eos: bool = True,
            stop_strings: tuple[str, ...] = (), eos_token_ids: list[int] | None = None) -> DecodeRun:
        """`eos_token_ids` overrides the pair's end-of-sequence tokens; `stop_on_eos=False` ignores them."""
        if not 1 <= int(max_new_tokens) <= 100_000:
            raise ValueError(f"max_new_tokens must be between 1 and 100000, got {max_new_tokens}")
        eos = tuple(eos_token_ids if eos_token_ids is not None else self.pair.eos_token_ids) if stop_on_eos else ()
        return DecodeRun(self, prompt, StopRule(int(max_new_tokens), eos, tuple(s for s in stop_strings if s)))

    def generate(self, prompt: Prompt, **kwargs) -> RunResult:
        run = self.run(prompt, **kwargs)
        for _ in run:
            pass
        return run.result

    # -- the steps of a run --------------------------------------------------------------------------------------
    def start(self, prompt: Prompt, stop: StopRule) -> RunState:
        """A fresh run's state: the prompt's ids, empty caches, the drafter, and the run's generator."""
        pair, strategy, sampling = self.pair, self.strategy, self.sampling
        prompt_ids = encode_prompt(pair.tokenizer, prompt)
        limit = getattr(pair.target.config, "max_position_embeddings", None)
        if limit and len(prompt_ids) + stop.max_new_tokens + 1 > limit:
            raise PromptError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens exceeds the model's "
                              f"{limit} positions")
        strategy.reset()
        # At temperature > 0 the draft's q is the processed distribution (same rule as the target's p) and every
        # random draw of the run comes from one generator seeded with sampling.seed.
        generator = None if sampling.greedy else torch.Generator(device=pair.device).manual_seed(sampling.seed)
        process = softmax_processor if sampling.greedy else sampling.process
        drafter = None
        if strategy.uses_draft:
            drafter = Drafter(pair.draft, process, generator, self._steps("draft", len(prompt_ids), stop))
        # The neural selector's features: hooks on both models' final norms, only when the strategy asks for them.
        target = self._steps("target", len(prompt_ids), stop)
        taps = None
        if drafter is not None and strategy.wants_features:
            taps = drafter.taps = FeatureTaps(pair, sampling, self.verifier.name, target, drafter.steps, self.costs)
        sizer = None
        if strategy.auto and self.costs is not None and drafter is not None:
            sizer = AutoSizer(strategy, self.costs)
        return RunState(prompt_ids, target, drafter, generator, taps, sizer)

    def _steps(self, role: str, prompt_len: int, stop: StopRule):
        """A model's steps for a new run: the dynamic path, or the pair's static steps reset (built once per pair and
        reused by every later run that fits, engine/core/steps.py `pair_static_steps`: allocating a static cache and
        capturing its graphs takes seconds)."""
        if not self.static:
            return DynamicSteps(self.pair.target if role == "target" else self.pair.draft)
        return pair_static_steps(self.pair, role, prompt_len, stop.max_new_tokens, self.captured)

    def prefill(self, state: RunState, stop: StopRule) -> None:
        """The prompt fills the target cache; its last row gives the first token, the first root."""
        device, tok = self.pair.device, self.pair.tokenizer
        synchronize(device)
        state.started = time.perf_counter()
        logits = state.target.prefill(state.prompt_ids)
        state.width = int(logits.shape[-1])
        verdict = self.verifier.verify(DraftTree(root_token=-1), logits, self.sampling, state.generator)
        if state.taps is not None:
            state.taps.after_target(logits, -1)
        first, state.stop_reason = stop.cut(tok, state.generated, [verdict.bonus])
        state.generated += first
        state.sources.append(TokenSource(iteration=-1, kind="prefill", margin=margins(logits)[0],
                                         text=tok.decode(first)))
        synchronize(device)
        state.ttft = time.perf_counter() - state.started

    def step(self, state: RunState, stop: StopRule) -> IterationRecord:
        """One iteration: draft a tree, verify it in one target forward, commit what the rule accepted. The record
        holds what decoding needs; `complete` adds what only its readers need."""
        record, tree, logits = self._iteration(state, stop)
        if state.sizer is not None:
            state.sizer.observe(record)
            record.cost.auto = state.sizer.last
        state.generated += record.new_tokens
        state.records.append(record)
        state.pending = (record, tree, logits)
        return record

    def complete(self, state: RunState) -> None:
        """The last iteration's record made whole (p, top-10 p and q, texts) and its tokens' sources recorded: work
        for the views and traces, done outside the decode time (DecodeRun pauses its clock around it)."""
        if state.pending is None:
            return
        record, tree, logits = state.pending
        state.pending = None
        complete_record(record, self.pair.tokenizer, self.sampling, tree, logits)
        new = record.new_tokens
        kept_margins = margins(logits[record.accepted_path])[: len(new)]
        texts = self.pair.tokenizer.batch_decode([[token] for token in new])
        for i, text in enumerate(texts):
            kind = "accepted" if i < record.accepted else "bonus"
            state.sources.append(TokenSource(iteration=record.index, kind=kind, margin=kept_margins[i], text=text))

    def result(self, prompt: Prompt, stop: StopRule, state: RunState, total: float,
               reason: str | None = None) -> RunResult:
        """The run as a RunResult: at the end of decoding, and for DecodeRun.snapshot() while it goes on (`reason`
        "": not stopped yet). Lists are copies."""
        pair, strategy, generated = self.pair, self.strategy, list(state.generated)
        return RunResult(
            prompt=prompt_text(prompt), prompt_ids=state.prompt_ids, output_ids=generated,
            output_text=pair.tokenizer.decode(generated, skip_special_tokens=False),
            strategy=strategy.name, params=asdict(strategy.settings),
            config=RunConfig(target=pair.target_name, draft=pair.draft_name if strategy.uses_draft else None,
                             steps=self.steps_label(),
                             device=str(pair.device), dtype=str(pair.dtype).removeprefix("torch."),
                             machine=machine_label(pair.device),
                             verifier=self.verifier.name, sampling=known(RunSampling, self.sampling.as_dict()),
                             max_new_tokens=stop.max_new_tokens,
                             stop_on_eos=bool(stop.eos_ids), stop_strings=list(stop.stop_strings)),
            iterations=list(state.records), metrics=run_metrics(state.records, len(generated), total, state.ttft),
            stop_reason=state.stop_reason if reason is None else reason, token_sources=list(state.sources))

    def steps_label(self) -> str:
        """How this decoder's forwards run: "captured (AOTInductor)", "CUDA graphs" or "eager"."""
        if not self.captured:
            return "eager"
        return "CUDA graphs" if self.pair.graphs else "captured (AOTInductor)"

    def _iteration(self, state: RunState, stop: StopRule) -> tuple[IterationRecord, DraftTree, torch.Tensor]:
        """The iteration's record (stop truncation applied, times and cost filled in), its tree and the target's
        logits."""
        pair, strategy, drafter = self.pair, self.strategy, state.drafter
        committed = state.prompt_ids + state.generated
        t0 = time.perf_counter()
        root_pos = len(committed) - 1
        tree = DraftTree(root_token=committed[-1])
        if strategy.uses_context:  # context lookup: the committed stream, and the width of the target's rows
            strategy.see_context(committed, vocab_size=state.width, device=pair.device, costs=self.costs)
        # the auto sizer may ask for an AR step (no tree pays here): the tree stays the root alone, and the tokens it
        # commits ride along with the next tree's first draft forward
        drafting = drafter is not None and not (state.sizer is not None and state.sizer.resting)
        if drafting:
            drafter.begin(tree, committed)
        if drafting or drafter is None:
            strategy.build(drafter, tree)  # drafter None: a strategy without a draft (AR's build adds nothing)
        params = strategy.current_params()  # after build: a selector may have chosen this tree's shape in it
        synchronize(pair.device)
        t1 = time.perf_counter()
        logits, verdict = self._verify(state, tree, root_pos)
        t2 = time.perf_counter()
        path = verdict.path
        state.target.keep(root_pos + 1, [root_pos + node for node in path[1:]])
        if drafting:
            drafter.finish(path)
            strategy.observe(len(path) - 1, tree.num_drafted)
        elif drafter is None:
            strategy.observe(len(path) - 1, tree.num_drafted)
        synchronize(pair.device)
        t3 = time.perf_counter()

        proposed = [tree.tokens[n] for n in path[1:]] + [verdict.bonus]
        new, state.stop_reason = stop.cut(pair.tokenizer, state.generated, proposed)
        record = iteration_record(len(state.records), root_pos, tree, verdict, new, params)
        draft_s = drafter.seconds if drafting else 0.0
        t4 = time.perf_counter()
        record.draft_forwards = drafter.forwards if drafting else 0
        record.times = StageTimes(draft=draft_s, build=t1 - t0 - draft_s, verify=t2 - t1, commit=t3 - t2,
                                  other=t4 - t3, total=t4 - t0)
        if self.costs is not None:
            record.cost = iteration_cost(self.costs, drafter.row_counts if drafting else [], len(tree),
                                         record.times, context=root_pos)
        return record, tree, logits

    def _verify(self, state: RunState, tree: DraftTree, root_pos: int):
        """One target forward over [root, n1..nk] at positions P + depth under the ancestor-only mask, then the
        rule's verdict; returns (logits, verdict), synchronised."""
        device = self.pair.device
        visible = kv.tree_visibility(root_pos, tree.ancestor_matrix()) if len(tree) > 1 else None
        logits = state.target.forward(tree.tokens, [root_pos + d for d in tree.depths], visible)
        verdict = self.verifier.verify(tree, logits, self.sampling, state.generator)
        if state.taps is not None:
            state.taps.after_target(logits, verdict.path[-1])  # the row that drew the next root
        synchronize(device)
        return logits, verdict
