"""Every verification rule is lossless: with fixed synthetic target p and draft q on a 4-token vocabulary, the first
three emitted tokens over 20,000 seeded trials follow the target's joint distribution (chi-square, p > 0.001), for
K = 1..4 i.i.d. children (duplicates are frequent with 4 tokens); other child modes, deeper trees and merged
duplicate paths get 10,000 trials each.

Each trial draws a fresh tree from q (i.i.d., without replacement, or top-k children), verifies it, and extends the
emitted tokens (accepted path + bonus) with plain target samples to three tokens, exactly as the next iterations
would. The rules only index, add, multiply, clip and sum their distributions, so here they run on tiny plain-float
vectors (`Vec`) with a Python random source, which keeps a trial near 50 us. The Appendix C acceptance rates are
checked on the same runs (how often the root's emitted token is one of its children). The harness is tested too:
deliberately wrong rules are caught.
"""
import math
import random

import numpy as np
import pytest
import torch

from chisq import chi_square_pvalue
from engine.tree import DraftTree
from engine.verify import VERIFIERS, Verdict, VerificationError, Verifier, make_verifier
from engine.verify import theory
from engine.verify.base import TopDown

V, L, TRIALS = 4, 3, 20_000
EXTRA_TRIALS = 10_000  # the supplementary shapes (deeper trees, merged paths, other child modes)
ALPHA = 1e-3


class Vec:
    """A tiny probability vector of plain floats with every operation the rules use (indexing, arithmetic, `.clip`,
    `.sum`, `.tolist`); a few times cheaper per call than numpy at this size, which keeps 20,000 trials fast."""
    __slots__ = ("x",)

    def __init__(self, x):
        self.x = x  # a list of floats

    def _other(self, o):
        return o.x if isinstance(o, Vec) else [o] * len(self.x)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i]

    def __setitem__(self, i, value):
        self.x[i] = value

    def __add__(self, o):
        return Vec([a + b for a, b in zip(self.x, self._other(o))])

    def __sub__(self, o):
        return Vec([a - b for a, b in zip(self.x, self._other(o))])

    def __rsub__(self, o):
        return Vec([o - a for a in self.x])

    def __mul__(self, o):
        return Vec([a * b for a, b in zip(self.x, self._other(o))])

    def __truediv__(self, o):
        return Vec([a / b for a, b in zip(self.x, self._other(o))])

    def __pow__(self, k):
        return Vec([a**k for a in self.x])

    __radd__, __rmul__ = __add__, __mul__

    def clip(self, min):  # noqa: A002 (numpy / torch spelling)
        return Vec([a if a > min else min for a in self.x])

    def sum(self):
        return sum(self.x)

    def tolist(self):
        return list(self.x)


def _tables(seed: int = 1):
    """Target and draft next-token distributions for every context of up to L tokens; some entries zero."""
    rng = np.random.default_rng(seed)
    P, Q, contexts = {}, {}, [()]
    for _ in range(L + 1):
        grown = []
        for ctx in contexts:
            for table in (P, Q):
                d = rng.random(V) ** 2
                if rng.random() < 0.5:
                    d[rng.integers(V)] = 0.0
                table[ctx] = d / d.sum()
            grown += [ctx + (t,) for t in range(V)]
        contexts = grown
    return P, Q


P_ARRAYS, Q_ARRAYS = _tables()
P = {ctx: Vec(d.tolist()) for ctx, d in P_ARRAYS.items()}
Q = {ctx: Vec(d.tolist()) for ctx, d in Q_ARRAYS.items()}


class PyRandom:
    """The rules' random source for these tests: Python's Mersenne twister, seeded."""

    def __init__(self, seed: int):
        self.random = random.Random(seed).random

    def uniform(self) -> float:
        return self.random()

    def choice(self, probs) -> int:
        weights = probs.tolist()
        u, acc, last = self.random() * sum(weights), 0.0, 0
        for i, w in enumerate(weights):
            if w > 0:
                acc, last = acc + w, i
                if u < acc:
                    return i
        return last


class Rows:
    """p[node] = the target distribution after the node's context."""

    def __init__(self, contexts):
        self.contexts = contexts

    def __getitem__(self, node):
        return P[self.contexts[node]]


