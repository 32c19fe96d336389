"""Context lookup (engine/core/lookup.py, engine/strategies/lookup.py): the index against brute-force search, the trie
builder, the strategy, exact losslessness proofs of the rules that accept lookup trees, and the refusals."""
from __future__ import annotations

import random

import pytest
import torch

import engine.core.lookup as lookup
from engine.core.lookup import LookupIndex, build_lookup_tree
from engine.core.prompts import PROMPT_SETS, load_prompt_set
from engine.core.sampling import Sampling
from engine.core.tree import DraftTree
from engine.decoder import Decoder
from engine.models import tiny_random_pair
from engine.strategies import STRATEGIES, StrategyError, make_strategy
from engine.strategies.base import RunHooks
from engine.verify import VERIFIERS, VerificationError, compatible_verifiers, make_verifier
from exact import ROOT_TOKEN, WIDTH, ToyModel, emitted_law, max_error, outcomes

TOL = 1e-9
SAMPLING_RULES = [name for name, cls in VERIFIERS.items() if not cls.greedy_only]
TREE_RULES = {"greedy", "token_matching", "nss", "naive_tree", "specinfer", "traversal"}  # accept lookup trees
CHAIN_RULES = TREE_RULES | {"naive", "block"}  # ... and on a single chain


# -- the index against brute force ----------------------------------------------------------------------------------
def brute_continuations(stream, tail, lo, hi, max_continuations, max_len, scan):
    """The spec, by scanning every position: longest match first; per match length, the most recent `scan`
    occurrences; distinct continuations by count, then recency; support = count / occurrences."""
    seq, n = stream + tail, len(stream)
    out, seen = [], set()
    for k in range(min(hi, len(seq)), lo - 1, -1):
        ends = [e for e in range(k, n) if stream[e - k:e] == seq[len(seq) - k:]][-scan:]
        stats = {}
        for e in ends:
            cont = tuple(stream[e:e + max_len])
            count, _ = stats.get(cont, (0, 0))
            stats[cont] = (count + 1, e)
        for cont, (count, last) in sorted(stats.items(), key=lambda kv: (-kv[1][0], -kv[1][1])):
            if cont not in seen and len(out) < max_continuations:
                seen.add(cont)
                out.append((list(cont), count / len(ends)))
    return out


@pytest.mark.parametrize("scan", [256, 3])
@pytest.mark.parametrize("seed", range(6))
def test_index_matches_brute_force_while_extended(seed, scan, monkeypatch):
    monkeypatch.setattr(lookup, "SCAN", scan)
    rng = random.Random(seed)
    lo = rng.randint(1, 3)
    hi = lo + rng.randint(0, 4)
    index, stream = LookupIndex(lo, hi), []
    for _ in range(60):
        chunk = [rng.randrange(3 + seed % 3) for _ in range(rng.randint(0, 5))]  # tiny vocabularies: many matches
        index.extend(chunk)
        stream += chunk
        assert index.tokens == stream
        tail = [rng.randrange(3) for _ in range(rng.choice([0, 0, 1, 3]))]
        conts, length = rng.randint(1, 6), rng.randint(1, 7)
        expected = brute_continuations(stream, tail, lo, hi, conts, length, scan)
        got = index.continuations(conts, length, tail)
        assert [c for c, _ in got] == [c for c, _ in expected]
        assert [s for _, s in got] == pytest.approx([s for _, s in expected])


def test_index_ranks_by_frequency_then_recency_longest_match_first():
    index = LookupIndex(1, 3)
    index.extend([7, 1, 2, 9, 7, 1, 2, 8, 4, 2, 5, 4, 2, 5, 1, 2])
    # "1 2" (order 2) is followed by 9 then 8: same count, the later (8) first; "2" alone adds 5 (twice) after them
    assert index.continuations(4, 1) == [([8], 0.5), ([9], 0.5), ([5], 0.5)]
    assert index.last_match == 2
    assert LookupIndex(2, 4).continuations(3, 3) == [] and LookupIndex(3, 4).last_match == 0
    with pytest.raises(ValueError):
        LookupIndex(3, 2)


# -- the trie builder -----------------------------------------------------------------------------------------------
def index_of(stream, lo=1, hi=4):
    index = LookupIndex(lo, hi)
    index.extend(stream)
    return index


