"""The paper strategies (DySpec, SALF, EAGLE-2 beam, DDTree, delayed expansion): exactness and the papers' claims.

Two kinds of draft: the tiny random models (greedy exactness, drafter bookkeeping), and a fake drafter whose
distributions are a fixed function of the path, so trees can be compared with brute-force enumeration.
"""
import itertools
import math
import random

import pytest
import torch

from engine.core.drafter import Drafter
from engine.core.sampling import Sampling
from engine.core.trace import BONUS, ROOT
from engine.core.tree import DraftTree
from engine.decoder import Decoder
from engine.models import tiny_random_pair
from engine.strategies import STRATEGIES, StrategyError, make_strategy
from engine.strategies.ddtree import best_first_prefixes
from engine.strategies.dyspec import dfs_order
from engine.verify import VerificationError, make_verifier

PAPER = ["dyspec", "salf", "eagle2", "ddtree", "delayed"]
PROMPTS = ["hello world", "def f(x):\n    return", "The quick brown fox jumps over"]
CONFIGS = [  # (name, params): every code path of every strategy
    ("dyspec", {}),
    ("dyspec", {"threshold_variant": False, "budget": 20, "max_depth": 5}),  # the exact heap greedy
    ("dyspec", {"threshold_variant": False, "budget": 12, "dfs_order": True}),
    ("salf", {}),
    ("salf", {"th": 0.0, "n": 16, "b": 4}),
    ("eagle2", {}),
    ("ddtree", {}),
    ("delayed", {}),
    ("delayed", {"greedy_trunk": True, "temperature": 0.5, "l1": 1, "l2": 3, "k": 4}),
    ("delayed", {"without_replacement": True, "k": 4}),
]


def limits(name, c):
    """(max drafted nodes, max depth) each strategy promises."""
    if name == "dyspec":
        return c["budget"], c["max_depth"]
    if name == "salf":  # nodes at max_depth are not expanded
        return c["n"], c["max_depth"]
    if name == "eagle2":  # depth counts expansion steps after the root's top-k
        return c["n"], c["depth"] + 1
    if name == "ddtree":
        return c["budget"], c["block"]
    return c["l1"] + c["k"] * c["l2"], c["l1"] + c["l2"]


def check_tree(tree: DraftTree):
    """Every field agrees with every other: prefix-closed, depths, path probabilities, children lists."""
    assert tree.is_prefix_closed()
    n = len(tree)
    for name in ("tokens", "parents", "depths", "q", "path_q", "ranks", "children"):
        assert len(getattr(tree, name)) == n, name
    for i in range(1, n):
        p = tree.parents[i]
        assert tree.depths[i] == tree.depths[p] + 1
        assert tree.path_q[i] == pytest.approx(tree.path_q[p] * tree.q[i], rel=1e-9)
        assert i in tree.children[p]
    assert sum(len(c) for c in tree.children) == n - 1
    assert all(0 <= k < n for k in (*tree.child_dist, *tree.child_mode))
    for node in range(n):  # siblings hold distinct tokens (duplicates are merged)
        tokens = [tree.tokens[c] for c in tree.children[node]]
        assert len(tokens) == len(set(tokens))


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models on a shared 2-core machine: one thread is several times faster than two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- greedy exactness on tiny random models, with per-iteration structural checks --------------------------------
@pytest.fixture(scope="module")
def pairs():
    return {"related0": tiny_random_pair("related", seed=0), "unrelated0": tiny_random_pair("unrelated", seed=0),
            "related5": tiny_random_pair("related", seed=5)}


@pytest.fixture(scope="module")
def references(pairs):
    cache = {}

    def ref(pair_name, prompt, n):
        if (pair_name, prompt, n) not in cache:
            run = Decoder(pairs[pair_name], make_strategy("ar")).generate(prompt, max_new_tokens=n, stop_on_eos=False)
            cache[pair_name, prompt, n] = run.output_ids
        return cache[pair_name, prompt, n]
    return ref