class Draws:
    """Pre-drawn child tokens per context, in bulk (numpy), so building a tree costs only list appends."""

    def __init__(self, seed: int, chunk: int = 4096):
        self.rng, self.chunk, self.pools = np.random.default_rng(seed), chunk, {}

    def take(self, ctx, k: int, mode: str) -> list[int]:
        q, key = Q_ARRAYS[ctx], (ctx, mode)
        if mode == "topk":
            if key not in self.pools:
                self.pools[key] = [int(t) for t in np.argsort(-q, kind="stable")]
            return self.pools[key][:k]
        pool, at = self.pools.get(key, (None, self.chunk))
        if at == self.chunk:
            if mode == "iid":
                pool = self.rng.choice(V, size=(self.chunk, k), p=q).tolist()
            else:  # Gumbel-top-k: each row is an ordering drawn without replacement
                with np.errstate(divide="ignore"):
                    keys = np.log(q) + self.rng.gumbel(size=(self.chunk, V))
                support = int((q > 0).sum())
                pool = np.argsort(-keys, axis=1)[:, :support].tolist()
            at = 0
        self.pools[key] = (pool, at + 1)
        return pool[at][:k]


def build_tree(branching, mode: str, draws: Draws):
    """A tree whose depth-d nodes get branching[d] children drawn from Q given their context (top-k: the k most
    likely). Built directly as lists: the rules read tokens, parents, children, child_dist and child_mode."""
    tokens, parents, children, contexts = [0], [-1], [[]], [()]
    dist, modes, frontier = {}, {}, [0]
    for k in branching:
        grown = []
        for node in frontier:
            dist[node], modes[node] = Q[contexts[node]], mode
            for t in draws.take(contexts[node], k, mode):
                child = len(tokens)
                tokens.append(t)
                parents.append(node)
                children.append([])
                children[node].append(child)
                contexts.append(contexts[node] + (t,))
                grown.append(child)
        frontier = grown
    tree = DraftTree(root_token=0, tokens=tokens, parents=parents, children=children, child_dist=dist,
                     child_mode=modes)
    return tree, contexts


def build_delayed(k: int, draws: Draws, merge: bool):
    """One sampled token, then k i.i.d. paths of length 2 from it (a (k, 1, 2) delayed tree). merge=True stores it as
    the delayed strategy does: paths drawing the same token share a node, tree.extra["multiplicity"][node] counting
    the draws; merge=False keeps every draw a separate node."""
    tree, contexts = DraftTree(root_token=0), [()]
    counts = tree.extra["multiplicity"] = [1]

    def add(parent, token):
        if merge and (child := tree.child_with_token(parent, token)) is not None:
            counts[child] += 1
            return child
        q = Q[contexts[parent]]
        tree.child_dist[parent], tree.child_mode[parent] = q, "iid"
        contexts.append(contexts[parent] + (token,))
        counts.append(1)
        return tree.add(parent, token, q[token])

    trunk = add(0, draws.take((), 1, "iid")[0])
    for _ in range(k):
        node = trunk
        for _ in range(2):
            node = add(node, draws.take(contexts[node], 1, "iid")[0])
    return tree, contexts


def emitted(verifier: Verifier, make_tree, trials: int = TRIALS, seed: int = 0):
    """Counts of the first L emitted tokens (flattened to V**L cells), and how often the root's emitted token was one
    of its children (the acceptance rate of Appendix C)."""
    rnd, draws = PyRandom(seed), Draws(seed)
    counts, deeper = np.zeros(V**L, dtype=np.int64), 0
    for _ in range(trials):
        tree, contexts = make_tree(draws)
        verdict = verifier.walk(tree, Rows(contexts), rnd)
        out = [tree.tokens[n] for n in verdict.path[1:]] + [verdict.bonus]
        assert all(tree.parents[b] == a for a, b in zip(verdict.path, verdict.path[1:]))
        while len(out) < L:
            out.append(rnd.choice(P[tuple(out)]))
        counts[sum(t * V ** (L - 1 - i) for i, t in enumerate(out[:L]))] += 1
        deeper += len(verdict.path) > 1
    return counts, deeper / trials