STREAM = [9, 1, 2, 3, 9, 1, 2, 4, 9, 1, 5, 6, 9, 7, 8, 9]  # after the root 9: 1 2 3 | 1 2 4 | 1 5 6 | 7 8 9


def paths(tree):
    return {tuple(tree.tokens[v] for v in tree.path_to(node)[1:]) for node in range(1, len(tree))}


def test_trie_merges_shared_prefixes_and_records_support():
    tree, index = DraftTree(root_token=9), index_of(STREAM)
    added = build_lookup_tree(tree, index, budget=100, max_continuations=4, max_len=3, vocab_size=10)
    assert len(added) == tree.num_drafted == 9  # 4 continuations of 3 tokens, the three starting with 1 merged
    assert paths(tree) == {(1,), (1, 2), (1, 2, 3), (1, 2, 4), (1, 5), (1, 5, 6), (7,), (7, 8), (7, 8, 9)}
    for node in range(len(tree)):  # a trie: siblings never share a token
        tokens = [tree.tokens[c] for c in tree.children[node]]
        assert len(tokens) == len(set(tokens))
    one = tree.child_with_token(0, 1)
    assert tree.q[one] == pytest.approx(0.75) and tree.q[tree.child_with_token(0, 7)] == pytest.approx(0.25)
    assert tree.q[tree.child_with_token(one, 2)] == pytest.approx(2 / 3)
    assert sum(tree.q[c] for c in tree.children[one]) == pytest.approx(1.0)
    assert all(tree.child_mode[v] == "topk" for v in range(len(tree)) if tree.children[v])
    for node, dist in tree.child_dist.items():  # the support as a distribution over the vocabulary, for display
        assert dist.shape == (10,) and float(dist.sum()) == pytest.approx(1.0)
        assert [float(dist[tree.tokens[c]]) for c in tree.children[node]] == pytest.approx(
            [tree.q[c] for c in tree.children[node]])
    assert tree.source == ["root"] + ["lookup"] * 9
    assert index.last_match == 1  # the match behind the answer (the strategy reports it in tree.lookup)


def test_lone_chain_is_a_point_mass():
    tree = DraftTree(root_token=9)
    build_lookup_tree(tree, index_of(STREAM), budget=100, max_continuations=1, max_len=3, vocab_size=10)
    assert tree.parents == [-1, 0, 1, 2] and tree.q == [1.0] * 4 and tree.path_q == [1.0] * 4
    assert all(torch.equal(tree.child_dist[v], torch.eye(10)[tree.tokens[v + 1]]) for v in range(3))


@pytest.mark.parametrize("budget", [0, 1, 2, 5, 8])
def test_budget_is_respected_best_continuations_first(budget):
    tree = DraftTree(root_token=9)
    added = build_lookup_tree(tree, index_of(STREAM), budget=budget, max_continuations=4, max_len=3)
    assert len(added) == tree.num_drafted == budget
    full = [(7,), (7, 8), (7, 8, 9), (1,), (1, 5), (1, 5, 6), (1, 2), (1, 2, 4)]  # rank order: the latest first
    assert paths(tree) == set(full[:budget])
    assert not tree.child_dist  # no width given and none in the tree: only the greedy rule can check it


def test_merges_into_model_nodes_and_marks_them_both():
    tree = DraftTree(root_token=9)
    dist = torch.tensor([0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.0])
    tree.child_dist[0], tree.child_mode[0] = dist, "topk"
    one, eight = tree.add(0, 1, 0.5), tree.add(0, 8, 0.5)
    added = build_lookup_tree(tree, index_of(STREAM), budget=100, max_continuations=4, max_len=2)
    assert tree.source[one] == "both" and tree.source[eight] == "model"
    seven = tree.child_with_token(0, 7)
    assert tree.source[seven] == "lookup" and tree.q[seven] == 0.0  # beside model children: the model's q shown
    assert sorted(tree.tokens[v] for v in added) == [2, 5, 7, 8]  # 12, 15, 7, 78 (1 reused)
    assert torch.equal(tree.child_dist[0], dist)  # the model's distribution is kept
    mapping = tree.reorder([0, seven, one, eight] + [v for v in range(1, len(tree)) if v not in (one, eight, seven)])
    assert tree.source[mapping[one]] == "both" and tree.source[mapping[seven]] == "lookup"


