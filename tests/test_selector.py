"""The delayed-tree neural selector (engine/strategies/selector.py, engine/training/selector_train.py): action space,
estimator, training, and decoding with it.

- every action is a legal delayed tree, and every choice the selector makes is one of them;
- Eq. 3's inner sum with Appendix D's branching probabilities equals, tree by tree, the exact expected committed
  length of the real SpecInfer / SpecTr walk, enumerated over every random outcome (tests/exact.py);
- trained on synthetic features whose best action is known, the selector learns it;
- decoding with a selector stays lossless (chi-square on the 8-token pair, as tests/test_sampling.py does for every
  strategy), is greedy-exact in fp32, records its choice, and leaves no hook on the models.
"""
import numpy as np
import pytest
import torch

from chisq import chi_square_pvalue
from exact import FakeDrafter, Rows, ToyModel, contexts_of, outcomes
from test_sampling import ALPHA, PROMPT, RUNS, SAMPLING, V, target_joint, tiny_v8_pair
from engine.core.sampling import Sampling
from engine.core.tree import DraftTree
from engine.decoder import Decoder
from engine.strategies import selector as neural
from engine.strategies import make_strategy
from engine.training import selector_train
from engine.verify import make_verifier


def test_every_action_is_a_legal_delayed_tree():
    assert len(neural.ACTIONS) == len(set(neural.ACTIONS)) == 84
    assert neural.BASELINE in neural.ACTIONS
    for k, l1, l2 in neural.ACTIONS:
        assert 1 <= k <= 4 and 0 <= l1 <= 4 and 0 <= l2 <= 4 and l1 + l2 >= 1
        make_strategy("delayed", k=k, l1=l1, l2=l2)  # refuses illegal shapes


def test_draft_rows_follow_delayed():
    assert neural.draft_rows((4, 2, 1)) == ([1, 1, 1], 7)
    assert neural.draft_rows((3, 0, 2), first_rows=5) == ([5, 3], 7)
    assert neural.draft_rows((2, 3, 3)) == ([1, 1, 1, 1, 2, 2], 10)


# -- the estimator against exact enumeration ------------------------------------------------------------------------
def action_tree(cover: selector_train.Cover, big: DraftTree, action) -> DraftTree:
    """The action's delayed tree as its own DraftTree (child draws in draw order, q as drawn)."""
    tree, ids = DraftTree(root_token=big.tokens[0]), {0: 0}
    draws = cover.draws(action)
    for node in sorted(draws, key=lambda n: big.depths[n]):
        tree.child_dist[ids[node]], tree.child_mode[ids[node]] = big.child_dist[node], "iid"
        for child in draws[node]:
            ids[child] = tree.add_draw(ids[node], big.tokens[child], float(big.child_dist[node][big.tokens[child]]))
    return tree


@pytest.mark.parametrize("rule", neural.RULES)
def test_estimator_equals_the_enumerated_walk(rule):
    model = ToyModel(vocab=3, seed=4)
    big = DraftTree(root_token=5)
    generator = torch.Generator().manual_seed(1)
    draw = lambda dist, count: torch.multinomial(dist.float(), count, True, generator=generator).tolist()  # noqa
    cover = selector_train.grow_cover(FakeDrafter(model, big), big, draw)
    p = Rows(model, contexts_of(big))
    q = big.child_dist
    verifier = make_verifier(rule)
    for action in [(1, 0, 1), (2, 1, 1), (3, 0, 2), (2, 2, 2), (4, 1, 2), (1, 3, 0), (1, 2, 3)]:
        estimate = selector_train.block_efficiency(rule, cover.draws(action), big.tokens, p, q)
        tree = action_tree(cover, big, action)
        rows = Rows(model, contexts_of(tree))
        exact = sum(w * len(path) for w, path in outcomes(lambda rng: verifier.walk(tree, rows, rng).path))
        assert estimate == pytest.approx(exact, abs=1e-9), f"{rule} {action}"


