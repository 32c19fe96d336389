"""Traversal verification (Weng et al. 2025): bottom-up, leaf to root, over sequence-level weights.

Every node u carries a weight a(u) and a target distribution p_u (initially the target's p after u); the root has
a = 1. Visiting u tries its child draws in order (post-order DFS, first child first). A draw x ~ q enters with weight
min(1, a(u) p_u(x) / q(x)) and is visited in turn. If it is rejected, u's state becomes
    m = sum min(a p_u, q),   p_u <- norm(max(a p_u - q, 0)),   a <- (a - m) / (1 - m),
and for children drawn without replacement q loses x. Once every draw is rejected, u itself is accepted with
probability a (then the bonus is drawn from p_u) or rejected. The root is always accepted (its a stays 1).

Why it is lossless, by induction from the leaves: visiting u accepts with probability a and, when it does, the first
emitted token after u is t with probability a p_u(t) (and the rest follows the target); it rejects with probability
1 - a. A leaf does this by construction. For a draw x ~ q with entry weight b = min(1, a p_u(x) / q(x)), the child
accepts with probability b and emits x: mass min(q, a p_u)(t) on t. It rejects with probability 1 - m, after which the
updated state accepts with (a - m) / (1 - m), emitting from max(a p_u - q, 0) / (a - m): mass (a p_u - q)+(t).
The two add up to a p_u(t); rejection is left with (1 - m)(1 - a') = 1 - a. The later draws only see the updated
state, whatever its q, so any number of draws (i.i.d. or without replacement; a deterministic child is a draw from
the point mass on its token) keeps the invariant. At the root a = 1: the output follows the target.
On a chain this is exactly block verification (`block.py`). (The update rule is reconstructed from the descriptions
of Weng et al. and of the delayed-tree paper and proven as above; tests check it against block verification.)

Merged duplicates (i.i.d. paths sharing a node, as the delayed strategy stores them with `DraftTree.add_draw`) are
first split back into one node per draw: the draws at a node, in their true draw order, are dealt in turn to the
copies of the node, the same number to each copy. i.i.d. draws are exchangeable, so consecutive shares are
distributed exactly as if each copy had drawn its own children. Trees whose copies cannot hold equal shares are
refused.
"""
from engine.core.tree import DraftTree
from engine.verify.base import MODES, Verdict, Verifier, VerificationError, child_draws, residual


class Traversal(Verifier):
    name = "traversal"
    label = "Traversal verification (bottom-up)"
    child_modes = MODES

    def walk(self, tree, p, rng) -> Verdict:
        real = None
        if any(tree.multiplicity(node) > 1 for node in range(1, len(tree))):
            tree, real = split_duplicates(tree)
            p = _Relabel(p, real)
        verdict = self._walk(tree, p, rng)
        if real is not None:
            verdict.path = [real[v] for v in verdict.path]
            verdict.accept_prob = {real[v]: a for v, a in verdict.accept_prob.items()}
        return verdict

    def _walk(self, tree, p, rng) -> Verdict:
        accept: dict[int, float] = {}

        def visit(node: int, weight: float):
            """Returns (reversed accepted path, bonus, resampled) or None if `node` is rejected."""
            dist, resampled = p[node], False
            for child, q in child_draws(tree, node):
                token = tree.tokens[child]
                pt, qt = weight * float(dist[token]), float(q[token])
                found = visit(child, 1.0 if pt >= qt else pt / qt)
                if found is not None:
                    found[0].append(node)
                    return found
                # m = sum min(a p_u, q) = a - rest, so a' = (a - m) / (1 - m) = rest / (1 - a + rest)
                dist, rest = residual(dist, q, weight)
                weight, resampled = (rest / ((1.0 - weight) + rest) if rest > 0 else 0.0), True
            if node > 0:
                accept[node] = weight
            if node == 0 or rng.accept(weight):
                return [node], rng.choice(dist), resampled
            return None

        reversed_path, bonus, resampled = visit(0, 1.0)
        return Verdict(reversed_path[::-1], bonus, accept, resampled)



class _Relabel:
    """p indexed by split-tree node, read from the real node it copies."""

    def __init__(self, p, real):
        self.p, self.real = p, real

    def __getitem__(self, node):
        return self.p[self.real[node]]


def split_duplicates(tree: DraftTree) -> tuple[DraftTree, list[int]]:
    """One node per i.i.d. draw: returns the split tree and, per split node, the real node it copies."""
    split, real = DraftTree(root_token=tree.root_token), [0]

    def deal(node: int, copies: list[int]) -> None:
        draws = tree.draw_order(node)
        if not draws:
            return
        mode = tree.child_mode.get(node, "topk")
        if len(draws) % len(copies) or (mode != "iid" and len(copies) > 1):
            raise VerificationError(f"traversal verification cannot split node {node}: {len(draws)} draws over "
                                    f"{len(copies)} copies")
        share, copies_of = len(draws) // len(copies), {}
        for i, copy in enumerate(copies):
            split.child_dist[copy], split.child_mode[copy] = tree.child_dist[node], mode
            for child in draws[i * share:(i + 1) * share]:
                new = split.add(copy, tree.tokens[child], tree.q[child])
                real.append(child)
                copies_of.setdefault(child, []).append(new)
        for child, child_copies in copies_of.items():
            deal(child, child_copies)

    deal(0, [0])
    return split, real
