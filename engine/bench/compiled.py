"""Autoregressive decoding through torch.compile: the fastest single-row step torch offers, as a baseline.

The engine's eager AR step spends most of its time in oneDNN's linear kernels. inductor with frozen weights and
`max-autotune` times its own C++ micro-GEMMs against them per weight shape, keeps the faster, and fuses the rest of
the layer; on the project's 2-core CPU that made AR markedly faster (docs/experiments/compiled-ar.md). Whether it
wins is the machine's business, so `bench` runs this beside the eager AR and divides by whichever was faster. The
speculative methods do not use it (their row counts change every iteration; see docs/engine.md).

    ar = CompiledAR(pair.target)        # compiles on first use of each cache size (about a minute for 1.5B on 2 cores)
    out = ar.generate(prompt_ids, max_new_tokens=96, sampling=Sampling(), eos_ids=(...))

The cost of it:
  * a compiled step attends over its whole static cache, filled or not, so a cache far longer than the sequence
    slows every step (docs/experiments/design-measurements.md). Caches therefore come
    in sizes of `cache_step` positions, the smallest that fits prompt + new tokens, each with its own graph: the
    graph is specialised to the cache tensors it was traced with (handing it a fresh cache silently reads the old
    one), so each size keeps its cache for the object's life and every generation resets it;
  * the linears run their plain `F.linear` path inside the graph (inductor packs the frozen weights itself), which
    keeps one more packed copy of the target's weights per cache size;
  * attention runs as the captured steps trace it, the query heads folded onto their key/value head
    (engine/core/attention.py `folded_attention`), on torch's fused CPU kernel: 6-8 % faster per step than SDPA's math
    backend with grouped-query heads (`enable_gqa`) on the project's Zen 4, and that in turn beat transformers' default
    of repeated key/value heads on its first CPU (scripts/lab/compile_probe.py --variants);
  * the prefill runs eagerly (its length changes per prompt; compiling it would recompile per length).
"""
from __future__ import annotations

import time

import torch

from engine.core.attention import folded_attention
from engine.core.sampling import Sampling
from engine.cpu.kernels import routed_linears
from engine.runtime import forcing, synchronize

CACHE_STEP = 384  # positions; finer steps cost a compile and a weight copy per size, coarser ones slower steps


class CompileError(RuntimeError):
    """torch.compile cannot run here (no C++ compiler, an unsupported device) or the prompt does not fit."""


def compile_available(device: torch.device, model=None) -> str | None:
    """None if a compiled CPU step of `model` can be built here, else why not. It traces the plain weights, so a
    model whose plain weights a packed format replaced (engine/cpu/formats.py) cannot take it."""
    if device.type != "cpu":
        return f"the compiled AR baseline is CPU-only here (device {device.type}); CUDA graphs are a separate issue"
    if model is not None and any("plain" not in layer.paths for layer in routed_linears(model)):
        return ("the target's plain weights were freed for another format; map them back first "
                "(engine/models/checkpoint.py, as the bench does)")
    try:
        from torch._inductor import cpp_builder
        cpp_builder.get_cpp_compiler()
    except Exception as err:  # noqa: BLE001 - any failure means no compiler
        return f"no C++ compiler for inductor ({str(err)[:120]})"
    return None


