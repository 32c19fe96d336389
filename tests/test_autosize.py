"""The `auto` sizer asks each strategy what a size costs it (`Strategy.cost_at`), so it compares sizes on their true
cost: on a synthetic cost table, the size it picks from one tree observed at a large size is the size that building
and verifying the tree at every size (brute force, the strategy's real `build`) shows to be best."""
import random

import pytest
import torch

from engine.core.tree import DraftTree
from engine.decoder import Decoder
from engine.measure.autosize import GROWTH, AutoSizer, Sample, auto_sizing, predicted
from engine.measure.costs import LADDER, ModelCosts, PairCosts
from engine.models import tiny_random_pair
from engine.strategies import StrategyError, make_strategy

V = 8


def dist(path: tuple[int, ...], salt: str) -> torch.Tensor:
    rng = random.Random(repr((salt, path)))
    w = torch.tensor([rng.random() ** 3 for _ in range(V)], dtype=torch.float64)
    return (w / w.sum()).float()


def target_choice(path: tuple[int, ...]) -> int:
    """The target's greedy token: the draft's q nudged by an unrelated distribution (agrees often, not always)."""
    return int((dist(path, "draft") + 0.6 * dist(path, "target")).argmax())


class Drafter:
    """A deterministic draft over token paths; records each forward's row count (the root's forward has one row)."""
    generator = None  # greedy decoding

    def __init__(self, tree: DraftTree):
        self.tree, self.rows = tree, []

    def expand(self, nodes):
        self.rows.append(len(nodes))
        out = []
        for node in nodes:
            q = dist(tuple(self.tree.tokens[v] for v in self.tree.path_to(node)[1:]), "draft")
            self.tree.confidence[node] = float(q.max())
            out.append(q)
        return torch.stack(out)

    def remap(self, mapping):
        pass


def run(name: str, params: dict) -> tuple[DraftTree, list[int], list[int]]:
    """Build the real strategy's tree and walk it greedily: (tree, draft forward rows, accepted node ids)."""
    strategy = make_strategy(name, **params)
    tree = DraftTree(root_token=-1)
    drafter = Drafter(tree)
    strategy.build(drafter, tree)
    accepted, node = [], 0
    while (child := tree.child_with_token(node, target_choice(tuple(tree.tokens[v] for v in tree.path_to(node)[1:])))
           ) is not None:
        accepted.append(child)
        node = child
    return tree, drafter.rows, accepted


def costs(verify, draft=lambda r: 0.3) -> PairCosts:
    return PairCosts(ModelCosts("t", {"plain": {r: verify(r) for r in LADDER}}),
                     ModelCosts("d", {"plain": {r: draft(r) for r in LADDER}}))


VERIFY = {"knee at 8 rows": lambda r: 1.0 if r <= 8 else 1.0 + 0.3 * (r - 8),
          "steady slope": lambda r: 1.0 + 0.12 * r,
          "flat": lambda r: 1.0}
DRAFT = {"flat draft": lambda r: 0.3, "draft priced per row": lambda r: 0.1 + 0.1 * r}
TABLES = {f"{v}, {d}": (VERIFY[v], DRAFT[d]) for v in VERIFY for d in DRAFT}
CASES = [("eagle2", {"k": 3, "depth": 3}, 24), ("salf", {"b": 4, "th": 0.3}, 24), ("salf", {"b": 2, "th": 0.1}, 24),
         ("salf", {"b": 3, "th": 0.0}, 24), ("ddtree", {"block": 5}, 24), ("ddtree", {"block": 3}, 24)]


def brute_force(name, params, largest, table) -> dict[int, tuple[int, float]]:
    """(tokens, seconds) of the real tree built at every size the strategy accepts, up to `largest`."""
    strategy = make_strategy(name, **params, **{make_strategy(name).auto_param: largest})
    out = {}
    for m in strategy.sizes():
        if m > largest:
            break
        tree, rows, accepted = run(name, {**params, strategy.auto_param: m})
        out[m] = (len(accepted) + 1, table.predict(rows, len(tree))["total_s"])
    return out