def checked(strategy, pair, stats):
    """Wrap build: check every tree and that the drafter expanded exactly the node rows it claims, and that the
    child distribution recorded at each expanded node is the draft's own distribution at that path."""
    build = strategy.build

    def wrapped(drafter, tree):
        build(drafter, tree)
        check_tree(tree)
        budget, depth = limits(strategy.name, strategy.current_params())
        assert tree.num_drafted <= budget and tree.max_depth <= depth
        assert set(drafter.rows) <= set(range(len(tree)))
        for node in drafter.rows:  # an expanded node's ancestors were expanded too
            assert all(a in drafter.rows for a in tree.path_to(node))
        if stats["checked"] < 3:  # a few fresh forwards: did ids, rows and distributions stay together?
            stats["checked"] += 1
            deepest = max(drafter.rows, key=lambda v: (tree.depths[v], v))
            for node in sorted({0, deepest, *list(drafter.rows)[1:3]}):
                ids = stats["committed"] + [tree.tokens[v] for v in tree.path_to(node)[1:]]
                with torch.inference_mode():
                    logits = pair.draft(input_ids=torch.tensor([ids]), logits_to_keep=1).logits[0, -1]
                dist = torch.softmax(logits.float(), -1)
                if tree.child_mode[node] == "iid":  # delayed: drawn at the draft temperature
                    dist = torch.softmax(dist.log() / strategy.settings.temperature, -1)
                torch.testing.assert_close(tree.child_dist[node], dist, atol=2e-5, rtol=1e-4)
        stats["trees"] += 1
        stats["forwards"] += drafter.forwards
    strategy.build = wrapped
    return strategy


@pytest.fixture
def record_committed(monkeypatch):
    stats = {"checked": 0, "trees": 0, "forwards": 0, "committed": []}
    begin = Drafter.begin

    def spy(self, tree, committed):
        stats["committed"] = list(committed)
        return begin(self, tree, committed)
    monkeypatch.setattr(Drafter, "begin", spy)
    return stats


@pytest.mark.parametrize("name,params", CONFIGS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CONFIGS)])
def test_greedy_exact_and_trees_valid(name, params, pairs, references, record_committed):
    cases = [("related0", PROMPTS[0]), ("unrelated0", PROMPTS[1]), ("related5", PROMPTS[2])]
    if (name, params) != next(c for c in CONFIGS if c[0] == name):
        cases = cases[::2]  # variants: the two related pairs; each strategy's first config: all three
    for pair_name, prompt in cases:
        pair = pairs[pair_name]
        record_committed["checked"] = 0
        strategy = checked(make_strategy(name, **params), pair, record_committed)
        result = Decoder(pair, strategy).generate(prompt, max_new_tokens=100, stop_on_eos=False)
        assert result.output_ids == references(pair_name, prompt, 100), f"{name} {params} diverged on {pair_name}"
        assert len(result.iterations) >= 5
    assert record_committed["trees"] > 20 and record_committed["checked"] == 3  # the last case checked 3 trees


# -- a fake drafter: distributions are a fixed function of the path ------------------------------------------------
V = 6


def path_dist(path: tuple[int, ...], peak: float = 3.0) -> torch.Tensor:
    rng = random.Random(repr(path))
    w = torch.tensor([rng.random() ** peak for _ in range(V)], dtype=torch.float64)
    return (w / w.sum()).float()


class FakeDrafter:
    """Enforces the Drafter protocol: root alone first, every node once, ancestors before (or with) a node."""
    generator = None  # the Drafter's: None when decoding greedily

    def __init__(self, tree, peak=3.0):
        self.tree, self.peak = tree, peak
        self.rows, self.forwards, self.batches = {}, 0, []

    def expand(self, nodes):
        tree = self.tree
        assert nodes and len(set(nodes)) == len(nodes)
        assert (0 in self.rows) or nodes == [0]
        for node in nodes:
            assert node not in self.rows, f"node {node} expanded twice"
            for a in tree.path_to(node)[:-1]:
                assert a in self.rows or a in nodes
        self.forwards += 1
        self.batches.append(len(nodes))
        out = []
        for node in nodes:
            self.rows[node] = len(self.rows)
            dist = path_dist(tuple(tree.tokens[v] for v in tree.path_to(node)[1:]), self.peak)
            tree.confidence[node] = float(dist.max())
            out.append(dist)
        return torch.stack(out)

    def remap(self, mapping):
        self.rows = {mapping[n]: r for n, r in self.rows.items() if n in mapping}


