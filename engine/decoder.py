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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine import kv
from engine.autosize import AutoSizer
from engine.drafter import Drafter, softmax_processor, synchronize
from engine.metrics import run_metrics
from engine.strategies.base import Strategy
from engine.trace import (ACCEPTED, BONUS, REJECTED, ROOT, TOP_K, UNREACHED, IterationRecord, NodeRecord,
                          RunResult)
from engine.sampling import Sampling
from engine.selector import FeatureTaps
from engine.tree import DraftTree
from engine.verify import VerificationError, Verifier, default_verifier

if TYPE_CHECKING:
    from engine.models import ModelPair

Prompt = str | list[dict[str, str]]  # plain text, or chat messages rendered with the tokenizer's chat template


class PromptError(ValueError):
    """A prompt that cannot be decoded from (empty, or longer than the model allows)."""


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    if isinstance(prompt, list):
        if not prompt or not any(str(m.get("content", "")).strip() for m in prompt):
            raise PromptError("the chat prompt is empty: write a message first")
        out = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if hasattr(out, "keys") else out
        ids = list(ids[0]) if ids and isinstance(ids[0], list) else list(ids)
    else:
        if not isinstance(prompt, str) or not prompt.strip():
            raise PromptError("the prompt is empty: type some text to continue")
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if not ids:
        raise PromptError("the prompt encodes to no tokens")
    return [int(i) for i in ids]


def prompt_text(prompt: Prompt) -> str:
    if isinstance(prompt, list):
        return "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in prompt)
    return prompt


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
class DecodeRun:
    """One decoding run; iterate it to decode. `result` is set when iteration ends."""
    decoder: "Decoder"
    prompt: Prompt
    stop: StopRule
    result: RunResult | None = field(default=None, init=False)
    generated: list[int] = field(default_factory=list, init=False)  # committed output tokens so far
    # what snapshot() needs while decoding (prompt ids, records, sources, ttft); set after the prefill
    progress: dict[str, Any] | None = field(default=None, init=False, repr=False)
    started: float = field(default=0.0, init=False, repr=False)  # perf_counter() when decoding began
    # Seconds the consumer held the run between steps (drawing figures, streaming): not decoding time, so the
    # run's wall time (tokens/s, TPOT) leaves them out and a streamed run compares fairly with a silent AR run.
    paused_s: float = field(default=0.0, init=False)
    _paused_at: float | None = field(default=None, init=False, repr=False)

    def __iter__(self):
        # Inference mode per step, not across yields: a consumer (a Gradio generator handler) may resume this
        # generator on a different thread each time, and grad mode is thread-local.
        steps = self.decoder._decode(self)
        while True:
            with torch.inference_mode():
                record = next(steps, None)
            if record is None:
                return
            self._paused_at = time.perf_counter()
            yield record
            self.paused_s += time.perf_counter() - self._paused_at
            self._paused_at = None

    def snapshot(self) -> RunResult | None:
        """The run so far as a RunResult: metrics over the iterations done, decoding wall time up to the last step
        (None before the prefill; the final result once decoding has ended). Lists are copied: the run keeps
        growing its own."""
        if self.result is not None or self.progress is None:
            return self.result
        now = self._paused_at or time.perf_counter()
        return self.decoder._result(self, reason="", total=now - self.started - self.paused_s, **self.progress)