@pytest.mark.parametrize("table_name", TABLES)
@pytest.mark.parametrize("name,params,largest", CASES)
def test_auto_picks_the_brute_force_best_size(name, params, largest, table_name):
    table = costs(*TABLES[table_name])
    strategy = make_strategy(name, **params, **{make_strategy(name).auto_param: largest})
    tree, rows, accepted = run(name, strategy.current_params())
    sample = Sample(tree.parents, tree.depths, accepted, rows[0], rows, 0.0, tree.path_q)
    sizer = AutoSizer(strategy, table)
    value = sizer.choose(sample)
    truth = brute_force(name, params, largest, table)
    best = max(truth, key=lambda m: (truth[m][0] / truth[m][1], -m))
    assert sizer.last["best_size"] == best, f"{name} on '{table_name}': brute force {truth}"
    assert strategy.size() == value >= GROWTH * best and value in strategy.sizes()
    for m, (tokens, seconds) in truth.items():  # exact at every size, not only at the best
        assert predicted(sample, strategy.cost_at(sample, m), table) == (tokens, pytest.approx(seconds)), m


def test_eagle2_pays_depth_plus_one_forwards_at_every_size():
    strategy = make_strategy("eagle2", k=3, depth=3, n=24)
    tree, rows, accepted = run("eagle2", strategy.current_params())
    sample = Sample(tree.parents, tree.depths, accepted, rows[0], rows, 0.0, tree.path_q)
    assert {len(strategy.cost_at(sample, m).draft_rows) for m in range(1, 25)} == {4}
    ddtree = make_strategy("ddtree", block=5, budget=24)
    tree, rows, accepted = run("ddtree", ddtree.current_params())
    sample = Sample(tree.parents, tree.depths, accepted, rows[0], rows, 0.0, tree.path_q)
    assert ddtree.cost_at(sample, 1).draft_rows == [1, 1]  # q_1, and the forward that shows no depth-2 prefix wins
    assert all(r == 1 for m in range(1, 25) for r in ddtree.cost_at(sample, m).draft_rows)  # the top-1 chain


def test_sizer_sets_only_sizes_the_strategy_accepts():
    salf = make_strategy("salf", "auto", b=8, n=16)
    assert salf.sizes()[0] == 8
    with pytest.raises(StrategyError):
        salf.resize(4)
    assert salf.size() == 16  # a refused size leaves the config as it was
    tree, rows, accepted = run("salf", salf.current_params())
    sample = Sample(tree.parents, tree.depths, accepted, rows[0], rows, 0.0, tree.path_q)
    sizer = AutoSizer(salf, costs(lambda r: 1.0 if r <= 2 else 50.0))  # only tiny trees pay: best would be < B
    assert sizer.choose(sample) >= 8 and min(sizer.predicted_rates()) == 8


@pytest.mark.parametrize("name", ["eagle2", "salf", "ddtree", "dynatree", "dyspec", "fixed", "linear"])
def test_auto_runs_on_the_production_path(name, monkeypatch):
    """The decoder's sizer reads real records (path probabilities, draft rows, context) and keeps every size valid."""
    monkeypatch.setattr(AutoSizer, "scale", lambda self: (1.0, 1.0))  # the synthetic table as given
    pair = tiny_random_pair("identical", seed=0)
    pair.costs = costs(VERIFY["knee at 8 rows"])
    strategy = make_strategy(name, "auto")
    start = strategy.size()
    result = Decoder(pair, strategy, plugins=(auto_sizing,)).generate("hello", max_new_tokens=40, stop_on_eos=False)
    chosen = [it.cost.auto["next"] for it in result.iterations]
    assert all(m in strategy.sizes() for m in chosen) and set(chosen) != {start}
    assert result.params[strategy.auto_param] == chosen[-1]  # the run's own strategy was resized
    assert strategy.size() == start  # the configured one was not: the next run starts from the preset again