def fake_build(name, peak=3.0, **params):
    strategy = make_strategy(name, **params)
    tree = DraftTree(root_token=-1)
    drafter = FakeDrafter(tree, peak)
    strategy.build(drafter, tree)
    check_tree(tree)
    for node, dist in tree.child_dist.items():  # ids and recorded distributions still agree after renumbering
        if node in drafter.rows:
            assert torch.equal(dist, path_dist(tuple(tree.tokens[v] for v in tree.path_to(node)[1:]), peak))
    return strategy, tree, drafter


def nodes_above(cut, peak=3.0):
    """Brute force: the path probability of every node of the fake draft's (infinite) tree that is >= cut.
    Complete, because a node is never more probable than its parent."""
    out, stack = [], [((), 1.0)]
    while stack:
        path, pr = stack.pop()
        for token, q in enumerate(path_dist(path, peak).tolist()):
            if pr * q >= cut:
                out.append(pr * q)
                stack.append((path + (token,), pr * q))
    return out


def top_paths(n, peak=3.0):
    """The n highest path probabilities in the whole tree of the fake draft."""
    cut = 0.5
    while len(values := nodes_above(cut, peak)) < n:
        cut /= 2
    return sorted(values, reverse=True)[:n]


def test_salf_th0_is_the_optimal_top_n_tree():
    for n, b in [(20, 4), (30, 10), (12, 12), (25, 1)]:
        _, tree, drafter = fake_build("salf", n=n, b=b, th=0.0, max_depth=64)
        assert tree.num_drafted == n
        assert sorted(tree.path_q[1:], reverse=True) == pytest.approx(top_paths(n), rel=1e-12)
        assert max(drafter.batches[1:]) <= b


def test_salf_round_sums_fall_and_th_stops_early():
    for th in (0.0, 0.3, 0.6, 0.9):
        _, tree, drafter = fake_build("salf", n=40, b=5, th=th, max_depth=64)
        sums = tree.extra["salf_round_sums"]
        assert all(a >= b - 1e-12 for a, b in zip(sums, sums[1:])), sums  # Theorem 1
        assert len(sums) == drafter.forwards + 1  # one check per forward, plus the one that stopped
        if th > 0:
            assert sums[-1] < th <= sums[-2]
    # A higher threshold never costs more draft forwards.
    forwards = [fake_build("salf", n=40, b=5, th=th)[2].forwards for th in (0.0, 0.3, 0.6, 0.9)]
    assert forwards == sorted(forwards, reverse=True) and forwards[0] > forwards[-1]


def test_salf_round_sums_fall_on_a_real_draft(pairs):
    strategy = make_strategy("salf", n=24, b=6, th=0.0)
    build = strategy.build
    seen = []

    def spy(drafter, tree):
        build(drafter, tree)
        seen.append(list(tree.extra["salf_round_sums"]))
    strategy.build = spy
    for pair_name in ("related0", "unrelated0"):
        Decoder(pairs[pair_name], strategy).generate(PROMPTS[1], max_new_tokens=12, stop_on_eos=False)
    assert seen
    for sums in seen:
        assert all(a >= b - 1e-6 for a, b in zip(sums, sums[1:])), sums


def test_dyspec_greedy_pops_in_value_order_and_is_optimal():
    for budget, peak in [(5, 3.0), (20, 3.0), (40, 1.0), (40, 6.0)]:
        _, tree, drafter = fake_build("dyspec", peak, budget=budget, max_depth=64, threshold_variant=False)
        values = tree.extra["dyspec_values"]
        assert len(values) == tree.num_drafted == budget
        assert all(a >= b for a, b in zip(values, values[1:])), values
        # Each slot's value is the path probability of the node it added (ids follow the expansion order).
        assert [tree.path_q[v] for v in tree.extra["dyspec_order"]] == pytest.approx(values, rel=1e-12)
        # Greedy by P(reached) x acceptance with top-k children = the top-budget nodes by path probability.
        assert sorted(tree.path_q[1:], reverse=True) == pytest.approx(top_paths(budget, peak), rel=1e-12)
        assert drafter.forwards <= budget


def test_dyspec_batches_draft_forwards():
    # A flat draft makes every pending first child win the heap; expanding ahead keeps forwards near the depth.
    _, tree, drafter = fake_build("dyspec", 0.5, budget=30, max_depth=4, threshold_variant=False)
    assert drafter.forwards <= 6 < tree.num_drafted
    assert tree.max_depth <= 4