# -- training -------------------------------------------------------------------------------------------------------
def synthetic(n: int, seed: int, target_dim: int = 8, draft_dim: int = 6) -> dict:
    """The sign of one scalar feature decides which of two actions is by far the fastest; the rest are slow."""
    g = torch.Generator().manual_seed(seed)
    scalars = torch.randn(n, len(neural.SCALARS), generator=g)
    efficiency = torch.full((n, len(neural.ACTIONS)), 1.2)
    good = torch.where(scalars[:, 0] > 0, neural.ACTIONS.index((1, 4, 0)), neural.ACTIONS.index((4, 0, 1)))
    efficiency[torch.arange(n), good] = 4.0
    return {"target_hidden": torch.randn(n, target_dim, generator=g),
            "draft_hidden": torch.randn(n, draft_dim, generator=g),
            "scalars": scalars, "efficiency": efficiency, "seconds": torch.ones(n, len(neural.ACTIONS)),
            "good": good}


@pytest.fixture(scope="module")
def trained():
    return selector_train.train(synthetic(512, seed=0), epochs=60)


def test_selector_learns_the_known_optimum(trained):
    held = synthetic(256, seed=1)
    logits, efficiency = trained(held["target_hidden"], held["draft_hidden"], held["scalars"])
    assert (logits.argmax(-1) == held["good"]).float().mean() > 0.95
    report = selector_train.evaluate(trained, held)
    assert report["selector_tps"] > 1.4 * report["best_fixed_tps"]  # 4.0 against 2.6


def test_choices_are_legal_actions(trained):
    g = torch.Generator().manual_seed(2)
    seconds = torch.ones(len(neural.ACTIONS))
    for scale in (0.0, 1.0, 1e3):
        for _ in range(20):
            features = neural.RootFeatures(torch.randn(8, generator=g) * scale, torch.randn(6, generator=g) * scale,
                                           torch.randn(len(neural.SCALARS), generator=g) * scale)
            choice = trained.choose(features, seconds)
            assert (choice.k, choice.l1, choice.l2) in neural.ACTIONS
            assert choice.predicted_tokens_per_s >= 1.0  # E[tau + 1] >= 1 over one second
    with pytest.raises(neural.SelectorError, match="hidden sizes"):
        trained.choose(neural.RootFeatures(torch.zeros(9), torch.zeros(6), torch.zeros(len(neural.SCALARS))), None)


def test_weights_round_trip(trained, tmp_path):
    path = tmp_path / "s.safetensors"
    trained.save(path)
    loaded = neural.Selector.load(path)
    held = synthetic(16, seed=3)
    args = held["target_hidden"], held["draft_hidden"], held["scalars"]
    assert torch.equal(trained(*args)[0], loaded(*args)[0])


# -- decoding with a selector ---------------------------------------------------------------------------------------
def selector_for(pair, seed: int = 0) -> neural.Selector:
    """A selector for the pair's hidden sizes whose choice follows the entropy of q at the root (which changes with
    the sampled root), between a long chain and a wide bush: its shapes change from run to run."""
    n = 512
    data = synthetic(n, seed, pair.target.config.hidden_size, pair.draft.config.hidden_size)
    g = torch.Generator().manual_seed(seed)
    entropy = 2.1 * torch.rand(n, generator=g)  # an 8-token q has entropy in [0, log 8]
    data["scalars"][:, neural.SCALARS.index("entropy_q_root")] = entropy
    good = torch.where(entropy < 1.0, neural.ACTIONS.index((1, 4, 0)), neural.ACTIONS.index((4, 0, 2)))
    data["efficiency"] = torch.full_like(data["efficiency"], 1.2)
    data["efficiency"][torch.arange(n), good] = 4.0
    return selector_train.train(data, epochs=40, seed=seed)


def neural_delayed(pair, seed: int = 0):
    strategy = make_strategy("delayed", neural_selector=True, seed=seed)
    strategy.selector = selector_for(pair)
    return strategy