def test_auto_drafts_nothing_where_no_tree_pays_and_tries_again(monkeypatch):
    """A draft step priced at ten target steps: no tree pays, so after the first tree the sizer asks for REST AR
    steps (root-only trees, no draft forward), then tries a tree again; the output is AR's token for token."""
    from engine.measure.autosize import REST
    monkeypatch.setattr(AutoSizer, "scale", lambda self: (1.0, 1.0))  # the synthetic table as given
    pair = tiny_random_pair("related", seed=0)
    pair.costs = PairCosts(ModelCosts("t", {"plain": {r: 0.01 + 0.001 * r for r in LADDER}}),
                           ModelCosts("d", {"plain": {r: 0.1 for r in LADDER}}))
    strategy = make_strategy("dynatree", preset="auto")
    result = Decoder(pair, strategy, plugins=(auto_sizing,)).generate("hello", max_new_tokens=40, stop_on_eos=False)
    reference = Decoder(pair, make_strategy("ar")).generate("hello", max_new_tokens=40, stop_on_eos=False)
    assert result.output_ids == reference.output_ids
    its = result.iterations
    assert its[0].cost.auto["draft"] == "none" and "no tree pays" in its[0].cost.auto["why"]
    assert its[0].cost.auto["predicted_ar_tokens_per_s"] > its[0].cost.auto["predicted_tokens_per_s"]
    rest = its[1:1 + REST]
    assert all([n.status for n in it.nodes] == ["root", "bonus"] and it.draft_forwards == 0 for it in rest)  # AR
    assert its[1 + REST].draft_forwards > 0  # then a tree again, on fresh evidence


def test_auto_keeps_drafting_where_trees_pay(monkeypatch):
    monkeypatch.setattr(AutoSizer, "scale", lambda self: (1.0, 1.0))  # the synthetic table as given
    pair = tiny_random_pair("identical", seed=0)  # the draft is the target: every node is accepted
    pair.costs = PairCosts(ModelCosts("t", {"plain": {r: 0.01 + 0.0001 * r for r in LADDER}}),
                           ModelCosts("d", {"plain": {r: 0.001 for r in LADDER}}))
    result = Decoder(pair, make_strategy("dynatree", preset="auto"), plugins=(auto_sizing,)).generate(
        "hello", max_new_tokens=40, stop_on_eos=False)
    assert all(it.cost.auto["draft"] == "tree" for it in result.iterations)
    assert all(it.draft_forwards > 0 for it in result.iterations)


def test_the_recipe_plugs_the_sizer_in_exactly_for_the_auto_preset():
    """engine/recipe.py hands the Decoder the sizer's plug-in for an `auto` run (the decoder itself imports no
    sizer); a run then sizes its own strategy, and without a cost table the plug-in stays out of the run."""
    from engine.recipe import RunSpec, make_decoder
    pair = tiny_random_pair("related", seed=0)
    spec = RunSpec(pair="tiny", prompt="hello", strategy="dynatree", preset="auto", max_new_tokens=4)
    assert make_decoder(pair, spec).plugins == (auto_sizing,)
    assert make_decoder(pair, spec.as_method("dynatree@cpu")).plugins == ()
    run = make_decoder(pair, spec).run("hello", max_new_tokens=4, stop_on_eos=False)
    list(run)
    assert run.hooks == [run.strategy]  # no cost table: no sizer


def test_a_sweep_under_the_auto_preset_holds_each_size_for_its_whole_run(monkeypatch):
    """The Sweep takes the page's preset, "auto" by default: each point must run at its own size from the first
    iteration to the last (the sizer, which moves the knob on this table, stays out of the run) with the auto
    preset's other starting values; otherwise every point measures the sizer's choice."""
    from engine.bench import sweep as sweep_module
    from engine.recipe import RunSpec, make_decoder, start_run
    monkeypatch.setattr(AutoSizer, "scale", lambda self: (1.0, 1.0))  # the synthetic table as given
    pair = tiny_random_pair("identical", seed=0)
    pair.costs = costs(VERIFY["knee at 8 rows"])
    spec = RunSpec(pair="tiny", prompt="hello", strategy="dynatree", preset="auto", max_new_tokens=24,
                   stop_on_eos=False)
    assert make_decoder(pair, spec).plugins == (auto_sizing,)  # a Run on this preset sizes its trees
    held = sweep_module.held_at(spec, "budget", 5)
    assert make_decoder(pair, held).plugins == ()
    assert make_decoder(pair, held).strategy.settings == make_strategy("dynatree", "auto", budget=5).settings
    runs = []
    monkeypatch.setattr(sweep_module, "start_run", lambda *a, **k: runs.append(start_run(*a, **k)) or runs[-1])
    events = list(sweep_module.run_sweep(pair, spec, values=[3, 12]))
    assert events[-1]["complete"] and [r.decoder.strategy.name for r in runs] == ["ar", "dynatree", "dynatree"]
    for run, size in zip(runs[1:], (3, 12)):
        assert {it.params["budget"] for it in run.result.iterations} == {size}
