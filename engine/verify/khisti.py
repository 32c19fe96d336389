"""Khisti-style verification (Khisti et al. 2025, canonical two-step architecture), for k i.i.d. child draws.

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

SMALL, MAX_SUPPORT = 64, 4096


def _beats(wx: float, wy: float) -> float:
    return wx / (wx + wy) if wx + wy > 0 else 0.5


def selection_law(p, q, k: int):
    """r: the law of the tournament winner among k i.i.d. draws from q, same array type as q; None when the draft's
    support is too large to compute it."""
    if len(q) <= SMALL:  # plain floats: the tests' tiny vocabularies
        qs, ps = q.tolist(), p.tolist()
        w = [a / b if b > 0 else 0.0 for a, b in zip(ps, qs)]
        idx = [i for i, b in enumerate(qs) if b > 0]
        beat = {x: [_beats(w[x], w[y]) for y in idx] for x in idx}
        q_in = [qs[y] for y in idx]
        wins_vs_q = {x: sum(b * qy for b, qy in zip(beat[x], q_in)) for x in idx}
        r = q_in
        for _ in range(k - 1):
            r = [qs[x] * sum(b * rc for b, rc in zip(beat[x], r)) + rx * wins_vs_q[x] for x, rx in zip(idx, r)]
        out = q * 0.0
        for i, v in zip(idx, r):
            out[i] = v
        return out
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
    label = "Khisti (tournament selection + speculative sampling)"
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
                if rng.uniform() < _beats(w(child), w(champion)):
                    champion = child
        a = accept[champion] = ratio(p, r, tree.tokens[champion])
        if rng.uniform() < a:
            return champion, tree.tokens[champion], False
        return None, rng.choice(residual(p, r)[0]), True
