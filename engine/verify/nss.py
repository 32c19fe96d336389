"""Token matching / NSS: at each node sample y ~ p; descend if y is a child, else emit y as the bonus.

Lossless for any tree, however its children were drawn: every emitted token is a plain sample of the target given the
path so far, and the draft only decides how far the walk gets before it stops. This is the rule for deterministic
(top-k) children; Miao et al. (SpecInfer) call it naive sampling, the delayed-expansion paper calls it NSS.
"""
from engine.verify.base import MODES, TopDown


class TokenMatching(TopDown):
    name = "token_matching"
    label = "Token matching (sample y ~ p, descend if y is a child)"
    child_modes = MODES

    def solve(self, tree, p, draws, rng, accept):
        for child, _ in draws:
            accept[child] = float(p[tree.tokens[child]])  # the chance that y lands on this child
        return None, rng.choice(p), False


class NSS(TokenMatching):
    name = "nss"
    label = "NSS (naive sampling from the target)"