def test_dyspec_threshold_variant_and_dfs_order():
    _, tree, drafter = fake_build("dyspec", budget=1024, threshold_variant=True, threshold=0.01, max_depth=64)
    values = tree.extra["dyspec_values"]
    assert min(values) > 0.01 and len(values) == tree.num_drafted
    # With a budget that never binds, the threshold tree is every node worth more than the threshold.
    expected = sorted((v for v in nodes_above(0.01) if v > 0.01), reverse=True)
    assert sorted(tree.path_q[1:], reverse=True) == pytest.approx(expected, rel=1e-12)
    assert drafter.forwards == tree.max_depth + 1  # one per layer: the deepest layer's children all fell short
    plain = fake_build("dyspec", budget=15, threshold_variant=False, max_depth=8)[1]
    _, dfs, _ = fake_build("dyspec", budget=15, threshold_variant=False, max_depth=8, dfs_order=True)
    assert dfs_order(dfs) == list(range(len(dfs)))  # renumbered depth-first
    paths = lambda t: sorted(tuple(t.tokens[v] for v in t.path_to(i)) for i in range(len(t)))
    assert paths(dfs) == paths(plain) and dfs.tokens != plain.tokens


def test_eagle2_beam_then_rerank():
    # depth counts expansion steps after the root's top-k (EAGLE-2's code): depth 3 -> 4 layers, 4 draft forwards
    strategy, tree, drafter = fake_build("eagle2", n=20, k=3, depth=3)
    assert drafter.forwards == 4 and drafter.batches == [1, 3, 3, 3]
    assert tree.num_drafted == 20 and tree.max_depth <= 4
    # Rebuild the beam's candidate set independently and check the kept nodes are its top 20.
    layer, candidates = [((), 1.0)], []
    for step in range(4):
        children = []
        for path, pr in layer:
            probs, tokens = torch.topk(path_dist(path), 3)
            children += [(path + (t,), pr * p) for p, t in zip(probs.tolist(), tokens.tolist())]
        candidates += children
        layer = sorted(children, key=lambda c: -c[1])[:3]
    best = sorted((pr for _, pr in candidates), reverse=True)[:20]
    assert sorted(tree.path_q[1:], reverse=True) == pytest.approx(best, rel=1e-12)
    # All that the drafter expanded and kept still maps to the right node (checked in fake_build) and the
    # pruned candidates are gone from the tree's dicts.
    assert set(tree.child_dist) <= set(range(len(tree)))


def brute_force_prefixes(probs, budget):
    """All rank tuples to depth len(probs), by product probability, as the heap computes them (log-sum)."""
    scored = []
    for d in range(1, len(probs) + 1):
        for ranks in itertools.product(*(range(len(p)) for p in probs[:d])):
            scored.append(math.exp(sum(math.log(probs[i][r]) for i, r in enumerate(ranks))))
    return sorted(scored, reverse=True)[:budget]


def test_ddtree_best_first_equals_brute_force():
    rng = random.Random(7)
    for trial in range(30):
        depth, width = rng.randint(1, 4), rng.randint(1, 5)
        probs = []
        for _ in range(depth):
            w = sorted((rng.random() ** 2 for _ in range(width)), reverse=True)
            mass = rng.uniform(0.5, 1.0)  # a top-K slice of a larger vocabulary
            probs.append([x / sum(w) * mass for x in w])
        total = sum(width ** d for d in range(1, depth + 1))
        for budget in {1, 2, rng.randint(1, total), total, total + 3}:
            got = best_first_prefixes(probs, budget)
            scores = [math.prod(probs[i][r] for i, r in enumerate(t)) for t in got]
            assert len(got) == len(set(got)) == min(budget, total)
            assert scores == pytest.approx(brute_force_prefixes(probs, budget), rel=1e-9)
            assert all(a >= b * (1 - 1e-12) for a, b in zip(scores, scores[1:]))  # pop order
            assert all(t[:-1] in got[:i] for i, t in enumerate(got) if len(t) > 1)  # prefix-closed, parents first
    assert best_first_prefixes([[0.5, 0.5], [0.6, 0.4]], 0) == []


