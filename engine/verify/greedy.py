"""Greedy verification (temperature 0): follow the target's argmax down the tree; the first miss is the bonus."""
from engine.verify.base import Verdict, Verifier


class Greedy(Verifier):
    name = "greedy"
    label = "Greedy (argmax matching)"
    child_modes = ("topk", "iid", "without_replacement")  # exact whatever produced the children
    greedy_only = True

    def verify(self, tree, logits, sampling=None, generator=None) -> Verdict:
        choice = logits.argmax(dim=-1).tolist()
        path = [0]
        while True:
            child = tree.child_with_token(path[-1], choice[path[-1]])
            if child is None:
                return Verdict(path=path, bonus=choice[path[-1]])
            path.append(child)