def test_never_beside_sampled_siblings_but_through_them():
    tree = DraftTree(root_token=9)
    tree.child_dist[0], tree.child_mode[0] = torch.full((10,), 0.1), "iid"
    one = tree.add_draw(0, 1, 0.1)
    tree.add_draw(0, 3, 0.1)
    build_lookup_tree(tree, index_of(STREAM), budget=100, max_continuations=4, max_len=3, vocab_size=10)
    assert [tree.tokens[c] for c in tree.children[0]] == [1, 3]  # no deterministic 7 among the i.i.d. draws
    assert tree.source[one] == "both" and {tree.tokens[c] for c in tree.children[one]} == {2, 5}
    assert tree.child_mode[one] == "topk" and tree.child_mode[0] == "iid"


def test_grafted_under_a_node_uses_its_path_as_context():
    tree = DraftTree(root_token=9)
    tree.child_dist[0], tree.child_mode[0] = torch.full((10,), 0.1), "topk"
    one = tree.add(0, 1, 0.1)
    build_lookup_tree(tree, index_of(STREAM), budget=100, max_continuations=4, max_len=2, under=one)
    # context "... 9 1": continuations 2 3, 2 4, 5 6 (order-2 match "9 1")
    assert paths(tree) == {(1,), (1, 2), (1, 2, 3), (1, 2, 4), (1, 5), (1, 5, 6)}
    with pytest.raises(ValueError, match="root"):
        build_lookup_tree(DraftTree(root_token=4), index_of(STREAM), 4, 1, 1)


# -- the strategy ---------------------------------------------------------------------------------------------------
def reads_context(strategy) -> bool:
    """Whether the strategy overrides the run's `before_build` hook (it sees the committed tokens before each tree)."""
    return type(strategy).before_build is not RunHooks.before_build


def test_strategy_params_presets_and_refusals():
    assert STRATEGIES["lookup"].uses_draft is False and reads_context(STRATEGIES["lookup"]("cpu"))
    for preset in ("cpu", "paper", "auto"):
        make_strategy("lookup", preset)
    with pytest.raises(StrategyError, match="min_match"):
        make_strategy("lookup", min_match=5, max_match=3)
    assert not reads_context(STRATEGIES["fixed"]("cpu"))  # the base default


def test_strategy_sees_context_incrementally_and_builds_without_a_drafter():
    strategy = make_strategy("lookup", max_continuations=2, max_len=3, min_match=1)
    strategy.before_build(STREAM[:8], None)
    index = strategy.index
    strategy.before_build(STREAM, 10)
    assert strategy.index is index and index.tokens == STREAM  # extended, not rebuilt
    tree = DraftTree(root_token=STREAM[-1])
    strategy.build(None, tree)
    assert paths(tree) == {(7,), (7, 8), (7, 8, 9), (1,), (1, 5), (1, 5, 6)} and tree.child_dist[0].shape == (10,)
    strategy.before_build([5, 6, 5], None)  # another context: rebuilt
    assert strategy.index is not index and strategy.index.tokens == [5, 6, 5]


def test_which_rules_accept_lookup_and_which_refuse():
    tree_strategy, chain_strategy = make_strategy("lookup"), make_strategy("lookup", "paper")
    assert set(compatible_verifiers(tree_strategy)) == TREE_RULES
    assert set(compatible_verifiers(chain_strategy)) == CHAIN_RULES
    for rule in ("spectr", "khisti"):  # i.i.d. draws only
        with pytest.raises(VerificationError, match="topk"):
            make_verifier(rule).check_strategy(chain_strategy)
    with pytest.raises(VerificationError, match="chain"):
        make_verifier("block").check_strategy(tree_strategy)
    pair = tiny_random_pair(None)
    with pytest.raises(VerificationError):
        Decoder(pair, tree_strategy, make_verifier("spectr"), Sampling(temperature=0.8))


# -- exact losslessness at T > 0 -----------------------------------------------------------------------------------
R = ROOT_TOKEN  # the toy model's contexts start after the root; the root token itself is never drawn
CONTEXT = [R, 0, 1, R, 0, 2, R, 1, 0, R, 2, 2, R]  # after R: 0 1 | 0 2 | 1 0 | 2 2


def lookup_only(max_continuations: int, max_len: int):
    """The real strategy on a fixed context: a deterministic tree (no random draws)."""
    def build(rng):
        strategy = make_strategy("lookup", min_match=1, max_match=2, max_continuations=max_continuations,
                                 max_len=max_len)
        strategy.before_build(CONTEXT, WIDTH)
        tree = DraftTree(root_token=R)
        strategy.build(None, tree)
        return tree
    return build