def test_ddtree_tree_is_the_top_prefixes_of_the_chain_marginals():
    for budget, block in [(16, 5), (40, 4), (3, 6)]:
        strategy, tree, drafter = fake_build("ddtree", budget=budget, block=block)
        # Recompute the chain's marginals directly from the fake draft.
        chain, probs = (), []
        for _ in range(drafter.forwards):
            p, t = torch.topk(path_dist(chain), V)
            probs.append(p.tolist())
            chain += (t[0].item(),)
        assert drafter.forwards <= block and drafter.batches == [1] * drafter.forwards
        assert sorted(tree.path_q[1:], reverse=True) == pytest.approx(brute_force_prefixes(probs, budget), rel=1e-6)
        assert tree.num_drafted == budget
        # Expanded nodes are exactly the chain nodes kept in the tree, under their new ids.
        for node in drafter.rows:
            assert all(tree.ranks[v] == 0 for v in tree.path_to(node)[1:])
        assert all(tree.path_q[v] >= tree.path_q[v + 1] * (1 - 1e-6) for v in range(1, len(tree) - 1))


def test_ddtree_stops_the_chain_when_no_deeper_prefix_can_win():
    # Flat draft, tiny budget: the B best prefixes are all shallow, so the chain stops after a forward or two.
    _, tree, drafter = fake_build("ddtree", peak=0.2, budget=4, block=8)
    assert drafter.forwards < 8 and tree.num_drafted == 4


def test_delayed_tree_shape_multiplicity_and_seed():
    for k, l1, l2 in [(4, 2, 3), (3, 0, 2), (1, 3, 1), (2, 2, 0)]:
        strategy, tree, drafter = fake_build("delayed", peak=0.5, k=k, l1=l1, l2=l2, seed=11)
        assert "multiplicity" not in tree.extra  # per-node data on the tree, not a leak into traces
        mult = [1] + [tree.multiplicity(v) for v in range(1, len(tree))]
        assert drafter.forwards == l1 + l2
        for d in range(1, l1 + 1):  # the trunk: one node per depth
            assert [mult[v] for v in range(len(tree)) if tree.depths[v] == d] == [1]
        for d in range(l1 + 1, l1 + l2 + 1):  # K paths at every branch depth, duplicates merged
            assert sum(mult[v] for v in range(len(tree)) if tree.depths[v] == d) == k
        for node in tree.child_mode:
            assert tree.child_mode[node] == "iid"
            draws = len(tree.draw_order(node))
            assert draws == sum(mult[c] for c in tree.children[node])
            d = tree.depths[node]
            assert draws == (1 if d < l1 else k if d == l1 else mult[node])  # m paths through: m draws
        assert tree.max_depth == l1 + l2
    again = fake_build("delayed", peak=0.5, k=4, l1=2, l2=3, seed=11)[1]
    other = [fake_build("delayed", peak=0.5, k=4, l1=2, l2=3, seed=s)[1].tokens for s in range(12, 16)]
    first = fake_build("delayed", peak=0.5, k=4, l1=2, l2=3, seed=11)[1]
    assert again.tokens == first.tokens and any(t != first.tokens for t in other)
    greedy = fake_build("delayed", k=2, l1=3, l2=1, greedy_trunk=True)[1]
    assert [greedy.ranks[v] for v in range(1, 4)] == [0, 0, 0] and greedy.child_mode[0] == "topk"


def test_delayed_without_replacement_draws_distinct_siblings(pairs):
    strategy = make_strategy("delayed", k=4, l1=1, l2=2, without_replacement=True)
    assert strategy.child_mode == "without_replacement"
    assert make_strategy("delayed").child_mode == "iid"
    with pytest.raises(VerificationError, match="without_replacement"):
        make_verifier("spectr").check_strategy(strategy)  # SpecTr's K-SEQ needs i.i.d. children
    with pytest.raises(VerificationError, match="topk"):  # a greedy trunk is deterministic, not i.i.d.
        make_verifier("spectr").check_strategy(make_strategy("delayed", greedy_trunk=True))
    make_verifier("spectr").check_strategy(make_strategy("delayed", greedy_trunk=True, l1=0))  # no trunk: fine
    result = Decoder(pairs["related0"], strategy).generate("hello world", max_new_tokens=30, stop_on_eos=False)
    for it in result.iterations:
        by_parent = {}
        for n in it.nodes:
            if n.status not in (ROOT, BONUS):
                by_parent.setdefault(n.parent, []).append(n.token)
        assert all(len(tokens) == len(set(tokens)) for tokens in by_parent.values())
        assert max(len(t) for t in by_parent.values()) > 1  # the branching point really branches


