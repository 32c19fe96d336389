"""Acceptance rates of the OT-based rules (delayed-tree-expansion paper, Appendix C, Algorithms 6-9).

alpha(p, q, k) = P(the token a rule emits at a node is one of its k i.i.d. draft children X_1..X_k ~ q): the chance the
walk goes one level deeper. It depends only on p, q and k, not on the drawn children. Inputs are probability vectors
(torch or numpy) over the same vocabulary; the formulas use only arithmetic, `.clip` and `.sum`. Khisti has no
efficient exact formula (Appendix C): `khisti_acceptance_lower_bound` gives Algorithm 10's bound for our selection.
"""
from engine.verify.khisti import selection_law
from engine.verify.spectr import division_factor, overlap


def _pos(x):
    return x.clip(min=0.0)


def nss_acceptance(p, q, k: int) -> float:
    """sum_t p(t) (1 - (1 - q(t))^k): y ~ p lands on a child."""
    return float((p * (1 - (1 - q) ** k)).sum())


def naive_acceptance(p, q, k: int) -> float:
    """sum min(p, q) + sum (p - q)+ (1 - (1 - q)^(k-1)): X_1 accepted, or the residual token is another child."""
    return float((p - _pos(p - q)).sum() + (_pos(p - q) * (1 - (1 - q) ** (k - 1))).sum())


def spectr_acceptance(p, q, k: int) -> float:
    """p_acc + (1 - p_acc) sum p_res(t) (1 - (1 - r(t))^k), r = (q - p/rho*)+ / (1 - beta) the law of a rejected draw."""
    rho = division_factor(p, q, k)
    common = overlap(p, q, rho)
    beta = float(common.sum())
    p_acc = 1 - (1 - beta) ** k
    if beta >= 1 or p_acc >= 1:
        return 1.0
    rest = _pos(p - (p_acc / beta) * common)
    p_res = rest / float(rest.sum())
    r = _pos(q - p / rho) / (1 - beta)
    return float(p_acc + (1 - p_acc) * (p_res * (1 - (1 - r) ** k)).sum())


def specinfer_acceptance(p, q, k: int) -> float:
    """1 - P(all k rounds reject) + P(all reject) sum_t p_k(t) (1 - m(t)), where round i accepts with
    r_i = sum min(p_i, q), p_{i+1} = norm((p_i - q)+), and m(t) is the chance no rejected draw was t."""
    p_rej, m = 1.0, q * 0 + 1
    for _ in range(k):
        r = float((p - _pos(p - q)).sum())
        if r >= 1:
            return 1.0
        p_rej *= 1 - r
        m = m * (1 - _pos(q - p) / (1 - r))
        p = _pos(p - q) / float(_pos(p - q).sum())
    return float((1 - p_rej) + p_rej * (p * (1 - m)).sum())


def khisti_acceptance_lower_bound(p, q, k: int) -> float:
    """sum min(p, r), r the law of the selected draft token (Algorithm 10): the residual landing on another child
    is left out, which is why this is a lower bound."""
    r = selection_law(p, q, k)
    r = q if r is None else r
    return float((p - _pos(p - r)).sum())


ACCEPTANCE = {
    "nss": nss_acceptance,
    "token_matching": nss_acceptance,
    "naive_tree": naive_acceptance,
    "spectr": spectr_acceptance,
    "specinfer": specinfer_acceptance,
}

LOWER_BOUNDS = {"khisti": khisti_acceptance_lower_bound}