def mixed(model: ToyModel, k: int, sampled_below: int = 0):
    """The draft model's top-k children of the root, a lookup trie merged beside them (and through them), and
    optionally `sampled_below` i.i.d. draws from q under the first lookup-only leaf."""
    def build(rng):
        tree = DraftTree(root_token=R)
        q = model.q(())
        tree.child_dist[0], tree.child_mode[0] = q, "topk"
        for t in [t for t in torch.argsort(q, descending=True, stable=True).tolist() if q[t] > 0][:k]:
            tree.add(0, t, float(q[t]))
        build_lookup_tree(tree, index_of(CONTEXT, 1, 2), budget=6, max_continuations=3, max_len=2)
        if sampled_below:
            leaf = next(v for v in range(len(tree)) if tree.source[v] == "lookup" and not tree.children[v])
            context = tuple(tree.tokens[v] for v in tree.path_to(leaf)[1:])
            tree.child_dist[leaf], tree.child_mode[leaf] = model.q(context), "iid"
            for t in rng.sample(model.q(context), sampled_below, True):
                tree.add(leaf, t, float(model.q(context)[t]))
        return tree
    return build


def grafted(model: ToyModel, k: int, continuations: int = 2, room: int = 6):
    """The draft model's top-k children of the root, the best of them expanded with every child pruned (DynaTree's
    tau: a model distribution, no children), with lookup grafted by the real switch (engine/strategies/graft.py):
    continuations under the root (through the model's nodes), then below the model's best leaf."""
    def build(rng):
        tree = DraftTree(root_token=R)
        q = model.q(())
        tree.child_dist[0], tree.child_mode[0] = q, "topk"
        for t in [t for t in torch.argsort(q, descending=True, stable=True).tolist() if q[t] > 0][:k]:
            tree.add(0, t, float(q[t]))
        best = tree.children[0][0]
        tree.child_dist[best], tree.child_mode[best] = model.q((tree.tokens[best],)), "topk"
        strategy = make_strategy("dynatree", lookup=True, lookup_min_match=1, lookup_continuations=continuations)
        strategy.before_build(CONTEXT, WIDTH)
        strategy.graft(tree, room=room)
        return tree
    return build


SHAPES = [  # (id, builder factory, vocabulary, emitted tokens compared, rules expected to accept)
    ("lookup-chain", lambda m: lookup_only(1, 3), 3, 4, CHAIN_RULES - {"greedy"}),
    ("lookup-trie", lambda m: lookup_only(4, 2), 3, 3, TREE_RULES - {"greedy"}),
    ("mixed-top1", lambda m: mixed(m, 1), 3, 3, TREE_RULES - {"greedy"}),
    ("mixed-top2", lambda m: mixed(m, 2), 3, 3, TREE_RULES - {"greedy"}),
    ("mixed-iid-below", lambda m: mixed(m, 1, sampled_below=2), 3, 4, TREE_RULES - {"greedy"}),
    ("grafted-top1", lambda m: grafted(m, 1), 3, 4, TREE_RULES - {"greedy"}),
    ("grafted-top2", lambda m: grafted(m, 2), 3, 3, TREE_RULES - {"greedy"}),
    ("grafted-leaf", lambda m: grafted(m, 2, continuations=1, room=9), 3, 4, TREE_RULES - {"greedy"}),
]


def accepts(rule: str, build) -> bool:
    _, tree = next(outcomes(build))
    try:
        make_verifier(rule).check_tree(tree)
    except VerificationError:
        return False
    return True


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("shape", [s[0] for s in SHAPES])
def test_accepting_rules_are_exactly_lossless_and_the_others_refuse(shape, seed):
    _, factory, vocab, length, expected = next(s for s in SHAPES if s[0] == shape)
    model = ToyModel(vocab, seed)
    build = factory(model)
    assert {rule for rule in SAMPLING_RULES if accepts(rule, build)} == expected
    for rule in sorted(expected):
        law, _ = emitted_law(make_verifier(rule), build, model, length)
        assert max_error(law, model.joint(length)) < TOL, f"{rule} on {shape} (seed {seed}) is not lossless"


