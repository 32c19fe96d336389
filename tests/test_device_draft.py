"""The device draft phase (engine/core/device_draft.py): the host path's trees and tokens, one read per iteration.

Trees are compared in float64. The device phase runs each draft forward at its planned width, the host path at the
rows it has, and a GEMM of another row count may sum in another order: a float64 logit then moves by about
K·u·Σ|terms| (K ≤ a few hundred here, u = 1.1e-16), a probability by ~1e-13 of itself. So every node's token,
parent, depth, rank and status, every expanded node's top-10 tokens and every output token must be equal, and every
probability equal within 1e-9 of itself: far above that rounding, far below what a wrong mask or a wrong parent
moves (a leaking mask moves q by more than 1e-3). In float32 the output tokens must equal the host path's (greedy:
the target's argmax decides them, as everywhere in the suite).
"""
import os

import pytest
import torch

from engine.decoder import Decoder
from engine.models.tiny import tiny_random_pair
from engine.core.sampling import Sampling
from engine.strategies import make_strategy
from host_reads import counted_reads, counted_syncs

PLANNED = [
    ("fixed", {}),
    ("fixed", {"budget": 5, "tau": 0.0}),  # the budget cuts a level short
    ("dynatree", {}),
    ("dynatree", {"budget": 7}),
    ("dynatree", {"dynamic_breadth": False}),
    ("dynatree", {"dynamic_depth": False, "d0": 3}),
    ("dynatree", {"pruning": False, "budget": 12}),
    ("dynatree", {"history": False, "tau_h": 0.3, "tau_l": 0.1}),
    ("eagle2", {}),
    ("eagle2", {"k": 3, "depth": 3, "n": 10}),  # the re-ranking prunes the beam's tree
    ("eagle2", {"depth": 0}),
    ("linear", {}),  # the cpu preset's chain ends after a token below q = 0.5
    ("linear", {"k": 3, "stop_below": 0.0}),
]


ROUNDING = 1e-9  # relative: float64 GEMMs of other row counts (module docstring)


def node_view(record):
    """Every node's exact fields, and its probabilities apart (compared within ROUNDING)."""
    exact = [(n.id, n.parent, n.token, n.depth, n.rank, n.status, [row[0] for row in n.next_q]) for n in record.nodes]
    values = [v for n in record.nodes for v in (n.q, n.path_q, *(row[1] for row in n.next_q)) if v is not None]
    return exact, values


def assert_same_nodes(ours, theirs):
    (exact, values), (their_exact, their_values) = node_view(ours), node_view(theirs)
    assert exact == their_exact
    assert values == pytest.approx(their_values, rel=ROUNDING, abs=1e-300)


def decode(pair, name, params, phase, steps="dynamic", tokens=40, **kwargs):
    decoder = Decoder(pair, make_strategy(name, **params), steps=steps, draft_phase=phase, **kwargs)
    return decoder.generate("hello world", max_new_tokens=tokens, stop_on_eos=False)


@pytest.fixture(scope="module")
def pair64():
    pair = tiny_random_pair("related", seed=1)
    pair.target.double()
    pair.draft.double()
    return pair


@pytest.mark.parametrize("steps", ["dynamic", "static"])
@pytest.mark.parametrize("name, params", PLANNED, ids=[f"{n}-{'-'.join(p) or 'preset'}" for n, p in PLANNED])
def test_device_phase_builds_the_host_paths_trees(pair64, name, params, steps):
    host = decode(pair64, name, params, "host", steps)
    device = decode(pair64, name, params, "device", steps)
    assert device.output_ids == host.output_ids
    assert len(device.iterations) == len(host.iterations)
    for ours, theirs in zip(device.iterations, host.iterations):
        assert_same_nodes(ours, theirs)
        assert ours.params == theirs.params  # DynaTree's history adapts alike
    # the device runs every planned level; the host stops where the tree does
    assert all(d.draft_forwards >= h.draft_forwards for d, h in zip(device.iterations, host.iterations))


@pytest.mark.parametrize("name", ["fixed", "dynatree", "eagle2"])
def test_float32_tokens_match_the_host_path(name):
    pair = tiny_random_pair("related", seed=0)
    host, device = (decode(pair, name, {}, phase, "static", tokens=48) for phase in ("host", "device"))
    assert device.output_ids == host.output_ids


def per_iteration(pair, phase: str, name: str, counter) -> list[int]:
    """The reads `counter()` (a context manager yielding {"reads": n}) counts in each iteration of a run."""
    run = Decoder(pair, make_strategy(name), steps="static", draft_phase=phase).run(
        "hello world", max_new_tokens=30, stop_on_eos=False)
    counts, iterate = [], run.iterate

    def counted():
        with counter() as state:
            record = iterate()
        counts.append(state["reads"])
        return record

    run.iterate = counted
    run.to_end()
    return counts


def reads_per_iteration(pair, phase: str, name: str) -> list[int]:
    return per_iteration(pair, phase, name, lambda: counted_reads([pair.target, pair.draft]))


@pytest.mark.parametrize("name", ["fixed", "dynatree", "eagle2"])
def test_one_read_to_the_host_per_iteration(name):
    pair = tiny_random_pair("related", seed=1)
    assert set(reads_per_iteration(pair, "device", name)) == {1}
    assert min(reads_per_iteration(pair, "host", name)) > 1  # the host path reads per level: the count can fail


@pytest.mark.parametrize("name", ["dyspec", "ddtree", "salf", "delayed"])
def test_strategies_without_a_plan_stay_on_the_host(pair64, name):
    assert decode(pair64, name, {}, "device").output_ids == decode(pair64, name, {}, "host").output_ids


