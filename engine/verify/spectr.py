"""SpecTr's K-SEQ solver (Sun et al. 2023), for k i.i.d. child draws from q.

With beta(rho) = sum min(p / rho, q) and p_acc(rho) = 1 - (1 - beta)^k, take rho* in [1, k] with
p_acc(rho*) = rho* beta(rho*). Try the draws in order, accepting x with probability min(1, p(x) / (rho* q(x))); if
all fail, sample from norm(max(p - gamma min(p / rho*, q), 0)) with gamma = p_acc / beta. Lossless: the accepted
token has law gamma min(p / rho, q), which never exceeds p when gamma <= rho, i.e. rho >= rho*, so the residual
makes up exactly p. The bisection therefore returns the upper end of its bracket.
"""
import torch

from engine.verify.base import TopDown


def overlap(p: torch.Tensor, q: torch.Tensor, rho: float) -> torch.Tensor:
    """min(p / rho, q), elementwise."""
    return p / rho - (p / rho - q).clip(min=0.0)


def division_factor(p: torch.Tensor, q: torch.Tensor, k: int, steps: int = 20) -> float:
    """rho* (or at most (k - 1) / 2^steps above it): the root of p_acc(rho) - rho beta(rho), decreasing on [1, k].
    Bisection; any rho >= rho* keeps the rule lossless, so the upper end of the bracket is returned."""
    beta_at = lambda rho: float(overlap(p, q, rho).sum())  # noqa: E731
    lo, hi = 1.0, float(k)
    for _ in range(steps if k > 1 else 0):
        mid = 0.5 * (lo + hi)
        beta = beta_at(mid)
        if 1 - (1 - beta) ** k - mid * beta > 0:
            lo = mid
        else:
            hi = mid
    return hi


class SpecTr(TopDown):
    name = "spectr"
    label = "SpecTr (K-SEQ)"
    child_modes = ("iid",)

    def solve(self, tree, p, draws, rng, accept):
        q, k = draws[0][1], len(draws)
        rho = division_factor(p, q, k)
        for child, _ in draws:
            token = tree.tokens[child]
            pt, qt = float(p[token]), float(q[token])
            a = accept[child] = 1.0 if pt >= rho * qt else pt / (rho * qt)
            if rng.accept(a):
                return child, token, False
        common = overlap(p, q, rho)
        beta = float(common.sum())
        gamma = (1 - (1 - beta) ** k) / beta if beta > 0 else 0.0
        rest = (p - gamma * common).clip(min=0.0)
        mass = float(rest.sum())
        return None, rng.choice(rest / mass if mass > 0 else p), True
