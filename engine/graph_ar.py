"""AR at its fastest where runs replay CUDA graphs: the target's single-row step, replayed from the pair's own
captured graph (engine/steps.py), in a loop that does nothing else -- no tree, no records, one host read of the next
token per step. The bench's `ar-graph` baseline on a GPU, as `ar-compiled` (engine/compiled.py) is on a CPU.

The engine's own AR (strategy "ar") replays the same graph, but builds an IterationRecord per token for the app's
views; dividing by that loop would credit the trees with its bookkeeping. Both share the pair's steps, so a bench
captures each graph once.
"""
from __future__ import annotations

import time

import torch

from engine.runtime import synchronize
from engine.sampling import Sampling
from engine.steps import pair_static_steps


class GraphedAR:
    """`generate` runs AR on `pair`'s graphed target steps (CUDA). On a CPU the same steps run eagerly, which is what
    the tests compare with the engine's AR."""

    def __init__(self, pair):
        self.pair = pair

    def _steps(self, prompt_len: int, max_new_tokens: int):
        return pair_static_steps(self.pair, "target", prompt_len, max_new_tokens, "on" if self.pair.graphs else "off")

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling | None = None,
                 eos_ids: tuple[int, ...] = ()) -> dict:
        """{"output_ids", "new_tokens", "total_s", "ttft_s", "tpot_s"}: the engine's AR stop rule (max_new_tokens,
        or an EOS token, which is kept) and its sampling (one generator seeded with sampling.seed)."""
        sampling = sampling or Sampling()
        device = self.pair.device
        generator = None if sampling.greedy else torch.Generator(device=device).manual_seed(sampling.seed)
        with torch.inference_mode():
            steps = self._steps(len(prompt_ids), max_new_tokens)
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


def _next(logits: torch.Tensor, sampling: Sampling, generator) -> int:
    """The next token from one row of logits: argmax, or a draw from the processed distribution (as the engine's AR,
    whose rule draws the bonus token from p with the run's generator)."""
    if sampling.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(sampling.process(logits[None].float())[0], 1, generator=generator))