def test_sampling_stays_on_the_host(pair64):
    sampling = Sampling(temperature=0.8, seed=3)
    runs = [decode(pair64, "dynatree", {}, phase, sampling=sampling) for phase in ("host", "device")]
    assert runs[0].output_ids == runs[1].output_ids
    assert [it.draft_forwards for it in runs[0].iterations] == [it.draft_forwards for it in runs[1].iterations]


def test_lookup_grafted_strategy_stays_on_the_host(pair64):
    params = {"lookup": True}
    assert decode(pair64, "dynatree", params, "device").output_ids == decode(pair64, "dynatree", params,
                                                                            "host").output_ids


def test_unknown_draft_phase_is_refused():
    with pytest.raises(ValueError, match="draft_phase"):
        Decoder(tiny_random_pair("related"), make_strategy("dynatree"), draft_phase="gpu")


def test_device_inputs_forward_equals_the_host_inputs_forward():
    """The steps' seam: `forward_tensors` from device tensors gives `forward`'s logits and leaves the same cache."""
    pair = tiny_random_pair("related", seed=2)
    pair.target.double()
    from engine.core.steps import make_steps
    for kind in ("dynamic", "static"):
        a, b = (make_steps(pair.target, kind, max_len=64, buckets=(1, 4, 8)) for _ in range(2))
        a.prefill([1, 2, 3, 4])
        b.prefill([1, 2, 3, 4])
        visible = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 1]], dtype=torch.bool)
        got = a.forward_tensors(torch.tensor([5, 6, 7]), torch.tensor([4, 5, 5]), visible)
        want = b.forward([5, 6, 7], [4, 5, 5], visible)
        assert torch.equal(got, want)
        a.keep(4, [4, 6])
        b.keep(4, [4, 6])
        assert torch.equal(a.forward([8], [6]), b.forward([8], [6]))


def test_a_bench_method_grows_its_trees_on_the_device(pair64):
    """`dynatree/device` in the bench: the run is the device phase's (one read per iteration), the tokens the
    host path's."""
    from engine.bench.tables import run_method
    host, device = (run_method(pair64, method, "def f(x):", 24, "cpu", None, Sampling(), "auto", None)
                    for method in ("dynatree", "dynatree/device"))
    assert device["output_ids"] == host["output_ids"]
    assert (max(it.draft_forwards for it in device["result"].iterations)
            == len(make_strategy("dynatree").device_plan()))


DEVICE = os.environ.get("TREEVIZ_TEST_DEVICE", "cpu")
on_cuda = pytest.mark.skipif(DEVICE != "cuda" or not torch.cuda.is_available(),
                             reason="CUDA: run with TREEVIZ_TEST_DEVICE=cuda on a CUDA machine")


@on_cuda
@pytest.mark.parametrize("name", ["fixed", "dynatree", "eagle2"])
def test_cuda_graphs_device_phase_matches_the_host_path_and_syncs_once(name):
    """On CUDA graphs: the host path's tokens, and one synchronisation per iteration, counted by CUDA's own sync
    debug mode (every synchronising call warns)."""
    pair = tiny_random_pair("related", seed=0, device="cuda")
    host, device = (decode(pair, name, {}, phase, "static", tokens=48) for phase in ("host", "device"))
    assert device.output_ids == host.output_ids
    assert set(cuda_syncs_per_iteration(pair, "device", name)) == {1}
    assert min(cuda_syncs_per_iteration(pair, "host", name)) > 1


def cuda_syncs_per_iteration(pair, phase: str, name: str) -> list[int]:
    return per_iteration(pair, phase, name, counted_syncs)


def test_grow_serves_tied_parents_in_frontier_order_and_cuts_the_budget_where_the_host_does():
    """TensorTree.grow against the host builder's own step (`add_top_children`, parents by path probability, the
    earlier first on ties), on distributions with tied parents, tied and zero children and a budget that runs out
    within a parent's children: the same nodes, ids, q and path probabilities."""
    from engine.core.tensor_tree import TensorTree
    from engine.core.tree import DraftTree
    from engine.strategies.base import Strategy
    root = torch.tensor([[0.25, 0.25, 0.25, 0.25, 0.0, 0.0]], dtype=torch.float64)
    level = torch.tensor([[0.5, 0.3, 0.2, 0.0, 0.0, 0.0], [0.4, 0.4, 0.2, 0.0, 0.0, 0.0],
                          [0.6, 0.4, 0.0, 0.0, 0.0, 0.0], [0.9, 0.1, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    k, budget, tau = 3, 9, 0.05
    host = DraftTree(root_token=7)
    frontier = Strategy.add_top_children(host, 0, root[0], k, tau, budget)
    order = sorted(range(len(frontier)), key=lambda i: -host.path_q[frontier[i]])
    for i in order:
        Strategy.add_top_children(host, frontier[i], level[i], k, tau, budget)

    tree = TensorTree(7, budget, torch.device("cpu"))
    nodes, valid = tree.root_frontier()
    for dists in (root, level):
        top, tokens = torch.topk(dists, k, dim=-1)
        chosen = (top > 0) & (tree.path_q[nodes, None] * top >= tau)
        added = tree.grow(nodes, valid, top, tokens, chosen)
        nodes, valid = tree.compact(added, added != tree.dump, len(level))
    count = int(tree.count)
    assert count == len(host) == budget + 1  # the budget ran out inside a parent's children
    assert tree.tokens[:count].tolist() == host.tokens and tree.parents[:count].tolist() == host.parents
    assert tree.q[:count].tolist() == host.q and tree.path_q[:count].tolist() == host.path_q
    assert tree.ranks[:count].tolist() == host.ranks