def test_delayed_samples_at_the_draft_temperature():
    # K draws at the root from q^(1/T): the empirical distribution over many runs matches it.
    counts = torch.zeros(V)
    strategy = make_strategy("delayed", k=16, l1=0, l2=1, temperature=0.5, seed=3)
    for _ in range(100):
        tree = DraftTree(root_token=-1)
        strategy.build(FakeDrafter(tree, peak=1.0), tree)
        for c in tree.children[0]:
            counts[tree.tokens[c]] += tree.multiplicity(c)
    expected = torch.softmax(path_dist((), 1.0).log() / 0.5, -1)
    assert torch.allclose(counts / counts.sum(), expected, atol=0.04)
    assert torch.allclose(tree.child_dist[0], expected)


# -- tree helpers and parameter validation ---------------------------------------------------------------------------
def test_reorder_prune_and_remap():
    tree = DraftTree(root_token=5)
    a = tree.add(0, 10, 0.5)
    b = tree.add(0, 11, 0.3, 1)
    c = tree.add(a, 12, 0.4)
    d = tree.add(b, 13, 0.9)
    tree.child_dist.update({0: "d0", a: "da", b: "db"})
    tree.confidence.update({0: 0.5, a: 0.4, b: 0.9})
    drafter = FakeDrafter(tree)
    drafter.rows = {0: 7, a: 8, b: 9}
    mapping = tree.prune({0, b, d})
    drafter.remap(mapping)
    assert mapping == {0: 0, b: 1, d: 2}
    assert tree.tokens == [5, 11, 13] and tree.parents == [-1, 0, 1] and tree.depths == [0, 1, 2]
    assert tree.path_q == pytest.approx([1.0, 0.3, 0.27]) and tree.children == [[1], [2], []]
    assert tree.child_dist == {0: "d0", 1: "db"} and tree.confidence == {0: 0.5, 1: 0.9}
    assert drafter.rows == {0: 7, 1: 9}
    with pytest.raises(ValueError):
        tree.prune({0, 2})  # drops the parent of a kept node
    with pytest.raises(ValueError):
        tree.reorder([0, 2, 1])  # child before parent
    tree.reorder([0, 1, 2])
    assert tree.tokens == [5, 11, 13]


@pytest.mark.parametrize("name,params,match", [
    ("salf", {"b": 20, "n": 10}, "B"),
    ("salf", {"th": 1.0}, "maximum"),
    ("delayed", {"l1": 0, "l2": 0}, "L1 \\+ L2"),
    ("dyspec", {"threshold_variant": True, "threshold": 1.0}, "threshold"),
    ("eagle2", {"k": 0}, "minimum"),
    ("ddtree", {"beam": 3}, "no parameter"),
])
def test_bad_parameters_are_refused_clearly(name, params, match):
    with pytest.raises(StrategyError, match=match):
        make_strategy(name, **params)


def test_registered_with_both_presets():
    for name in PAPER:
        cls = STRATEGIES[name]
        assert {"cpu", "paper"} <= set(cls.presets)
        for preset in ("cpu", "paper"):
            make_strategy(name, preset)
    assert STRATEGIES["delayed"].child_mode == "iid"
    assert make_strategy("salf", "paper").current_params() == {"n": 60, "b": 10, "th": 0.6, "max_depth": 64}
    assert make_strategy("eagle2", "paper").current_params() == {"n": 60, "k": 10, "depth": 7}


def dynatree_run(strategy, accepted_share: float, iterations: int) -> list[int]:
    """Build on the fake draft and report `accepted_share` of the tree's depth accepted, `iterations` times; D0 after
    each (build, then observe: the decoder's order)."""
    d0 = []
    for _ in range(iterations):
        tree = DraftTree(root_token=-1)
        strategy.build(FakeDrafter(tree), tree)
        strategy.observe(round(accepted_share * tree.max_depth), tree.num_drafted)
        d0.append(strategy.current_params()["d0"])
    return d0


