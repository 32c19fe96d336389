"""AR at its fastest: the target's one-row captured step (a CPU package compiled ahead of time, or a CUDA graph;
engine/cpu/packages.py), in a loop that does nothing else -- no tree, no records, one host read of the next token
per step. The bench's `ar-captured` baseline.

The engine's own AR (strategy "ar") takes the same captured step wherever the pair has one, but builds an
IterationRecord per token for the app's views; the bench divides by the faster of the two, so that loop's
bookkeeping never credits the trees. Both share the pair's steps, so a bench captures each graph once.
"""
from __future__ import annotations

import time

import torch

from engine.core.sampling import Sampling
from engine.core.steps import pair_static_steps
from engine.runtime import synchronize


class CapturedAR:
    """`generate` runs AR on `pair`'s captured target steps. Without any (a CPU pair with capture off) the same
    static steps run eagerly, which is what the tests compare with the engine's AR."""

    def __init__(self, pair):
        self.pair = pair

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling | None = None,
                 eos_ids: tuple[int, ...] = ()) -> dict:
        """{"output_ids", "new_tokens", "total_s", "ttft_s", "tpot_s"}: the engine's AR stop rule (max_new_tokens,
        or an EOS token, which is kept) and its sampling (one generator seeded with sampling.seed)."""
        sampling = sampling or Sampling()
        device = self.pair.device
        generator = None if sampling.greedy else torch.Generator(device=device).manual_seed(sampling.seed)
        with torch.inference_mode():
            steps = pair_static_steps(self.pair, "target", len(prompt_ids), max_new_tokens)
            synchronize(device)
            start = time.perf_counter()
            out = [_next(steps.prefill(prompt_ids)[-1], sampling, generator)]
            ttft = time.perf_counter() - start
            while len(out) < max_new_tokens and out[-1] not in eos_ids:
                logits = steps.forward([out[-1]], [len(prompt_ids) + len(out) - 1])
                out.append(_next(logits[-1], sampling, generator))
            synchronize(device)
        total = time.perf_counter() - start
        return {"output_ids": out, "new_tokens": len(out), "total_s": total, "ttft_s": ttft,
                "tpot_s": (total - ttft) / (len(out) - 1) if len(out) > 1 else None}


def has_captured_step(pair) -> bool:
    """Whether the pair's one-row target forward is captured (so `ar-captured` is AR at its fastest)."""
    target = pair.captured.get("target")
    return pair.graphs or (target is not None and 1 in target.serves)


def _next(logits: torch.Tensor, sampling: Sampling, generator) -> int:
    """The next token from one row of logits: argmax, or a draw from the processed distribution (as the engine's AR,
    whose rule draws the bonus token from p with the run's generator)."""
    if sampling.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(sampling.process(logits[None].float())[0], 1, generator=generator))