def round_to_step(total: int, step: int = CACHE_STEP) -> int:
    """The static cache length for `total` positions: the smallest whole number of `step`s that holds them."""
    return -(-total // step) * step


class CompiledAR:
    """Greedy or sampled decoding of `model` one row at a time with a compiled forward on a static cache."""

    def __init__(self, model, mode: str = "max-autotune", cache_step: int = CACHE_STEP):
        import torch._inductor.config as inductor_config
        self.model, self.cache_step = model, int(cache_step)
        self.device = next(model.parameters()).device
        reason = compile_available(self.device, model)
        if reason:
            raise CompileError(reason)
        # Frozen weights are constants to inductor: it picks its GEMM per weight and packs it once. (A process-wide
        # inductor setting; nothing else in the engine compiles.)
        inductor_config.freezing = True
        self.caches: dict[int, object] = {}  # cache size -> its StaticCache, one compiled graph each
        self.step = torch.compile(model, dynamic=False, mode=mode)
        self.compile_s: dict[int, float] = {}  # cache size -> seconds its first step took (trace, autotune, build)
        self.limit = getattr(model.config, "max_position_embeddings", None)

    def cache_size(self, total: int) -> int:
        """The static cache a sequence of `total` positions decodes on: the smallest multiple of cache_step."""
        if self.limit and total > self.limit:
            raise CompileError(f"prompt + max_new_tokens ({total} positions) exceeds the model's {self.limit}")
        return round_to_step(total, self.cache_step)

    def _cache(self, total: int):
        from transformers import StaticCache
        size = self.cache_size(total)
        if size not in self.caches:
            # each size is a recompile of the same forward; past dynamo's limit it would quietly run eagerly
            if len(self.caches) >= torch._dynamo.config.recompile_limit:
                raise CompileError(f"the compiled AR already holds {len(self.caches)} cache sizes, torch's limit of "
                                   "compiled graphs per function; use a larger cache_step")
            self.caches[size] = StaticCache(config=self.model.config, max_cache_len=size)
        return size, self.caches[size]

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling | None = None,
                 eos_ids: tuple[int, ...] = ()) -> dict:
        """{"output_ids", "new_tokens", "total_s", "ttft_s", "tpot_s", "cache_size"}: the same stop rule as the
        engine's AR (max_new_tokens, or an EOS token, which is kept)."""
        sampling = sampling or Sampling()
        size, cache = self._cache(len(prompt_ids) + max_new_tokens)
        generator = None if sampling.greedy else torch.Generator(device=self.device).manual_seed(sampling.seed)
        cache.reset()
        synchronize(self.device)
        start = time.perf_counter()
        ids = torch.tensor([prompt_ids], device=self.device)
        logits = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1,
                            cache_position=torch.arange(len(prompt_ids), device=self.device)).logits[0, -1]
        out = [self._next(logits, sampling, generator)]
        synchronize(self.device)
        ttft = time.perf_counter() - start
        # inductor must see an ordinary matmul with a constant weight to choose and pack its own kernel
        with forcing(self.model, "plain"), folded_attention(self.model):
            while len(out) < max_new_tokens and out[-1] not in eos_ids:
                pos = len(prompt_ids) + len(out) - 1
                first = time.perf_counter() if size not in self.compile_s else None
                logits = self.step(input_ids=torch.tensor([[out[-1]]], device=self.device),
                                   position_ids=torch.tensor([[pos]], device=self.device),
                                   cache_position=torch.tensor([pos], device=self.device),
                                   past_key_values=cache, use_cache=True).logits[0, -1]
                out.append(self._next(logits, sampling, generator))
                if first is not None:
                    self.compile_s[size] = time.perf_counter() - first
        synchronize(self.device)
        total = time.perf_counter() - start
        return {"output_ids": out, "new_tokens": len(out), "total_s": total, "ttft_s": ttft,
                "tpot_s": (total - ttft) / (len(out) - 1) if len(out) > 1 else None, "cache_size": size}

    @staticmethod
    def _next(logits: torch.Tensor, sampling: Sampling, generator) -> int:
        if sampling.greedy:
            return int(logits.argmax())
        return int(torch.multinomial(sampling.process(logits[None])[0], 1, generator=generator))

    def warm_up(self, prompt_ids: list[int], totals: list[int]) -> float:
        """Compile now the step of every cache size that sequences of `totals` positions need; return the seconds.
        Each size is warmed with a prompt that fills it but for three new tokens (`prompt_ids`, repeated)."""
        start = time.perf_counter()
        for size in sorted({self.cache_size(t) for t in totals}):
            if size not in self.compile_s:
                self.generate((prompt_ids * size)[: size - 3], 3)
        return time.perf_counter() - start