def test_decoding_with_the_selector_is_lossless():
    pair = tiny_v8_pair()
    net = selector_for(pair)
    counts, shapes = np.zeros(V * V, dtype=np.int64), set()
    for seed in range(RUNS):
        strategy = make_strategy("delayed", neural_selector=True, seed=seed)
        strategy.selector = net
        result = Decoder(pair, strategy, None, Sampling(**SAMPLING, seed=seed)).generate(
            PROMPT, max_new_tokens=2, stop_on_eos=False)
        out = result.output_ids
        counts[out[0] * V + out[1]] += 1
        shapes |= {(r.params["k"], r.params["l1"], r.params["l2"]) for r in result.iterations}
    assert len(shapes) > 1, "the selector never changed its choice: the test would not see a shape-dependent bias"
    pvalue = chi_square_pvalue(counts, target_joint(pair))
    assert pvalue > ALPHA, f"delayed with the neural selector: chi-square p = {pvalue:.2g}"


def test_greedy_exact_and_recorded(related_pair):
    reference = Decoder(related_pair, make_strategy("ar")).generate(
        "hello world", max_new_tokens=30, stop_on_eos=False).output_ids
    strategy = neural_delayed(related_pair)
    result = Decoder(related_pair, strategy, None, Sampling(temperature=0)).generate(
        "hello world", max_new_tokens=30, stop_on_eos=False)
    assert result.output_ids == reference
    for record in result.iterations:
        chosen = record.selector
        k, l1, l2 = record.params["k"], record.params["l1"], record.params["l2"]
        assert (chosen.k, chosen.l1, chosen.l2) == (k, l1, l2) and (k, l1, l2) in neural.ACTIONS
        assert record.drafted <= l1 + k * l2
        assert max(n.depth for n in record.nodes if n.status != "bonus") <= l1 + l2
    for model in (related_pair.target, related_pair.draft):  # the hooks are gone after the run
        assert not model.base_model.norm._forward_hooks


def test_selector_choices_do_not_touch_the_default_path(related_pair):
    """Without the selector no hook is installed and no feature is kept."""
    run = Decoder(related_pair, make_strategy("delayed"), None, Sampling(temperature=0.7)).run(
        "hello world", max_new_tokens=8)
    for record in run:
        assert not related_pair.target.base_model.norm._forward_hooks
        assert record.selector is None
    assert run.strategy.taps is None and not run.drafter.watchers


class _Tree:
    """The parts of a DraftTree that selector_data.compact reads: one expanded root with three children."""

    def __init__(self, q_root: torch.Tensor, children: list[int]):
        self.tokens = [0, *children]
        self.child_dist = {0: q_root}
        self.children = {0: [1, 2, 3], 1: [], 2: [], 3: []}

    def __len__(self):
        return len(self.tokens)


def test_compact_support_keeps_overlap_and_residual_mass_exact():
    from scripts import selector_data as script
    g = torch.Generator().manual_seed(0)
    vocab = 2000  # flat enough that most of the mass lies outside the kept top 16
    p_row = torch.softmax(torch.randn(vocab, generator=g), -1)
    q_row = torch.softmax(torch.randn(vocab, generator=g), -1)
    children = [int(q_row.argmax()), 7, 1999]
    tree = _Tree(q_row, children)
    p, q, tokens = script.compact(tree, torch.stack([p_row] * len(tree)), top=16)
    full = torch.minimum(p_row, q_row).double().sum()
    assert float(p[0].sum()) == pytest.approx(1.0) and float(q[0].sum()) == pytest.approx(1.0)
    assert float(torch.minimum(p[0], q[0]).sum()) == pytest.approx(float(full), abs=1e-9)
    assert float((p[0] - q[0]).clamp(min=0).sum()) == pytest.approx(float((p_row - q_row).clamp(min=0).sum()), abs=1e-6)
    for node, token in zip((1, 2, 3), children):
        assert float(p[0][tokens[node]]) == pytest.approx(float(p_row[token]))
        # SpecInfer's chance to emit the first draw is the same on the short support as on the vocabulary
        short = selector_train.branching("specinfer", p[0], q[0], [tokens[node]])[tokens[node]]
        whole = selector_train.branching("specinfer", p_row, q_row, [token])[token]
        assert short == pytest.approx(whole)
    lumped = float(torch.minimum(p[0][:-3], q[0][:-3]).sum() + min(p[0][-3:].sum(), q[0][-3:].sum()))
    assert lumped > float(full) + 0.05  # what one tail bucket would have claimed
