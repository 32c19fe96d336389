"""Block verification (Sun et al. 2024c) for a single draft chain X_1..X_L.

Weights w_0 = 1, w_i = min(1, w_{i-1} p_{i-1}(X_i) / q_i(X_i)) (p_i, q_{i+1}: target and draft after X_i). From the
deepest node up, stop at the first i with eta_i <= h_i, where h_L = w_L and, for i < L,
h_i = R_i / (R_i + 1 - w_i) with R_i = sum max(w_i p_i - q_{i+1}, 0); the bonus after X_tau is drawn from p_L when
tau = L, else from the weighted residual norm(max(w_tau p_tau - q_{tau+1}, 0)). Lossless and optimal among chain
rules (Sun et al.); it is what Traversal verification does on a chain, and the proof in `traversal.py` applies.
Deterministic (top-1) chains count as draws from point masses.
"""
from engine.verify.base import MODES, ChainOnly, Verdict, Verifier, child_draws, residual


class BlockVerification(ChainOnly, Verifier):
    name = "block"
    label = "Block verification (chain)"
    child_modes = MODES

    def walk(self, tree, p, rng) -> Verdict:
        chain, drafts = [0], []  # drafts[i]: the distribution chain[i + 1] was drawn from
        while draws := child_draws(tree, chain[-1]):
            child, q = draws[0]
            chain.append(child)
            drafts.append(q)
        weights = [1.0]
        for i, node in enumerate(chain[1:]):
            pt, qt = weights[-1] * float(p[chain[i]][tree.tokens[node]]), float(drafts[i][tree.tokens[node]])
            weights.append(1.0 if pt >= qt else pt / qt)
        depth, accept, tau = len(chain) - 1, {}, 0
        for i in range(depth, 0, -1):
            if i == depth:
                h = weights[i]
            else:
                _, rest = residual(p[chain[i]], drafts[i], weights[i])
                h = rest / ((1.0 - weights[i]) + rest) if rest > 0 else 0.0
            accept[chain[i]] = h
            if rng.accept(h):
                tau = i
                break
        if tau == depth:
            return Verdict(chain, rng.choice(p[chain[tau]]), accept)
        bonus = rng.choice(residual(p[chain[tau]], drafts[tau], weights[tau])[0])
        return Verdict(chain[: tau + 1], bonus, accept, True)