class Decoder:
    def __init__(self, pair: "ModelPair", strategy: Strategy, verifier: Verifier | None = None,
                 sampling: Sampling | None = None):
        if strategy.uses_draft and pair.draft is None:
            raise ValueError(f"strategy {strategy.name!r} needs a draft model, and this pair has none")
        self.pair, self.strategy = pair, strategy
        self.sampling = sampling or Sampling()  # default: greedy (temperature 0)
        self.verifier = verifier or default_verifier(strategy.child_mode, self.sampling.greedy)
        if self.verifier.greedy_only and not self.sampling.greedy:
            raise VerificationError(f"verification rule {self.verifier.name!r} is exact only at temperature 0; "
                                    f"at temperature {self.sampling.temperature:g} pick a sampling rule")
        self.verifier.check_strategy(strategy)

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

    # -- the loop ------------------------------------------------------------------------------------------------
    def _decode(self, run: DecodeRun):
        pair, strategy, tok = self.pair, self.strategy, self.pair.tokenizer
        target, device = pair.target, pair.device
        prompt_ids = encode_prompt(tok, run.prompt)
        limit = getattr(target.config, "max_position_embeddings", None)
        if limit and len(prompt_ids) + run.stop.max_new_tokens + 1 > limit:
            raise PromptError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens exceeds the model's "
                              f"{limit} positions")
        strategy.reset()
        target_cache = kv.new_cache(target)
        # At temperature > 0 the draft's q is the processed distribution (same rule as the target's p) and every
        # random draw of the run comes from one generator seeded with sampling.seed.
        sampling = self.sampling
        generator = None if sampling.greedy else torch.Generator(device=device).manual_seed(sampling.seed)
        process = softmax_processor if sampling.greedy else sampling.process
        drafter = Drafter(pair.draft, process, generator) if strategy.uses_draft else None
        run.target_cache, run.drafter = target_cache, drafter  # exposed for cache-correctness tests

        # The neural selector's features: hooks on both models' final norms, only when the strategy asks for them.
        taps = FeatureTaps(pair, sampling, self.verifier.name) \
            if drafter is not None and getattr(strategy, "wants_features", False) else None
        if drafter is not None:
            drafter.taps = taps
        try:
            synchronize(device)
            start = time.perf_counter()
            # Prefill: the prompt fills the target cache; its last row gives the first token, the first root.
            prefill_logits = target(input_ids=torch.tensor([prompt_ids], device=device), past_key_values=target_cache,
                                    use_cache=True, logits_to_keep=1).logits[0]
            verdict = self.verifier.verify(DraftTree(root_token=-1), prefill_logits, sampling, generator)
            if taps is not None:
                taps.after_target(prefill_logits, -1)
            generated: list[int] = run.generated
            sources: list[dict[str, Any]] = []
            first, reason = run.stop.cut(tok, generated, [verdict.bonus])
            generated += first
            sources.append({"iteration": -1, "kind": "prefill", "margin": _margins(prefill_logits)[0],
                            "text": tok.decode(first)})
            synchronize(device)
            ttft = time.perf_counter() - start

            # The "auto" preset: the strategy's size knob follows the measured costs and this run's acceptance.
            sizer = AutoSizer(strategy, pair.costs) if strategy.auto and pair.costs is not None and drafter else None
            records: list[IterationRecord] = []
            run.progress, run.started = {"prompt_ids": prompt_ids, "records": records, "sources": sources,
                                         "ttft": ttft}, start
            while not reason:
                record, new, reason = self._iteration(len(records), prompt_ids + generated, generated, run.stop,
                                                      target_cache, drafter, generator)
                if sizer is not None:
                    sizer.observe(record)
                    record.extra["cost"]["auto"] = sizer.last
                generated += new
                margins = record.extra.pop("margins")
                for i in range(len(new)):
                    kind = "accepted" if i < record.accepted else "bonus"
                    sources.append({"iteration": record.index, "kind": kind, "margin": margins[i],
                                    "text": tok.decode([new[i]])})
                records.append(record)
                yield record
            synchronize(device)
            total = time.perf_counter() - start - run.paused_s
            run.result = self._result(run, prompt_ids, records, sources, ttft, reason, total)
        finally:
            if taps is not None:
                taps.remove()

    def _result(self, run: DecodeRun, prompt_ids, records, sources, ttft, reason, total) -> RunResult:
        """The run as a RunResult: at the end of decoding, and for DecodeRun.snapshot() while it goes on."""
        pair, strategy, generated = self.pair, self.strategy, list(run.generated)
        return RunResult(
            prompt=prompt_text(run.prompt), prompt_ids=prompt_ids, output_ids=generated,
            output_text=pair.tokenizer.decode(generated, skip_special_tokens=False),
            strategy=strategy.name, params=dict(strategy.config),
            config={"target": pair.target_name, "draft": pair.draft_name if strategy.uses_draft else None,
                    "device": str(pair.device), "dtype": str(pair.dtype).removeprefix("torch."),
                    "verifier": self.verifier.name, "sampling": self.sampling.as_dict(),
                    "max_new_tokens": run.stop.max_new_tokens,
                    "stop_on_eos": bool(run.stop.eos_ids), "stop_strings": list(run.stop.stop_strings)},
            iterations=list(records), metrics=run_metrics(records, len(generated), total, ttft),
            stop_reason=reason, token_sources=list(sources))

    def _iteration(self, index, committed, generated, stop, target_cache, drafter, generator=None):
        pair, strategy, target, device = self.pair, self.strategy, self.pair.target, self.pair.device
        t0 = time.perf_counter()
        root_pos = len(committed) - 1
        tree = DraftTree(root_token=committed[-1])
        if drafter is not None:
            drafter.begin(tree, committed)
            strategy.build(drafter, tree)
        params = strategy.current_params()  # after build: a selector may have chosen this tree's shape in it
        synchronize(device)
        t1 = time.perf_counter()

        # One target forward over [root, n1..nk] at positions P + depth under the ancestor-only mask.
        mask = None
        if len(tree) > 1:
            visible = kv.tree_visibility(root_pos, tree.ancestor_matrix()).to(device)
            mask = kv.additive_mask(visible, target.dtype)
        logits = target(input_ids=torch.tensor([tree.tokens], device=device),
                        position_ids=(root_pos + torch.tensor([tree.depths], device=device)),
                        attention_mask=mask, past_key_values=target_cache, use_cache=True).logits[0]
        verdict = self.verifier.verify(tree, logits, self.sampling, generator)
        if drafter is not None and drafter.taps is not None:
            drafter.taps.after_target(logits, verdict.path[-1])  # the row that drew the next root
        synchronize(device)
        t2 = time.perf_counter()

        path = verdict.path
        kv.keep_rows(target_cache, root_pos + 1, [root_pos + node for node in path[1:]])
        if drafter is not None:
            drafter.finish(path)
        strategy.observe(len(path) - 1, tree.num_drafted)
        synchronize(device)
        t3 = time.perf_counter()

        proposed = [tree.tokens[n] for n in path[1:]] + [verdict.bonus]
        new, reason = stop.cut(pair.tokenizer, generated, proposed)
        record = self._record(index, root_pos, tree, verdict, logits, new, params)
        draft_s = drafter.seconds if drafter is not None else 0.0
        t4 = time.perf_counter()
        record.draft_forwards = drafter.forwards if drafter is not None else 0
        record.times = {"draft": draft_s, "build": t1 - t0 - draft_s, "verify": t2 - t1, "commit": t3 - t2,
                        "other": t4 - t3, "total": t4 - t0}
        if pair.costs is not None:
            record.extra["cost"] = self._cost(drafter.row_counts if drafter is not None else [], len(tree),
                                              record.times)
        return record, new, reason

    def _cost(self, draft_rows: list[int], verify_rows: int, times: dict[str, float]) -> dict:
        """Predicted (from the measured cost table) beside measured seconds of this iteration's draft and verify."""
        predicted = self.pair.costs.predict(draft_rows, verify_rows)
        return {"draft_rows": list(draft_rows), "verify_rows": verify_rows,
                "predicted_draft_s": predicted["draft_s"], "predicted_verify_s": predicted["verify_s"],
                "predicted_s": predicted["total_s"], "measured_draft_s": times["draft"],
                "measured_verify_s": times["verify"], "measured_s": times["draft"] + times["verify"]}

    def _record(self, index, root_pos, tree, verdict, logits, new, params) -> IterationRecord:
        tok = self.pair.tokenizer
        path, on_path = verdict.path, set(verdict.path)
        parents = sorted({p for p in tree.parents if p >= 0} | {path[-1]})
        rows = logits[parents].float()
        # p as the rule saw it: the processed target distribution when sampling, the softmax when greedy.
        probs = torch.softmax(rows, dim=-1) if self.sampling.greedy else self.sampling.process(rows)
        row_of = {p: i for i, p in enumerate(parents)}
        # what the node inspector shows: the top of p and q after every node the target or the draft expanded
        next_p = _top_k(tok, probs)
        drafted = [p for p in parents if p in tree.child_dist]  # nodes whose children the draft drew
        # one row per distinct q tensor: DDTree's nodes of one depth share their depth's q
        shared = {id(tree.child_dist[p]): tree.child_dist[p] for p in drafted}
        q_rows = torch.stack(list(shared.values())).float() if shared else probs[:0]
        top_q = dict(zip(shared, _top_k(tok, q_rows)))
        next_q = {p: top_q[id(tree.child_dist[p])] for p in drafted}

        def target_prob(parent: int, token: int) -> float:
            return float(probs[row_of[parent], token])

        nodes = []
        for i, token in enumerate(tree.tokens):
            parent = tree.parents[i]
            if i == 0:
                status = ROOT
            elif i in on_path:
                status = ACCEPTED
            elif parent in on_path:
                status = REJECTED
            else:
                status = UNREACHED
            nodes.append(NodeRecord(
                id=i, parent=parent, token=token, text=tok.decode([token]), depth=tree.depths[i],
                q=tree.q[i] if i else None, rank=tree.ranks[i] if i else None, path_q=tree.path_q[i],
                p=target_prob(parent, token) if i else None, status=status,
                accept_prob=verdict.accept_prob.get(i), draws=tree.multiplicity(i) if i else 1,
                next_p=next_p[row_of[i]] if i in row_of else [], next_q=next_q.get(i, [])))
        last = path[-1]
        bonus_q = float(tree.child_dist[last][verdict.bonus]) if last in tree.child_dist else None
        nodes.append(NodeRecord(
            id=len(tree), parent=last, token=verdict.bonus, text=tok.decode([verdict.bonus]),
            depth=tree.depths[last] + 1, q=bonus_q, rank=None,
            path_q=tree.path_q[last] * bonus_q if bonus_q is not None else None,
            p=target_prob(last, verdict.bonus), status=BONUS, resampled=verdict.resampled))
        accepted = min(len(path) - 1, len(new))
        return IterationRecord(
            index=index, position=root_pos, nodes=nodes, accepted_path=path, bonus_token=verdict.bonus,
            bonus_text=tok.decode([verdict.bonus]), new_tokens=list(new), drafted=tree.num_drafted,
            accepted=accepted, draft_forwards=0, params=params, times={},
            extra={**tree.extra, "margins": _margins(logits[path])[: len(new)]})


def _top_k(tokenizer, probs: torch.Tensor) -> list[list[list]]:
    """Per row of `probs` [rows, V]: its TOP_K most probable tokens as [token, probability (4 significant digits:
    display data, kept small in traces), text]. One topk over all rows and one batched decode."""
    top = torch.topk(probs, min(TOP_K, probs.shape[-1]), dim=-1)
    ids, values = top.indices.tolist(), top.values.tolist()
    texts = iter(tokenizer.batch_decode([[t] for row in ids for t in row]))
    return [[[t, float(f"{v:.4g}"), next(texts)] for t, v in zip(row_ids, row_values)]
            for row_ids, row_values in zip(ids, values)]


def _margins(logits: torch.Tensor) -> list[float]:
    """Target's top-1 minus top-2 logit per row: how close a greedy choice was to flipping."""
    top = torch.topk(logits.float(), 2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()