def test_dynatree_history_moves_both_ways_and_comes_back():
    strategy = make_strategy("dynatree", "paper", budget=64, window=4)
    start = dict(strategy.state)
    up = dynatree_run(strategy, 1.0, 8)  # every offered path accepted whole: deeper, more nodes count as confident
    assert up[-1] == 7 and strategy.state["tau_h"] < start["tau_h"] and strategy.state["tau_l"] < start["tau_l"]
    assert up == sorted(up)
    down = dynatree_run(strategy, 0.0, 12)  # nothing accepted: shallower and wider
    assert down[-1] == 1 and down == sorted(down, reverse=True)
    assert strategy.state["tau_h"] > start["tau_h"] and strategy.state["tau_l"] > start["tau_l"]
    back = dynatree_run(strategy, 1.0, 12)
    assert back[-1] == 7
    assert strategy.state["tau_l"] <= strategy.state["tau_h"]


def test_dynatree_history_off_holds_the_configured_values():
    strategy = make_strategy("dynatree", "paper", budget=64, history=False)
    before = dict(strategy.state)
    dynatree_run(strategy, 0.0, 5)
    assert strategy.state == before


@pytest.mark.parametrize("pair_name,direction", [("identical", 1), ("unrelated", -1)])
def test_dynatree_history_on_real_pairs(pair_name, direction):
    """A draft equal to the target (accepts everything) makes DynaTree more aggressive; an unrelated one, less.
    At the paper's a* = 0.7: under the cpu preset's 0.9 one short first path (1 of 2) pulls D0 down before whole
    paths bring it back, and 40 tokens on the tiny pair end mid-way."""
    pair = tiny_random_pair(pair_name, seed=0, dtype=torch.float32)
    strategy = make_strategy("dynatree", window=4, a_star=0.7)
    start = strategy.current_params()
    result = Decoder(pair, strategy).generate("hello world", max_new_tokens=40, stop_on_eos=False)
    last = result.iterations[-1].params
    assert direction * (last["d0"] - start["d0"]) > 0
    assert direction * (last["tau_h"] - start["tau_h"]) < 0


class TopTwoDrafter(FakeDrafter):
    """The fake draft under a sampling cut (as top-k = 2 or a small top-p leaves it): all but two tokens have q = 0."""

    def expand(self, nodes):
        dists = super().expand(nodes)
        cut = dists < dists.topk(2, dim=-1).values[:, -1:]
        return torch.where(cut, 0.0, dists) / torch.where(cut, 0.0, dists).sum(-1, keepdim=True)


@pytest.mark.parametrize("name,params", [("eagle2", {"k": 4, "n": 30, "depth": 3}), ("fixed", {"branch": 4}),
                                         ("dynatree", {"b_max": 4, "tau": 0.0}), ("salf", {"th": 0.0}),
                                         ("dyspec", {"threshold_variant": False}), ("ddtree", {}),
                                         ("dyspec", {"threshold": 0.0})])
def test_no_child_with_zero_draft_probability(name, params):
    strategy = make_strategy(name, **params)
    tree = DraftTree(root_token=-1)
    strategy.build(TopTwoDrafter(tree), tree)
    assert tree.num_drafted > 2 and all(q > 0.0 for q in tree.q[1:])
    assert max(len(c) for c in tree.children) == 2  # the two tokens with q > 0 were drafted, nothing else


def test_eagle2_under_top_p_drafts_no_zero_probability_node(pairs):
    """The audit's case, on the production path: EAGLE-2 at T = 0.7, top-p 0.5 drafted nodes with q = 0."""
    sampling = Sampling(temperature=0.7, top_p=0.5, seed=0)
    result = Decoder(pairs["related0"], make_strategy("eagle2", "paper"), sampling=sampling).generate(
        "hello world", max_new_tokens=20, stop_on_eos=False)
    drafted = [n for it in result.iterations for n in it.nodes if n.status not in (ROOT, BONUS)]
    assert drafted and all(n.q > 0.0 for n in drafted)


def test_delayed_records_carry_draw_counts(pairs):
    """Merged duplicates reach the trace as per-node data (NodeRecord.draws), not as a strategy extra."""
    strategy = make_strategy("delayed", k=4, l1=1, l2=1)
    result = Decoder(pairs["related0"], strategy).generate("hello world", max_new_tokens=20, stop_on_eos=False)
    for it in result.iterations:
        assert "multiplicity" not in it.extra
        branch = [n for n in it.nodes if n.depth == 2 and n.status != BONUS]
        assert sum(n.draws for n in branch) == 4 and all(n.draws == 1 for n in it.nodes if n.depth == 1)
    assert any(n.draws > 1 for it in result.iterations for n in it.nodes)
