"""Khisti-style verification (Khisti et al. 2025, canonical two-step architecture), for k i.i.d. child draws.

The selection weights here are p/q tournament weights, NOT the truncated-LP weights of Khisti et al.: the rule is
exactly lossless either way, but its acceptance is lower than the paper's (measured against the Algorithm 10 bound
for our selection in tests/test_verify_exact.py and docs/rules.md).

Step 1, importance-weighted selection: a sequential pairwise tournament over the draws X_1..X_k (the champion meets
each next draw; x beats y with probability w(x) / (w(x) + w(y)), w = p / q, 1/2 when both are 0) picks one token Y.
Its law r is computed exactly: r_1 = q, r_{i+1}(x) = q(x) sum_c r_i(c) B(x, c) + r_i(x) sum_y q(y) B(x, y).
Step 2, single-draft speculative sampling of p against r: accept Y with probability min(1, p(Y) / r(Y)), else emit a
sample of norm(max(p - r, 0)) (descending if it is another child). Lossless because Y ~ r exactly and step 2 turns
any r into p. What we do not reproduce is Khisti et al.'s selection weights, which come from a truncated optimal-
transport LP: any weights keep the rule exact, theirs raise its acceptance. r costs O(k S^2) over the draft's
support S; past MAX_SUPPORT tokens (an untruncated draft) the selection falls back to the first draw, whose law is q
itself, which is still exact (it is then NaiveTree).
"""
import torch

from engine.verify.base import TopDown, ratio, residual

MAX_SUPPORT = 4096


def _beats(wx: float, wy: float) -> float:
    return wx / (wx + wy) if wx + wy > 0 else 0.5


def selection_law(p: torch.Tensor, q: torch.Tensor, k: int) -> torch.Tensor | None:
    """r: the law of the tournament winner among k i.i.d. draws from q (same dtype as q); None when the draft's
    support is too large to compute it. Computed in float64 over q's support."""
    support = (q > 0).nonzero().flatten()
    if len(support) > MAX_SUPPORT:
        return None
    qs, ps = q[support].double(), p[support].double()
    w = ps / qs
    total = w[:, None] + w[None, :]
    beat = torch.where(total > 0, w[:, None] / total.clamp(min=1e-300), torch.full_like(total, 0.5))  # B(x, y)
    r = qs
    for _ in range(k - 1):
        r = qs * (beat @ r) + r * (beat @ qs)
    return torch.zeros_like(q).index_put_((support,), r.to(q.dtype))


class Khisti(TopDown):
    name = "khisti"
    label = "Khisti-style (p/q tournament selection + speculative sampling; not the paper's LP weights)"
    child_modes = ("iid",)

    def solve(self, tree, p, draws, rng, accept):
        q, k = draws[0][1], len(draws)
        w = lambda node: (float(p[tree.tokens[node]]) / float(q[tree.tokens[node]])  # noqa: E731
                          if float(q[tree.tokens[node]]) > 0 else 0.0)
        champion, r = draws[0][0], selection_law(p, q, k)
        if r is None:
            r = q  # no tournament: the first draw, law q
        else:
            for child, _ in draws[1:]:
                if rng.accept(_beats(w(child), w(champion))):
                    champion = child
        a = accept[champion] = ratio(p, r, tree.tokens[champion])
        if rng.accept(a):
            return champion, tree.tokens[champion], False
        return None, rng.choice(residual(p, r)[0]), True