def target_joint() -> np.ndarray:
    probs = np.ones(V**L)
    for cell in range(V**L):
        tokens = [(cell // V ** (L - 1 - i)) % V for i in range(L)]
        for i in range(L):
            probs[cell] *= P_ARRAYS[tuple(tokens[:i])][tokens[i]]
    return probs




JOINT = target_joint()


def check(rule: str, make_tree, seed: int = 0, k: int | None = None, trials: int = TRIALS) -> None:
    """Lossless (chi-square on the first L tokens); with k i.i.d. root children, also the Appendix C acceptance."""
    verifier = make_verifier(rule)
    counts, accepted = emitted(verifier, make_tree, trials=trials, seed=seed)
    pvalue = chi_square_pvalue(counts, JOINT)
    assert pvalue > ALPHA, f"{rule}: emitted tokens do not follow the target (chi-square p = {pvalue:.2g})"
    if k is not None and rule in theory.ACCEPTANCE:
        alpha = theory.ACCEPTANCE[rule](P[()], Q[()], k)
        sigma = math.sqrt(alpha * (1 - alpha) / trials)
        assert abs(accepted - alpha) < 4.5 * sigma + 1e-9, f"{rule}, k={k}: measured {accepted}, formula {alpha}"
    if k is not None and rule in theory.LOWER_BOUNDS:
        bound = theory.LOWER_BOUNDS[rule](P[()], Q[()], k)
        assert accepted > bound - 4.5 * math.sqrt(bound * (1 - bound) / trials), (rule, k, accepted, bound)


# -- every rule, K = 1..4 children per node, with the child modes it claims ----------------------------------------
CASES = (  # (rule, child mode, K): every rule, K = 1..4, 20,000 trials each
    [("token_matching", "topk", k) for k in (1, 2, 3, 4)] + [("nss", "iid", 3)]
    + [(rule, "iid", k) for rule in ("naive_tree", "specinfer", "spectr", "khisti", "traversal") for k in (1, 2, 3, 4)]
)
OTHER_MODES = [("specinfer", "without_replacement", k) for k in (2, 3, 4)] + [  # other child modes, 10,000 trials each
    ("naive_tree", "without_replacement", 3), ("naive_tree", "topk", 3), ("specinfer", "topk", 3),
    ("traversal", "without_replacement", 3), ("traversal", "topk", 3)]
DEEP = ["specinfer", "traversal"]  # the top-down rules also go three deep on the delayed trees below


@pytest.mark.parametrize("rule,mode,k", CASES)
def test_tree_rule_is_lossless(rule, mode, k):
    check(rule, lambda draws: build_tree((k, 1), mode, draws), seed=k, k=k if mode == "iid" else None)


@pytest.mark.parametrize("rule,mode,k", OTHER_MODES)
def test_other_child_modes_are_lossless(rule, mode, k):
    check(rule, lambda draws: build_tree((k, 1), mode, draws), seed=k, trials=EXTRA_TRIALS)


@pytest.mark.parametrize("rule,mode", [("naive", "iid"), ("block", "iid"), ("block", "topk")])
def test_chain_rule_is_lossless(rule, mode):
    check(rule, lambda draws: build_tree((1, 1, 1), mode, draws), k=1 if mode == "iid" else None)


@pytest.mark.parametrize("rule", DEEP)
def test_depth_three_tree_is_lossless(rule):
    check(rule, lambda draws: build_tree((2, 2, 1), "iid", draws), seed=7, trials=EXTRA_TRIALS)


@pytest.mark.parametrize("rule", ["naive_tree", "specinfer", "spectr", "khisti", "traversal"])
def test_merged_duplicate_paths_are_lossless(rule):
    """A delayed tree (one token, then 3 i.i.d. paths of length 2) stored as a trie with multiplicities."""
    check(rule, lambda draws: build_delayed(3, draws, merge=True), trials=EXTRA_TRIALS)


def test_traversal_on_separate_duplicate_paths():
    check("traversal", lambda draws: build_delayed(3, draws, merge=False), trials=EXTRA_TRIALS)


def test_traversal_refuses_an_uneven_split():
    draws = Draws(0)
    while True:  # a tree where two paths share their first token
        tree, contexts = build_delayed(3, draws, merge=True)
        if max(tree.extra["multiplicity"]) > 1:
            break
    shared = tree.extra["multiplicity"].index(max(tree.extra["multiplicity"]))
    tree.extra["multiplicity"][shared] += 1  # one more copy than its draws below can be dealt to
    with pytest.raises(VerificationError, match="cannot split"):
        make_verifier("traversal").walk(tree, Rows(contexts), PyRandom(0))


def test_block_equals_traversal_on_a_chain():
    """Same acceptance probabilities, node by node, on the same chain (Traversal reduces to block verification)."""
    class RejectAll(PyRandom):
        def uniform(self):
            return 1.0  # every test fails, so both rules report every node's acceptance probability

    draws = Draws(0)
    for _ in range(200):
        tree, contexts = build_tree((1, 1, 1), "iid", draws)
        block = make_verifier("block").walk(tree, Rows(contexts), RejectAll(0))
        traversal = make_verifier("traversal").walk(tree, Rows(contexts), RejectAll(0))
        assert block.accept_prob.keys() == traversal.accept_prob.keys() == {1, 2, 3}
        for node, a in block.accept_prob.items():
            assert math.isclose(a, traversal.accept_prob[node], abs_tol=1e-9)


# -- the harness can fail ----------------------------------------------------------------------------------------------
class AcceptEverything(TopDown):
    """Deliberately wrong: always takes the first child (what a buggy rule ignoring p would do)."""
    name = "accept_everything"

    def solve(self, tree, p, draws, rng, accept):
        return draws[0][0], tree.tokens[draws[0][0]], False


class ForgetResidual(TopDown):
    """Deliberately wrong: SpecInfer's rejections without the residual update (the bonus is drawn from p)."""
    name = "forget_residual"

    def solve(self, tree, p, draws, rng, accept):
        for child, q in draws:
            if rng.uniform() < min(1.0, float(p[tree.tokens[child]]) / float(q[tree.tokens[child]])):
                return child, tree.tokens[child], False
        return None, rng.choice(p), True


@pytest.mark.parametrize("wrong", [AcceptEverything, ForgetResidual])
def test_harness_detects_a_wrong_rule(wrong):
    counts, _ = emitted(wrong(), lambda draws: build_tree((2, 2), "iid", draws), trials=5000)
    assert chi_square_pvalue(counts, JOINT) < ALPHA  # caught with a quarter of the trials the real tests use


def test_rules_declare_modes_and_refuse_incompatible_trees():
    for name, cls in VERIFIERS.items():
        assert set(cls.child_modes) <= {"topk", "iid", "without_replacement"}, name
    tree, contexts = build_tree((2,), "topk", Draws(0))
    with pytest.raises(VerificationError, match="spectr"):
        make_verifier("spectr").check_tree(tree)
    with pytest.raises(VerificationError, match="single draft chain"):
        make_verifier("block").check_tree(tree)
    assert isinstance(make_verifier("traversal").walk(tree, Rows(contexts), PyRandom(0)), Verdict)


def test_khisti_selection_law_tensor_path_matches_floats():
    """Khisti's selection law r: the torch path (large vocabularies) equals the plain-float path, sums to 1, and
    matches the winner frequencies of simulated tournaments."""
    from engine.verify import khisti
    g = torch.Generator().manual_seed(0)
    for k in (1, 2, 3, 4):
        p, q = torch.rand(6, generator=g) ** 2, torch.rand(6, generator=g) ** 2
        p[2], q[4] = 0.0, 0.0
        p, q = p / p.sum(), q / q.sum()
        floats = khisti.selection_law(p, q, k)
        big = torch.cat([q, torch.zeros(khisti.SMALL)])  # past SMALL: the tensor path, same law on the support
        tensor = khisti.selection_law(torch.cat([p, torch.zeros(khisti.SMALL)]), big, k)[:6]
        assert torch.allclose(floats, tensor, atol=1e-6) and abs(float(floats.sum()) - 1) < 1e-5
        rnd, wins, n = PyRandom(k), np.zeros(6), 20_000
        w = (p / q).nan_to_num(0.0, posinf=0.0).tolist()
        for _ in range(n):
            champion = rnd.choice(q)
            for _ in range(k - 1):
                challenger = rnd.choice(q)
                if rnd.uniform() < khisti._beats(w[challenger], w[champion]):
                    champion = challenger
            wins[champion] += 1
        assert chi_square_pvalue(wins, floats.double().numpy()) > ALPHA