def test_mixed_shapes_hold_model_lookup_and_both_nodes():
    """The proofs above cover what they claim: lookup siblings beside model siblings, merged nodes, and lookup
    children that the walk can accept."""
    for seed in (0, 1):
        model = ToyModel(3, seed)
        _, tree = next(outcomes(mixed(model, 1)))
        root_sources = {tree.source[c] for c in tree.children[0]}
        assert "lookup" in root_sources and root_sources & {"model", "both"}
        _, deeper = emitted_law(make_verifier("specinfer"), mixed(model, 2), model, 3)
        assert deeper > 0.3  # the walk goes below the root often: lookup nodes are reached, not just present


def test_harness_catches_a_lookup_child_mislabelled_as_a_draw_from_q():
    """A lookup child recorded as an i.i.d. draw from the draft's q (what a careless graft would do) is biased:
    the enumeration sees it, so the proofs above could fail."""
    model = ToyModel(3, 0)

    def build(rng):
        tree = lookup_only(1, 1)(rng)
        tree.child_dist[0], tree.child_mode[0] = model.q(()), "iid"
        return tree
    law, _ = emitted_law(make_verifier("specinfer"), build, model, 1)
    assert max_error(law, model.joint(1)) > 1e-3


# -- end to end: the decoder feeds the context -------------------------------------------------------------------
PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"


@pytest.mark.parametrize("kind", [None, "related"])
def test_lookup_decodes_exactly_like_ar(kind):
    pair = tiny_random_pair(kind, seed=0, dtype=torch.float32)
    reference = Decoder(pair, make_strategy("ar")).generate(PROMPT, max_new_tokens=60, stop_on_eos=False)
    for preset in ("cpu", "paper"):
        result = Decoder(pair, make_strategy("lookup", preset)).generate(PROMPT, max_new_tokens=60,
                                                                         stop_on_eos=False)
        assert result.output_ids == reference.output_ids, preset
        assert sum(it.drafted for it in result.iterations) > 0  # the repeated prompt gives lookup something
    sampled = Decoder(pair, make_strategy("lookup"), make_verifier("specinfer"), Sampling(temperature=0.8, seed=0))
    assert len(sampled.generate(PROMPT, max_new_tokens=20, stop_on_eos=False).output_ids) == 20


# -- the transformers peer and the prompt set ----------------------------------------------------------------------
def test_hf_prompt_lookup_matches_ar():
    from engine.bench.peers import hf_prompt_lookup
    pair = tiny_random_pair(None, seed=0, dtype=torch.float32)
    reference = Decoder(pair, make_strategy("ar")).generate(PROMPT, max_new_tokens=40, stop_on_eos=False)
    out = hf_prompt_lookup(pair, PROMPT, 40, num_tokens=5, stop_on_eos=False)
    assert out["output_ids"] == reference.output_ids and out["new_tokens"] == 40 and out["total_s"] > 0


def test_grounded_prompts_load_by_name_outside_all():
    entries = load_prompt_set("grounded")
    assert len(entries) == 8 and {e["kind"] for e in entries} == {"grounded"}
    assert len({e["name"] for e in entries}) == 8 and all(isinstance(e["prompt"], str) for e in entries)
    assert "grounded" not in PROMPT_SETS and len(load_prompt_set("all")) == 24


# -- lookup grafted onto the model strategies ----------------------------------------------------------------------
GRAFTED = ["dynatree", "dyspec", "ddtree"]


