"""The decoding rule: temperature, then top-k, then top-p (nucleus), renormalised.

One `Sampling` processes BOTH the target's logits (giving p) and the draft's logits (giving q). Lossless speculative
sampling reproduces exactly the distribution `process(target logits)`, so p and q must come from the same rule, and
the verifier must see the very q that drew the draft's children.

    s = Sampling(temperature=0.7, top_p=0.9, seed=0)
    probs = s.process(logits)   # float32, rows sum to 1

temperature = 0 means greedy decoding (process gives the one-hot argmax); top_k = 0 and top_p = 1 switch those off.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass

import torch

MAX_TEMPERATURE = 100.0


class SamplingError(ValueError):
    """A sampling setting that makes no sense."""


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        t, k, p, seed = self.temperature, self.top_k, self.top_p, self.seed
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t):
            raise SamplingError(f"temperature must be a finite number, got {t!r}")
        if not 0 <= t <= MAX_TEMPERATURE:
            raise SamplingError(f"temperature must be between 0 (greedy) and {MAX_TEMPERATURE:g}, got {t}")
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
            raise SamplingError(f"top_k must be a whole number >= 0 (0 switches it off), got {k!r}")
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 < p <= 1:
            raise SamplingError(f"top_p must be in (0, 1] (1 switches it off), got {p!r}")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2**63:
            raise SamplingError(f"seed must be a whole number >= 0, got {seed!r}")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_k", int(k))
        object.__setattr__(self, "top_p", float(p))
        object.__setattr__(self, "seed", int(seed))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def as_dict(self) -> dict:
        return asdict(self)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] -> probabilities [..., V] (float32) under temperature, top-k, top-p."""
        logits = logits.float()
        if self.greedy:
            probs = torch.zeros_like(logits)
            return probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        logits = logits / self.temperature
        if 0 < self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.top_p < 1.0:
            # Keep the smallest set of most likely tokens whose mass reaches top_p (the most likely always stays).
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
            drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= self.top_p
            drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs
