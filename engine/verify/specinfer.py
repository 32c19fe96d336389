"""SpecInfer multi-round rejection sampling (Miao et al.), with and without replacement.

Try the child draws in order: accept x with probability min(1, p(x)/q(x)); on rejection p <- norm(max(p - q, 0))
and, when the children were drawn without replacement, q <- q with x removed and renormalised (the next draw's
distribution). All rejected: emit a sample of the residual. Each round is one naive speculative sampling step of the
current p against the distribution the next child was really drawn from, so the output follows p (the residual is
exactly what the target still owes). i.i.d. children are tried in draw order, which is already a uniformly random
order (Algorithm 4's uniform choice); deterministic children are draws from point masses (then it is token matching).
"""
from engine.verify.base import MODES, TopDown, ratio, residual


class SpecInfer(TopDown):
    name = "specinfer"
    label = "SpecInfer (multi-round rejection sampling)"
    child_modes = MODES

    def solve(self, tree, p, draws, rng, accept):
        for child, q in draws:
            a = accept[child] = ratio(p, q, tree.tokens[child])
            if rng.accept(a):
                return child, tree.tokens[child], False
            p = residual(p, q)[0]
        return None, rng.choice(p), True
