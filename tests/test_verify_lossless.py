"""Losslessness end to end with the production random source, plus the rules' supporting pieces.

tests/test_verify_exact.py proves every rule exact by enumeration; here the same rules run as the decoder runs them:
real `delayed` trees drawn with torch.multinomial, and the rules drawing from `TorchRandom` (one seeded
torch.Generator). The chi-square tests use enough trials to see a 1 % shift in a token's probability (checked by
`test_chi_square_has_power_for_a_one_percent_shift`), on the issue's reproduction case where grouping merged draws
by first appearance made SpecInfer emit 0.44 instead of 0.63.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from chisq import chi_square_pvalue
from engine.core.tree import DraftTree
from engine.strategies import make_strategy
from engine.verify import VERIFIERS, Verdict, VerificationError, make_verifier
from engine.verify.base import TopDown, TorchRandom
from engine.verify.khisti import _beats, selection_law
from exact import ROOT_TOKEN, FakeDrafter, Rows, ToyModel, contexts_of, emitted_law, max_error, outcomes
from test_verify_exact import ISSUE_PQ, delayed, separate

TRIALS = 80_000  # a +-1 % shift between the two likely tokens is caught with power > 0.9 at ALPHA
ALPHA = 1e-3


def first_token_counts(rule, model: ToyModel, trials: int = TRIALS, seed: int = 0, **config) -> np.ndarray:
    """Emitted first tokens over seeded trials: a fresh delayed tree per trial, drawn and verified on the
    production path (torch.multinomial draws, TorchRandom for the rule)."""
    verifier = make_verifier(rule) if isinstance(rule, str) else rule
    strategy = make_strategy("delayed", "paper", temperature=1.0, **config)
    generator = torch.Generator().manual_seed(seed)
    drafter_rng, counts = TorchRandom(generator), np.zeros(model.vocab, dtype=np.int64)
    for _ in range(trials):
        tree = DraftTree(root_token=ROOT_TOKEN)
        drafter = FakeDrafter(model, tree)
        drafter.generator = generator
        strategy.build(drafter, tree)
        verdict = verifier.walk(tree, Rows(model, contexts_of(tree)), drafter_rng)
        counts[tree.tokens[verdict.path[1]] if len(verdict.path) > 1 else verdict.bonus] += 1
    return counts


@pytest.mark.parametrize("rule", ["specinfer", "spectr", "khisti", "naive_tree", "traversal"])
def test_merged_iid_draws_follow_the_target(rule):
    model = ToyModel(3, 0, first=ISSUE_PQ)
    counts = first_token_counts(rule, model, k=4, l1=0, l2=1)
    probs = model.p(())[:3].numpy()
    pvalue = chi_square_pvalue(counts, probs)
    assert pvalue > ALPHA, f"{rule}: {counts / counts.sum()} against {probs} (chi-square p = {pvalue:.2g})"


def test_without_replacement_draws_follow_the_target():
    model = ToyModel(3, 0, first=ISSUE_PQ)
    counts = first_token_counts("specinfer", model, k=3, l1=0, l2=1, without_replacement=True)
    assert chi_square_pvalue(counts, model.p(())[:3].numpy()) > ALPHA


def test_chi_square_has_power_for_a_one_percent_shift():
    """With TRIALS draws from p shifted by 0.01 between its two likely tokens, the test rejects in >= 90 % of
    seeded repetitions, and it accepts p itself in about 1 - ALPHA of them."""
    p = np.array(ISSUE_PQ[0])
    shifted = p + np.array([0.0, -0.01, 0.01])
    rng = np.random.default_rng(0)
    caught = np.mean([chi_square_pvalue(rng.multinomial(TRIALS, shifted), p) < ALPHA for _ in range(200)])
    false = np.mean([chi_square_pvalue(rng.multinomial(TRIALS, p), p) < ALPHA for _ in range(200)])
    assert caught >= 0.9 and false <= 0.02


def test_the_end_to_end_test_catches_the_grouped_order_bug():
    from test_verify_exact import GroupedSpecInfer
    model = ToyModel(3, 0, first=ISSUE_PQ)
    counts = first_token_counts(GroupedSpecInfer(), model, trials=5_000, k=4, l1=0, l2=1)
    assert chi_square_pvalue(counts, model.p(())[:3].numpy()) < ALPHA


# -- supporting pieces ------------------------------------------------------------------------------------------------
class RejectAll:
    """Every acceptance test fails (so rules report every node's acceptance probability); choices take the first
    token with mass."""

    def accept(self, probability):
        return False

    def choice(self, probs):
        return int(probs.nonzero()[0])


def test_block_equals_traversal_on_a_chain():
    """Same acceptance probabilities, node by node, on every chain (Traversal reduces to block verification)."""
    model = ToyModel(3, 2)
    for _, tree in outcomes(delayed(model, k=1, l1=0, l2=3)):
        rows = Rows(model, contexts_of(tree))
        block = make_verifier("block").walk(tree, rows, RejectAll())
        traversal = make_verifier("traversal").walk(tree, rows, RejectAll())
        assert block.accept_prob.keys() == traversal.accept_prob.keys() == {1, 2, 3}
        for node, a in block.accept_prob.items():
            assert math.isclose(a, traversal.accept_prob[node], abs_tol=1e-12)


def test_traversal_refuses_an_uneven_split():
    model = ToyModel(3, 0)
    tree = next(t for _, t in outcomes(delayed(model, k=3, l1=0, l2=2)) if len(t.children[0]) == 2)
    shared = max(tree.children[0], key=tree.multiplicity)  # a node two paths share
    tree.draws[shared] = tree.draw_order(shared)[:1]  # one draw below it for two copies
    with pytest.raises(VerificationError, match="cannot split"):
        make_verifier("traversal").walk(tree, Rows(model, contexts_of(tree)), RejectAll())


def test_rules_declare_modes_and_refuse_incompatible_trees():
    model = ToyModel(4, 0)
    for name, cls in VERIFIERS.items():
        assert set(cls.child_modes) <= {"topk", "iid", "without_replacement"}, name
    _, tree = next(outcomes(separate(model, (2,), "topk")))
    with pytest.raises(VerificationError, match="spectr"):
        make_verifier("spectr").check_tree(tree)
    with pytest.raises(VerificationError, match="single draft chain"):
        make_verifier("block").check_tree(tree)
    assert isinstance(make_verifier("traversal").walk(tree, Rows(model, contexts_of(tree)), RejectAll()), Verdict)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_khisti_selection_law_is_the_tournament_winners_law(k):
    """r, computed in closed form, equals the winner's law enumerated over every draw and every match."""
    model = ToyModel(4, k)
    p, q = model.p(()), model.q(())
    w = lambda t: float(p[t]) / float(q[t]) if q[t] > 0 else 0.0  # noqa: E731

    def tournament(rng):
        draws = rng.sample(q, k, True)
        champion = draws[0]
        for challenger in draws[1:]:
            if rng.accept(_beats(w(challenger), w(champion))):
                champion = challenger
        return champion

    law = torch.zeros_like(q)
    for weight, winner in outcomes(tournament):
        law[winner] += weight
    assert torch.allclose(selection_law(p, q, k), law, atol=1e-12)


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
            if rng.accept(min(1.0, float(p[tree.tokens[child]]) / float(q[tree.tokens[child]]))):
                return child, tree.tokens[child], False
        return None, rng.choice(p), True


@pytest.mark.parametrize("wrong", [AcceptEverything, ForgetResidual])
def test_exact_harness_detects_a_wrong_rule(wrong):
    model = ToyModel(3, 0)
    law, _ = emitted_law(wrong(), separate(model, (2, 2), "iid"), model, 3)
    assert max_error(law, model.joint(3)) > 1e-3
