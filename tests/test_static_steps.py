"""StaticSteps (preallocated cache, bucketed shapes) computes what DynamicSteps (the engine's path) computes.

fp32 tiny Qwen2 models. Static attends over all max_len columns (the unused ones masked) where dynamic attends over
exactly the cached ones, so the kernels sum in different orders: logits agree to fp32 rounding (TOL), not bit for
bit. Within StaticSteps, the bucket a forward is padded to changes nothing for the real rows.
With TREEVIZ_TEST_DEVICE=cuda the same sequences run with CUDA graphs captured and replayed.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

from engine.core import kv
from engine.core.steps import (DynamicSteps, StaticSteps, StepsError, capacity, choose_buckets, default_buckets,
                               make_steps)
from engine.measure.costs import ModelCosts, PairCosts
from engine.models import tiny_random_model
from rounding import assert_as_accurate, assert_caught

DEVICE = os.environ.get("TREEVIZ_TEST_DEVICE", "cpu")
TOL = dict(rtol=1e-5, atol=1e-4)  # logits have std ~4 on these models; fp32 rounding of a reordered sum is ~1e-6
DEPTH = 4
PROMPT = [72, 101, 108, 108, 111, 44, 32, 116, 114, 101, 101, 115, 33]


@pytest.fixture(scope="module")
def model():
    return tiny_random_model(0).to(DEVICE)


def chain_tree(rng: random.Random, depth: int = DEPTH, extra: int = 4):
    """(tokens, parents, depths): a chain root -> 1 -> .. -> depth (so every acceptance length exists), plus
    `extra` random side branches."""
    parents, depths = [-1] + list(range(depth)), list(range(depth + 1))
    for _ in range(extra):
        p = rng.randrange(len(parents))
        parents.append(p)
        depths.append(depths[p] + 1)
    tokens = [rng.randrange(256) for _ in parents]
    return tokens, parents, depths


def ancestors(parents: list[int], rows: list[int]) -> torch.Tensor:
    """Bool [len(rows), len(parents)]: row i sees node j iff j is rows[i] or one of its ancestors."""
    seen = torch.zeros(len(rows), len(parents), dtype=torch.bool)
    for i, node in enumerate(rows):
        while node >= 0:
            seen[i, node] = True
            node = parents[node]
    return seen


def run_iterations(steps, seed: int = 0, iterations: int = 2 * (DEPTH + 1)):
    """Prefill, then trees forwarded in two batches (the root and depth 1, then the rest, seeing the first batch's
    rows: the drafter's pattern), then keep the root and an accepted chain of length k = 0..DEPTH in turn.
    Returns (every logits tensor, the committed sequence)."""
    rng = random.Random(seed)
    outs = [steps.prefill(PROMPT)]
    committed = list(PROMPT) + [int(outs[0][-1].argmax())]
    for it in range(iterations):
        tokens, parents, depths = chain_tree(rng)
        tokens[0] = committed[-1]
        root = len(committed) - 1
        assert steps.length == root
        first = [i for i, d in enumerate(depths) if d <= 1]
        second = [i for i, d in enumerate(depths) if d > 1]
        order = first + second
        col = {node: root + i for i, node in enumerate(order)}  # cache row of each node
        for batch in (first, second):
            base = steps.length
            seen = ancestors(parents, batch)
            visible = torch.zeros(len(batch), base + len(batch), dtype=torch.bool)
            visible[:, :root] = True
            for j in range(len(parents)):
                if col[j] < base + len(batch):
                    visible[:, col[j]] = seen[:, j]
            outs.append(steps.forward([tokens[i] for i in batch], [root + depths[i] for i in batch], visible))
        accepted = it % (DEPTH + 1)  # the chain nodes 1..accepted
        steps.keep(root + 1, [col[node] for node in range(1, accepted + 1)])
        committed += [tokens[node] for node in range(1, accepted + 1)] + [rng.randrange(256)]
    return outs, committed


def assert_all_close(a: list[torch.Tensor], b: list[torch.Tensor], **tol):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.shape == y.shape, i
        torch.testing.assert_close(x, y, msg=lambda m: f"forward {i}: {m}", **tol)


def test_static_equals_dynamic_through_every_acceptance_length(model):
    dynamic, _ = run_iterations(DynamicSteps(model))
    steps = StaticSteps(model, capacity(len(PROMPT), 40, 8), buckets=(1, 2, 4, 8))
    static, _ = run_iterations(steps)
    assert_all_close(static, dynamic, **TOL)
    for layer in steps.cache.layers:  # padded rows and stale rows stay finite (a NaN would poison masked columns)
        assert torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all()


def test_padding_never_changes_a_real_row(model):
    """The same sequence with every forward at its own size (buckets 1..8) and padded up to 8 rows."""
    max_len = capacity(len(PROMPT), 40, 8)
    exact, _ = run_iterations(StaticSteps(model, max_len, buckets=tuple(range(1, 9))))
    padded_steps = StaticSteps(model, max_len, buckets=(8,))
    padded, _ = run_iterations(padded_steps)
    assert padded_steps.bucket(3) == 8
    # the GEMMs block rows differently at 3 and 8 rows: fp32 rounding, far below any leak through the mask (O(1))
    assert_all_close(padded, exact, **TOL)


def test_padded_rows_see_only_themselves(model):
    steps = StaticSteps(model, 40, buckets=(8,))
    steps.prefill(PROMPT)
    steps.forward([1, 2, 3], [13, 14, 14], kv.tree_visibility(13, torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]],
                                                                                dtype=torch.bool)))
    seen = steps._mask[0, 0, :8] == 0
    assert seen[:3, 16:].sum() == 0  # no real row sees a padded row
    assert seen[:3, :13].all() and seen[1, 14] and not seen[1, 15] and not seen[2, 14]
    for i in range(3, 8):  # each padded row sees exactly its own column
        assert seen[i].nonzero().flatten().tolist() == [13 + i]


def test_rollback_equals_a_fresh_sequential_forward(model):
    """After the iterations, the kept cache rows are what one forward of the committed sequence writes, and the
    next token's logits match that forward's last row."""
    for steps in (StaticSteps(model, capacity(len(PROMPT), 40, 8), buckets=(1, 4, 8)), DynamicSteps(model)):
        _, committed = run_iterations(steps, seed=3)
        fresh = kv.new_cache(model)
        with torch.inference_mode():
            want = model(input_ids=torch.tensor([committed], device=DEVICE), past_key_values=fresh,
                         use_cache=True).logits[0, -1]
        got = steps.forward([committed[-1]], [len(committed) - 1])[-1]
        torch.testing.assert_close(got, want, **TOL)
        rows = len(committed) - 1
        for mine, ref in zip(steps.cache.layers, fresh.layers):
            torch.testing.assert_close(mine.keys[:, :, :rows], ref.keys[:, :, :rows], **TOL)
            torch.testing.assert_close(mine.values[:, :, :rows], ref.values[:, :, :rows], **TOL)


def test_forward_beyond_every_bucket_runs_at_its_own_size(model):
    """The draft's first forward carries the whole prompt: larger than any bucket, it runs unpadded."""
    static, dynamic = StaticSteps(model, 64, buckets=(1, 2)), DynamicSteps(model)
    positions = list(range(len(PROMPT)))
    a = static.forward(PROMPT, positions, last=2)
    b = dynamic.forward(PROMPT, positions, last=2)
    assert a.shape == b.shape == (2, model.config.vocab_size)
    torch.testing.assert_close(a, b, **TOL)
    assert static.length == dynamic.length == len(PROMPT)
    torch.testing.assert_close(static.forward([5], [len(PROMPT)]), dynamic.forward([5], [len(PROMPT)]), **TOL)


def test_reset_and_limits(model):
    steps = StaticSteps(model, 19, buckets=(1, 4))
    first = steps.prefill(PROMPT)
    steps.reset()
    assert steps.length == 0
    torch.testing.assert_close(steps.prefill(PROMPT), first, rtol=0, atol=0)
    with pytest.raises(ValueError, match="outside"):
        steps.keep(0, [steps.length])
    with pytest.raises(ValueError, match="visible must be"):
        steps.forward([1], [1], torch.ones(1, 1, dtype=torch.bool))


GRAPHS = [False] + ([True] if DEVICE == "cuda" else [])  # on CUDA also with graphs captured and recaptured


@pytest.mark.parametrize("graphs", GRAPHS)
def test_a_cache_too_small_grows_and_keeps_its_rows(model, graphs):
    """max_len 20 cannot hold the sequence: it grows (twice, graphs captured again), and every logit matches a
    cache large enough."""
    small = StaticSteps(model, 20, buckets=(1, 2, 4, 8), graphs=graphs)
    grown, _ = run_iterations(small)
    assert small.capture_info["grown"] >= 1 and small.max_len >= small.length and small.capture_info["grow_s"] > 0
    roomy, _ = run_iterations(StaticSteps(model, capacity(len(PROMPT), 40, 8), buckets=(1, 2, 4, 8), graphs=graphs))
    assert_all_close(grown, roomy, **TOL)


def test_the_hidden_rows_are_the_real_ones_when_padded(model):
    """The final norm's rows a forward leaves in `last_hidden` (the neural selector's features): the n real rows,
    row n - 1 last, never a padding row."""
    static, dynamic = StaticSteps(model, 64, buckets=(8,)), DynamicSteps(model)
    for steps in (static, dynamic):
        steps.prefill(PROMPT)
        steps.forward([1, 2, 3], [13, 14, 15])
    assert static.last_hidden.shape == (3, model.config.hidden_size)
    torch.testing.assert_close(static.last_hidden, dynamic.last_hidden, **TOL)


# ---- the shapes of real models: 7:1 grouped-query heads, head_dim 128, fp32 and bf16 ---------------------------------

def real_shape_model(dtype: torch.dtype, seed: int = 0, vocab: int = 520):
    """One layer of Qwen2.5-0.5B's attention shape (7 query heads per key/value head, head_dim 128) at a small
    width; bf16 where the test says so."""
    from engine.core.attention import use_tree_sdpa
    from engine.models import tiny_config
    config = tiny_config(vocab_size=vocab, num_layers=1, hidden_size=896, intermediate_size=512,
                         num_attention_heads=7, num_key_value_heads=1)
    model = tiny_random_model(seed, config=config).to(device=DEVICE, dtype=dtype)
    use_tree_sdpa(model)
    return model


class LeakySteps(DynamicSteps):
    """The defect the comparison guards against: a forward that ignores its visibility (every row sees every row)."""

    def forward(self, tokens, positions, visible=None, last=0):
        if visible is not None:
            visible = torch.ones_like(visible)
        return super().forward(tokens, positions, visible, last)


@pytest.mark.parametrize("graphs", GRAPHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_shapes_static_equals_dynamic(dtype, graphs):
    model = real_shape_model(dtype)
    attention = model.model.layers[0].self_attn
    assert attention.head_dim == 128 and attention.num_key_value_groups == 7
    dynamic, _ = run_iterations(DynamicSteps(model))
    static, _ = run_iterations(StaticSteps(model, capacity(len(PROMPT), 40, 8), (1, 2, 4, 8), graphs=graphs))
    if dtype == torch.float32:
        # fp32 kernels of other row counts (a padded bucket) sum in another order, by CPU ISA and GPU; how far that
        # may move a logit depends on the problem's conditioning, so the yardstick is float64's answer: static steps
        # must be as accurate as the eager path on this machine's own kernels (tests/rounding.py)
        exact, _ = run_iterations(DynamicSteps(real_shape_model(torch.float64)))
        bound = assert_as_accurate(static, dynamic, exact, reduction=model.config.hidden_size)
        assert_caught(run_iterations(LeakySteps(model))[0], exact, bound)
    else:  # bf16: kernels of other row counts round differently; far below the logits' spread (std ~15)
        scale = max(float(x.float().std()) for x in dynamic)
        assert_all_close([x.float() for x in static], [x.float() for x in dynamic], rtol=0.02, atol=0.05 * scale)


# ---- buckets ------------------------------------------------------------------------------------------------------

def table(seconds: dict[int, float]) -> PairCosts:
    return PairCosts(ModelCosts("target", {"plain": seconds}), ModelCosts("draft", {"plain": seconds}))


def test_flat_costs_collapse_into_few_buckets():
    """A GPU-like table: flat up to 16 rows, then climbing. 2..8 pad to 16 for free; 1 always stays."""
    flat = table({1: 1.0, 2: 1.0, 4: 1.01, 8: 1.02, 16: 1.05, 32: 1.6, 64: 3.0})
    assert choose_buckets(flat, 64) == (1, 16, 32, 64)
    assert choose_buckets(flat, 64, role="draft") == (1, 16, 32, 64)


def test_climbing_costs_keep_every_rung_and_max_rows():
    """A CPU-like table (cost ~ rows): every rung stays; a max_rows that is not a rung is the top bucket."""
    linear = table({r: 1.0 + 0.2 * r for r in (1, 2, 4, 8, 16, 32, 64)})
    assert choose_buckets(linear, 64) == (1, 2, 4, 8, 16, 32, 64)
    assert choose_buckets(linear, 48) == (1, 2, 4, 8, 16, 32, 48)
    assert choose_buckets(linear, 48, slack=10.0) == (1, 48)  # any padding is acceptable: one bucket and AR's


def test_every_row_count_pays_at_most_the_slack():
    costs = table({1: 1.0, 2: 1.05, 4: 1.1, 8: 1.3, 16: 1.35, 32: 2.0, 64: 3.5})
    ladder = choose_buckets(costs, 64, slack=0.1)
    for rung in (1, 2, 4, 8, 16, 32, 64):
        b = next(b for b in ladder if b >= rung)
        assert costs.target.time(b) <= 1.1 * costs.target.time(rung)


def test_default_ladder_without_a_table():
    assert choose_buckets(None, 64) == default_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert default_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert default_buckets(1) == (1,)
    with pytest.raises(ValueError):
        default_buckets(0)


# ---- the switch ---------------------------------------------------------------------------------------------------

def test_make_steps_choices(model):
    assert isinstance(make_steps(model), DynamicSteps)  # the default: the eager path
    static = make_steps(model, "static", max_len=32, buckets=(1, 4))
    assert isinstance(static, StaticSteps) and static.graphs is None and static.buckets == (1, 4)
    if DEVICE == "cpu":
        with pytest.raises(StepsError, match="CUDA graphs need a CUDA device"):
            make_steps(model, "static", max_len=32, buckets=(1,), graphs=True)
    with pytest.raises(StepsError, match="static steps"):
        make_steps(model, "dynamic", graphs=True)
    with pytest.raises(ValueError, match="max_len"):
        make_steps(model, "static")
    with pytest.raises(ValueError):
        make_steps(model, "fast")


# ---- CUDA graphs (TREEVIZ_TEST_DEVICE=cuda) ------------------------------------------------------------------------

cuda_only = pytest.mark.skipif(DEVICE != "cuda" or not torch.cuda.is_available(),
                               reason="CUDA graphs: run with TREEVIZ_TEST_DEVICE=cuda on a CUDA machine")


@cuda_only
def test_graphs_replay_what_dynamic_computes(model):
    buckets = (1, 2, 4, 8)
    steps = make_steps(model, "static", max_len=capacity(len(PROMPT), 40, 8), buckets=buckets, graphs=True)
    assert isinstance(steps, StaticSteps) and steps.graphs is not None
    assert sorted(steps.graphs.graphs) == list(buckets) and sorted(steps.capture_info["seconds"]) == list(buckets)
    assert steps.capture_info["allocated_bytes"] >= 0
    dynamic, _ = run_iterations(DynamicSteps(model))
    graphed, _ = run_iterations(steps)
    assert_all_close(graphed, dynamic, rtol=1e-4, atol=1e-3)  # TF32 / fused kernels may differ more than on CPU


@cuda_only
def test_two_models_share_one_pool(model):
    other = tiny_random_model(1).to(DEVICE)
    a = make_steps(model, "static", max_len=64, buckets=(1, 4), graphs=True)
    b = make_steps(other, "static", max_len=64, buckets=(1, 4), graphs=True)
    a.prefill(PROMPT), b.prefill(PROMPT)
    la = a.forward([1, 2, 3], [13, 14, 15])
    lb = b.forward([1, 2, 3], [13, 14, 15])  # replaying b's graph must not change a's returned logits
    for steps, logits, m in ((a, la, model), (b, lb, other)):  # each against its own model's eager reference
        ref = DynamicSteps(m)
        ref.prefill(PROMPT)
        torch.testing.assert_close(logits, ref.forward([1, 2, 3], [13, 14, 15]), rtol=1e-4, atol=1e-3)


# ---- the decoder on static steps ----------------------------------------------------------------------------------

def decode(pair, name: str, steps: str, sampling=None, n: int = 40):
    from engine.decoder import Decoder
    from engine.strategies import make_strategy
    decoder = Decoder(pair, make_strategy(name), sampling=sampling, steps=steps, capture="off")
    result = decoder.generate("static steps, dynamic steps:", max_new_tokens=n, stop_on_eos=False)
    return result, decoder


def strategy_names():
    from engine.strategies import STRATEGIES
    return list(STRATEGIES)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("name", strategy_names())
def test_decoder_on_static_steps_emits_what_dynamic_emits(related_pair, name, temperature):
    """Every strategy, greedy and seeded sampling: the same tokens and the same acceptance, iteration by iteration."""
    from engine.core.sampling import Sampling
    sampling = Sampling(temperature=temperature, seed=7)
    related_pair.static_steps.clear()  # the pair keeps its steps across runs: start from none
    dynamic, _ = decode(related_pair, name, "dynamic", sampling)
    static, decoder = decode(related_pair, name, "static", sampling)
    assert isinstance(related_pair.static_steps["target"], StaticSteps)
    assert isinstance(related_pair.static_steps.get("draft"), StaticSteps) == decoder.strategy.uses_draft
    assert static.output_ids == dynamic.output_ids
    assert [it.accepted for it in static.iterations] == [it.accepted for it in dynamic.iterations]
