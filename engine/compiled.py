"""Autoregressive decoding through torch.compile: the fastest single-row step torch offers, as a baseline.

The engine's eager AR step spends ~90 % of its time in oneDNN's linear kernels. inductor with frozen weights and
`max-autotune` times its own C++ micro-GEMMs against them per weight shape, keeps the faster, and fuses the rest of
the layer; on the project's 2-core CPU that made AR markedly faster (docs/experiments/compiled-ar.md). Whether it
wins is the machine's business, so `bench` runs this beside the eager AR and divides by whichever was faster. The
speculative methods do not use it (their row counts change every iteration; see the README).

    ar = CompiledAR(pair.target, max_len=1024)   # compiles on the first call (about a minute for 1.5B on 2 cores)
    out = ar.generate(prompt_ids, max_new_tokens=96, sampling=Sampling(), eos_ids=(...))

The cost of it:
  * one StaticCache of `max_len` positions, owned for the object's life: the compiled graph is specialised to the
    cache tensors it was traced with (handing it a fresh cache silently reads the old one), so every generation
    resets and reuses the same cache, and prompts longer than `max_len - max_new_tokens` are refused;
  * the linears run their plain `F.linear` path inside the graph (inductor packs the frozen weights itself), which
    keeps a second packed copy of the target's weights in memory;
  * the prefill runs eagerly (its length changes per prompt; compiling it would recompile per length).
"""
from __future__ import annotations

import time

import torch

from engine.drafter import synchronize
from engine.kernels import forcing
from engine.sampling import Sampling


class CompileError(RuntimeError):
    """torch.compile cannot run here (no C++ compiler, an unsupported device) or the prompt does not fit."""


def compile_available(device: torch.device) -> str | None:
    """None if a compiled CPU step can be built here, else why not."""
    if device.type != "cpu":
        return f"the compiled AR baseline is CPU-only here (device {device.type}); CUDA graphs are a separate issue"
    try:
        from torch._inductor import cpp_builder
        cpp_builder.get_cpp_compiler()
    except Exception as err:  # noqa: BLE001 - any failure means no compiler
        return f"no C++ compiler for inductor ({str(err)[:120]})"
    return None


class CompiledAR:
    """Greedy or sampled decoding of `model` one row at a time with a compiled forward on a static cache."""

    def __init__(self, model, max_len: int = 1024, mode: str = "max-autotune"):
        import torch._inductor.config as inductor_config
        from transformers import StaticCache
        self.model, self.max_len = model, int(max_len)
        self.device = next(model.parameters()).device
        reason = compile_available(self.device)
        if reason:
            raise CompileError(reason)
        # Frozen weights are constants to inductor: it picks its GEMM per weight and packs it once. (A process-wide
        # inductor setting; nothing else in the engine compiles.)
        inductor_config.freezing = True
        self.cache = StaticCache(config=model.config, max_cache_len=self.max_len)
        self.step = torch.compile(model, dynamic=False, mode=mode)
        self.compile_s: float | None = None  # seconds the first step took (tracing + autotuning + C++ build)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling | None = None,
                 eos_ids: tuple[int, ...] = ()) -> dict:
        """{"output_ids", "new_tokens", "total_s", "ttft_s", "tpot_s"}: the same stop rule as the engine's AR
        (max_new_tokens, or an EOS token, which is kept)."""
        sampling = sampling or Sampling()
        if len(prompt_ids) + max_new_tokens > self.max_len:
            raise CompileError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                               f"compiled baseline's static cache of {self.max_len} positions")
        generator = None if sampling.greedy else torch.Generator(device=self.device).manual_seed(sampling.seed)
        self.cache.reset()
        synchronize(self.device)
        start = time.perf_counter()
        ids = torch.tensor([prompt_ids], device=self.device)
        logits = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1,
                            cache_position=torch.arange(len(prompt_ids), device=self.device)).logits[0, -1]
        out = [self._next(logits, sampling, generator)]
        synchronize(self.device)
        ttft = time.perf_counter() - start
        # inductor must see an ordinary matmul with a constant weight to choose and pack its own kernel
        with forcing(self.model, "plain"):
            while len(out) < max_new_tokens and out[-1] not in eos_ids:
                pos = len(prompt_ids) + len(out) - 1
                first = time.perf_counter() if self.compile_s is None else None
                logits = self.step(input_ids=torch.tensor([[out[-1]]], device=self.device),
                                   position_ids=torch.tensor([[pos]], device=self.device),
                                   cache_position=torch.tensor([pos], device=self.device),
                                   past_key_values=self.cache, use_cache=True).logits[0, -1]
                out.append(self._next(logits, sampling, generator))
                if first is not None:
                    self.compile_s = time.perf_counter() - first
        synchronize(self.device)
        total = time.perf_counter() - start
        return {"output_ids": out, "new_tokens": len(out), "total_s": total, "ttft_s": ttft,
                "tpot_s": (total - ttft) / (len(out) - 1) if len(out) > 1 else None}

    @staticmethod
    def _next(logits: torch.Tensor, sampling: Sampling, generator) -> int:
        if sampling.greedy:
            return int(logits.argmax())
        return int(torch.multinomial(sampling.process(logits[None])[0], 1, generator=generator))

    def warm_up(self, prompt_ids: list[int]) -> float:
        """Compile now (two decode steps) and return the seconds it took."""
        start = time.perf_counter()
        self.generate(prompt_ids[: max(1, min(len(prompt_ids), self.max_len - 3))], 3)
        return time.perf_counter() - start
