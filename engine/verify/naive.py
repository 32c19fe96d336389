"""Naive speculative sampling (Leviathan et al.; Chen et al.) and its tree form, NaiveTree.

At each node, accept the first child draw x ~ q with probability min(1, p(x)/q(x)); otherwise sample y from the
residual norm(max(p - q, 0)) and descend if y is some other child, else emit it. Lossless: P(y = t) =
min(p, q)(t) + (1 - sum min(p, q)) * (p - q)+(t) / sum (p - q)+ = p(t). Deterministic (top-k) children count as
draws from the point mass on their token, which keeps the argument intact. `naive` is the single-path original
(chains only); `naive_tree` lets the residual token land on any other child.
"""
from engine.verify.base import MODES, ChainOnly, TopDown, ratio, residual


class NaiveTree(TopDown):
    name = "naive_tree"
    label = "NaiveTree (speculative sampling on the first child)"
    child_modes = MODES

    def solve(self, tree, p, draws, rng, accept):
        child, q = draws[0]
        a = accept[child] = ratio(p, q, tree.tokens[child])
        if rng.accept(a):
            return child, tree.tokens[child], False
        return None, rng.choice(residual(p, q)[0]), True


class Naive(ChainOnly, NaiveTree):
    name = "naive"
    label = "Naive speculative sampling (chain)"
