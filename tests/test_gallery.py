"""The gallery: the script that makes it (on the tiny pair, into a temporary folder) and the committed real-model
traces it made (assets/traces/): bounded in size, replayable with no model, opening on a real speedup."""
from __future__ import annotations

import json

import pytest

from engine.core.trace import SCHEMA_VERSION, load_run
from scripts import make_gallery
from treeviz.page.replay import TRACE_DIR, gallery_label, gallery_rank, gallery_traces
from treeviz.page.views import RUN_OUTPUTS, render_views

MAX_FILE_KB = 450      # make_gallery's default bound on each file
MAX_TOTAL_MB = 6       # "a few MB in all"


def test_make_gallery_writes_bounded_traces_with_ar_beside_them(tmp_path, capsys):
    make_gallery.main(["--pair", "tiny-random", "--out", str(tmp_path), "--only", "dynatree",
                       "--max-new-tokens", "16", "--max-kb", "12"])
    names = sorted(p.name for p in tmp_path.glob("*.json"))
    # the plan's DynaTree entries, then the cpu preset of the fastest strategy on the code prompt (the only one here)
    assert names == ["tiny-random_chat_dynatree_paper.json", "tiny-random_code_dynatree_cpu.json",
                     "tiny-random_code_dynatree_paper.json"]
    for path in tmp_path.glob("*.json"):
        run = load_run(path)
        assert path.stat().st_size <= 12 * 1024 or run.metrics.new_tokens <= make_gallery.MIN_TOKENS
        assert run.comparison and run.comparison.speedup_vs_ar and run.params
        assert run.strategy == "dynatree" and run.iterations[0].nodes[0].next_p
    assert load_run(tmp_path / "tiny-random_code_dynatree_paper.json").params["budget"] == 256  # the paper preset
    assert "gallery:" in capsys.readouterr().out


def test_gallery_order_real_then_equal_to_ar_then_speedup():
    real_fast_diverged = {"tiny": False, "speedup": 1.5, "diverged": True}
    real_equal = {"tiny": False, "speedup": 1.4, "diverged": False}
    tiny = {"tiny": True, "speedup": 3.0, "diverged": False}
    ranked = sorted([tiny, real_fast_diverged, real_equal], key=gallery_rank)
    assert ranked == [real_equal, real_fast_diverged, tiny]


def test_a_whole_plan_replaces_the_pairs_gallery(tmp_path):
    """Traces of the same pair that a full run did not rewrite go; other pairs' traces stay."""
    entry = make_gallery.Entry("code", "dynatree", "cpu")
    for name in ("tiny-random_code_salf_cpu.json", f"tiny-random_{entry.stem}.json", "default_code_salf_cpu.json"):
        (tmp_path / name).write_text("{}")
    make_gallery.remove_stale(tmp_path, "tiny-random", [entry])
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["default_code_salf_cpu.json",
                                                              f"tiny-random_{entry.stem}.json"]


def test_the_committed_gallery_is_real_small_and_replays():
    paths = sorted(TRACE_DIR.glob("*.json"))
    assert paths, "no gallery traces: run python -m scripts.make_gallery --pair default"
    total = sum(p.stat().st_size for p in paths)
    assert total <= MAX_TOTAL_MB * 1024 * 1024, f"{total / 1024 / 1024:.1f} MB"
    kinds, strategies = set(), set()
    for path in paths:
        assert path.stat().st_size <= MAX_FILE_KB * 1024, path
        data = json.loads(path.read_text())
        # written by this schema or an older one that engine.core.trace upgrades on load (schema 3 only moved the cost
        # record out of `extra`): regenerate with `python -m scripts.make_gallery --pair default` to bring it current
        assert 1 <= data["schema_version"] <= SCHEMA_VERSION
        assert not str(data["config"]["target"]).startswith("tiny"), f"{path.name}: tiny traces belong to the tests"
        run = load_run(path)
        assert run.iterations and run.output_ids and run.comparison
        kinds.add(path.stem.split("_")[1])
        strategies.add((run.strategy, path.stem.rsplit("_", 1)[-1], run.config.sampling.temperature))
        views = render_views(run, None, 0)
        assert set(views) == set(RUN_OUTPUTS[5:])
    assert kinds == {"code", "chat", "prose"}
    assert {("dynatree", "paper", 0.0), ("dyspec", "paper", 0.0), ("salf", "paper", 0.0),
            ("ddtree", "paper", 0.0), ("delayed", "cpu", 0.8)} <= strategies
    assert any(preset == "cpu" and temperature == 0.0 for _, preset, temperature in strategies)


def test_the_gallery_opens_on_a_real_speedup():
    first = gallery_traces()[0]
    run = load_run(first)
    assert not run.config.target.startswith("tiny")
    assert run.comparison.speedup_vs_ar > 1.0, gallery_label(first)
    assert run.comparison.exact_match, "the first view is a greedy run that equals AR, not a bf16 near-tie caveat"
    assert f"{run.comparison.speedup_vs_ar:.2f}×" in gallery_label(first)


@pytest.mark.parametrize("path", sorted(TRACE_DIR.glob("*.json")), ids=lambda p: p.stem)
def test_every_gallery_speedup_names_the_machine_it_was_measured_on(path):
    machine = load_run(path).config.machine
    assert machine and f"vs AR on {machine}" in gallery_label(path)


def test_a_new_run_records_its_machine(related_pair):
    from engine.models.devices import machine_label
    from engine.recipe import RunSpec, generate
    run = generate(related_pair, RunSpec(pair="tiny-random", prompt="ab", strategy="dynatree", max_new_tokens=4))
    assert run.config.machine == machine_label(related_pair.device) and "cores" in run.config.machine


@pytest.mark.parametrize("path", sorted(TRACE_DIR.glob("*.json")), ids=lambda p: p.stem)
def test_every_gallery_trace_has_both_distributions_for_its_inspector(path):
    run = load_run(path)
    expanded = [n for it in run.iterations for n in it.nodes if n.next_q]
    assert expanded and all(n.next_p for n in expanded)
    assert all(it.cost is not None for it in run.iterations)  # the cost panel's records