@pytest.mark.parametrize("name", GRAFTED)
def test_grafted_strategy_decodes_exactly_like_ar_within_the_budget(name):
    pair = tiny_random_pair("related", seed=0, dtype=torch.float32)
    reference = Decoder(pair, make_strategy("ar")).generate(PROMPT, max_new_tokens=40, stop_on_eos=False)
    strategy = make_strategy(name, lookup=True, lookup_budget=4, lookup_min_match=1)
    assert reads_context(strategy) and strategy.child_modes_used == ("topk",)
    assert not reads_context(make_strategy(name))  # off by default
    result = Decoder(pair, strategy).generate(PROMPT, max_new_tokens=40, stop_on_eos=False)
    assert result.output_ids == reference.output_ids
    budget = strategy.settings.budget
    model_budget = budget - min(4, budget // 2)  # the lookup reservation comes out of the budget
    for it in result.iterations:
        assert it.drafted <= budget
        assert sum(n.source in ("model", "both") for n in it.nodes) <= model_budget
    sources = {node.source for it in result.iterations for node in it.nodes if node.status != "bonus"}
    assert {"root", "model"} <= sources and sources & {"lookup", "both"}
    by_source = result.metrics.acceptance_by_source
    assert sum(s.drafted for s in by_source.values()) == sum(it.drafted for it in result.iterations)


@pytest.mark.parametrize("name", GRAFTED)
def test_grafted_strategy_samples_with_its_default_rule(name):
    pair = tiny_random_pair("related", seed=0, dtype=torch.float32)
    strategy = make_strategy(name, lookup=True, lookup_min_match=1)
    decoder = Decoder(pair, strategy, sampling=Sampling(temperature=0.8, seed=0))
    assert decoder.verifier.name in TREE_RULES
    first = decoder.generate(PROMPT, max_new_tokens=16, stop_on_eos=False)
    again = Decoder(pair, make_strategy(name, lookup=True, lookup_min_match=1),
                    sampling=Sampling(temperature=0.8, seed=0)).generate(PROMPT, max_new_tokens=16, stop_on_eos=False)
    assert len(first.output_ids) == 16 and first.output_ids == again.output_ids  # seeded: reproducible
    for rule in ("spectr", "khisti"):  # i.i.d. rules refuse the grafted (deterministic) children
        with pytest.raises(VerificationError):
            Decoder(pair, make_strategy(name, lookup=True), make_verifier(rule), Sampling(temperature=0.8))


def test_graft_attaches_under_the_root_and_below_the_best_leaf():
    strategy = make_strategy("dynatree", lookup=True, lookup_min_match=1, lookup_continuations=1)
    strategy.before_build(STREAM, 10)
    tree = DraftTree(root_token=9)
    tree.child_dist[0], tree.child_mode[0] = torch.full((10,), 0.1), "topk"
    one, three = tree.add(0, 1, 0.6), tree.add(0, 3, 0.3)
    added = strategy.graft(tree, room=20)
    # under the root: the latest continuation of "9" (7 8 9); below the best leaf "1": that of "9 1" (5 6 9 7 8 9)
    assert paths(tree) == {(1,), (3,), (7,), (7, 8), (7, 8, 9), (1, 5), (1, 5, 6), (1, 5, 6, 9), (1, 5, 6, 9, 7),
                           (1, 5, 6, 9, 7, 8), (1, 5, 6, 9, 7, 8, 9)}
    assert len(added) == 9 and all(tree.source[v] == "lookup" for v in added)
    assert tree.source[one] == tree.source[three] == "model" and tree.child_mode[one] == "topk"
    assert tree.lookup.match == 1 and tree.lookup.match_leaf == 2
    small = DraftTree(root_token=9)
    assert len(strategy.graft(small, room=2)) == 2  # the room is a hard cap
    assert strategy.graft(DraftTree(root_token=9), room=0) == []


def test_sources_survive_a_trace_round_trip_and_older_traces_read_as_model():
    from engine.core.trace import SCHEMA_VERSION, run_from_dict
    pair = tiny_random_pair(None, seed=0, dtype=torch.float32)
    result = Decoder(pair, make_strategy("lookup", min_match=1)).generate(PROMPT, max_new_tokens=12,
                                                                           stop_on_eos=False)
    sources = [[n.source for n in it.nodes] for it in result.iterations]
    assert any("lookup" in s for s in sources) and all(s[0] == "root" and s[-1] == "target" for s in sources)
    for compact in (False, True):
        back = run_from_dict(result.to_dict(compact=compact))
        assert [[n.source for n in it.nodes] for it in back.iterations] == sources
    old = result.to_dict()
    old["schema_version"] = 3
    for it in old["iterations"]:
        for node in it["nodes"]:
            del node["source"]
    back = run_from_dict(old)
    assert SCHEMA_VERSION == 7
    assert all(s == ["root"] + ["model"] * (len(s) - 2) + ["target"]
               for s in ([n.source for n in it.nodes] for it in back.iterations))


def test_lookup_reports_are_typed_in_the_trace_and_older_traces_convert():
    """What the lookup reports about a tree is a typed field of the record (schema 5), kept by a round trip; a
    schema 4 trace's `extra` keys (lookup_s, lookup_only, lookup_match, lookup_match_leaf, selector) load into
    the same fields and leave `extra`."""
    from engine.core.reports import LookupReport, SelectorChoice
    from engine.core.trace import run_from_dict
    pair = tiny_random_pair("related", seed=0, dtype=torch.float32)
    result = Decoder(pair, make_strategy("dynatree", lookup=True, lookup_min_match=1)).generate(
        PROMPT, max_new_tokens=16, stop_on_eos=False)
    reports = [it.lookup for it in result.iterations]
    assert all(isinstance(r, LookupReport) and r.seconds >= 0 for r in reports)
    assert [it.lookup for it in run_from_dict(result.to_dict(compact=True)).iterations] == reports
    old = result.to_dict()
    old["schema_version"] = 4
    for it, report in zip(old["iterations"], reports):
        del it["lookup"], it["selector"]
        it["extra"] = {"lookup_s": report.seconds, "lookup_only": report.alone, "lookup_match": report.match,
                       "selector": {"k": 2, "l1": 1, "l2": 1, "predicted_tokens_per_s": None}, "kept": 1}
    back = run_from_dict(old).iterations
    assert [(it.lookup.seconds, it.lookup.alone, it.lookup.match) for it in back] == [
        (r.seconds, r.alone, r.match) for r in reports]
    assert all(it.selector == SelectorChoice(2, 1, 1) and it.extra == {"kept": 1} for it in back)


# -- the gate: lookup alone where this run's record says it is faster ------------------------------------------------
def synthetic_costs(draft_s: float):
    """A cost table where a target forward costs 1 s at any row count and a draft forward `draft_s`."""
    from engine.measure.costs import LADDER, ModelCosts, PairCosts
    return PairCosts(ModelCosts("t", {"plain": {r: 1.0 for r in LADDER}}),
                     ModelCosts("d", {"plain": {r: draft_s for r in LADDER}}))


def test_gate_learns_both_sides_and_opens_only_when_lookup_is_faster():
    from engine.strategies.graft import LookupGate
    gate = LookupGate()
    assert not gate.lookup_only(3, 1.0)  # no record yet: the model drafts
    tree = DraftTree(root_token=4)
    tree.add(tree.add(0, 5, 0.9), 7, 0.5)  # the model's own nodes: 5, then 7
    gate.last = (False, 3, [5, 6, 7, 8], 2.0, tree)  # a model iteration (2 s predicted) with a 3-token match
    gate.learn([5, 6, 9])  # committed 3 tokens; the lookup had the first 2 right, the model's nodes only the first
    assert gate.lookup_tokens == {3: 2.0} and gate.model_rate == 1.5
    assert gate.graft_gain == {3: 1.0} and gate.any_gain == 1.0  # grafting the lookup would have added the "6"
    assert gate.lookup_only(3, 1.0)  # (1 + 2) / 1 s beats 3 tokens / 2 s
    assert not gate.lookup_only(3, 2.5)  # ... but not when verifying the lookup tree costs 2.5 s
    assert not gate.lookup_only(2, 0.1)  # no record at this match length
    assert not gate.lookup_only(0, 0.1)  # no match: nothing to draft
    gate.last = (True, 3, [1, 2], 1.0, DraftTree(root_token=4))  # a lookup-only iteration, wrong from its first token
    gate.learn([4])
    assert gate.lookup_tokens[3] == pytest.approx(0.7 * 2.0) and gate.model_rate == 1.5  # the model's side unchanged
    assert gate.graft_gain == {3: 1.0}  # learned from model iterations only


@pytest.mark.parametrize("name", GRAFTED)
def test_gated_graft_skips_the_draft_only_when_it_pays_and_stays_exact(name):
    pair = tiny_random_pair("related", seed=0, dtype=torch.float32)
    reference = Decoder(pair, make_strategy("ar")).generate(PROMPT, max_new_tokens=40, stop_on_eos=False)
    alone = {}
    for draft_s in (10.0, 1e-6):  # a draft forward 10x a target's: lookup alone pays; a free draft: never
        pair.costs = synthetic_costs(draft_s)
        result = Decoder(pair, make_strategy(name, lookup=True, lookup_min_match=1)).generate(
            PROMPT, max_new_tokens=40, stop_on_eos=False)
        assert result.output_ids == reference.output_ids
        alone[draft_s] = [it for it in result.iterations if it.lookup.alone]
        assert all(it.draft_forwards == 0 and {n.source for n in it.nodes[1:-1]} <= {"lookup"}
                   for it in alone[draft_s])
        assert all(it.lookup.seconds >= 0 for it in result.iterations)
    assert alone[10.0] and not alone[1e-6]
    pair.costs = None
    off = Decoder(pair, make_strategy(name, lookup=True, lookup_min_match=1, lookup_gate=False))
    assert not any(it.lookup.alone for it in off.generate(PROMPT, max_new_tokens=20).iterations)


def test_gated_graft_samples_reproducibly():
    pair = tiny_random_pair("related", seed=0, dtype=torch.float32)
    pair.costs = synthetic_costs(10.0)
    runs = [Decoder(pair, make_strategy("dynatree", lookup=True, lookup_min_match=1),
                    sampling=Sampling(temperature=0.8, seed=0)).generate(PROMPT, max_new_tokens=24, stop_on_eos=False)
            for _ in range(2)]
    assert runs[0].output_ids == runs[1].output_ids and len(runs[0].output_ids) == 24
    assert [it.lookup.alone for it in runs[0].iterations] == [it.lookup.alone for it in runs[1].iterations]



def test_gate_leaves_out_lookup_rows_that_cost_more_than_they_return():
    from engine.measure.costs import LADDER, ModelCosts, PairCosts
    from engine.strategies.graft import LookupGate
    gate = LookupGate()
    assert gate.worth_grafting(2, 100.0)  # no record: graft, and learn
    gate.graft_gain, gate.model_rate = {2: 0.5}, 10.0  # grafting adds half a token on average; the model: 10 tok/s
    assert gate.worth_grafting(2, 0.01) and not gate.worth_grafting(2, 0.1)
    assert gate.worth_grafting(3, 100.0)  # no record at this match length, nor over all of them
    gate.any_gain = 0.2
    assert gate.worth_grafting(3, 0.01) and not gate.worth_grafting(3, 0.05)  # the record over all match lengths
    strategy = make_strategy("dynatree", lookup=True, lookup_min_match=1)
    strategy.before_build(STREAM, 10)
    strategy.gate = gate
    tree = DraftTree(root_token=STREAM[-1])
    tree.add(0, 1, 0.5)
    strategy.costs = PairCosts(ModelCosts("t", {"plain": {r: 0.1 * r for r in LADDER}}), None)  # 0.1 s a row
    assert strategy.room(tree, budget=24, match=2) == 0  # 16 more rows cost 1.6 s: worth 16 tokens, not 0.5
    strategy.costs = PairCosts(ModelCosts("t", {"plain": {r: 1.0 for r in LADDER}}), None)  # rows are free
    assert strategy.room(tree, budget=24, match=2) == 23
    strategy.costs = PairCosts(ModelCosts("t", {"plain": {r: 0.1 * r for r in LADDER}}), None)
    strategy.settings.lookup_gate = False
    assert strategy.room(tree, budget=24, match=2) == 23  # the gate off: lookup fills what the budget leaves


def test_grafting_is_the_model_strategy_with_lookup_in_front_only_when_switched_on():
    """Lookup grafting is a class in front of the model strategy's own, not a wrapper passing attributes through:
    with the switch off the strategy is the model's own class and never asks for the context; with it on, it is an
    instance of the model's class too, whose index and gate are grafting's and whose size knob, feedback and
    parameters are the model strategy's own."""
    import copy
    from engine.strategies.base import BudgetedStrategy
    from engine.strategies.graft import LookupGrafted
    for name in ("dynatree", "dyspec", "ddtree"):
        plain = make_strategy(name)
        assert isinstance(plain, BudgetedStrategy) and not isinstance(plain, LookupGrafted)
        assert not reads_context(plain) and not hasattr(plain, "gate")
        wrapped = make_strategy(name, "auto", lookup=True)
        assert isinstance(wrapped, LookupGrafted) and isinstance(wrapped, type(plain))
        assert not hasattr(LookupGrafted, "__getattr__")
        assert reads_context(wrapped) and "topk" in wrapped.child_modes_used and wrapped.name == name
        assert wrapped.preset == "auto" and wrapped.settings.lookup and wrapped.device_plan() is None
        wrapped.resize(wrapped.size() - 1)  # the size knob is the model strategy's own
        assert getattr(wrapped.settings, wrapped.auto_param) == wrapped.size()
        twin = copy.deepcopy(wrapped)  # each run decodes with its own copy
        assert type(twin) is type(wrapped) and twin.size() == wrapped.size() and twin.gate is not wrapped.gate
    assert not isinstance(make_strategy("lookup"), LookupGrafted)  # the lookup strategy has no model to graft onto
