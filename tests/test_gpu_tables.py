"""GPU cost tables (engine/measure/gpu_tables.py): a written table loads back, a broken one is refused naming its
field, tables find a run's pair by its models' names, a run's own rows are priced by the table; and the Costs view
(treeviz/figures/charts.py) shows that prediction for the run on screen, labelled with the GPU and date, or says plainly
that no table is shipped. Tables are written in a tmp folder by the tests; the runs are real tiny runs and a gallery
trace of the default pair."""
from __future__ import annotations

import html
import json
from pathlib import Path

import pytest
import torch

from engine.core.trace import load_run
from engine.measure import gpu_tables
from engine.measure.gpu_tables import GpuTable, GpuTableError, load, load_tables, parse, predict, save
from engine.models import tiny_random_pair
from engine.models.loading import calibrate_pair
from engine.recipe import RunSpec, generate
from treeviz.figures.charts import NO_GPU_TABLE, cost_figure, gpu_note
from treeviz.page.views import baseline_views

RUNGS = (1, 2, 4, 8, 16, 32, 64)
GALLERY = Path(__file__).resolve().parents[1] / "assets" / "traces" / "default_code_dynatree_cpu.json"


def linear(base: float, per_row: float) -> dict[int, float]:
    """Seconds that grow linearly in rows: interpolation between (and past) the rungs is then exact."""
    return {r: base + per_row * r for r in RUNGS}


def table(target="tiny-random", draft="tiny-random-related", gpu="Test GPU 80GB", overhead=0.001) -> GpuTable:
    return GpuTable(gpu=gpu, measured="2026-12-01", torch="2.13.0+cu130", transformers="5.23.0", dtype="bfloat16",
                    steps="cuda-graphs", prefix=300, target=target, draft=draft, target_s=linear(0.004, 1e-5),
                    draft_s=linear(0.003, 2e-5), overhead_s=overhead, source="a test")


def price(t: GpuTable, draft_rows: list[int], verify_rows: int) -> float:
    """The same iteration priced by hand from the linear tables above."""
    return (sum(0.003 + 2e-5 * r for r in draft_rows) + 0.004 + 1e-5 * verify_rows + (t.overhead_s or 0.0))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A real DynaTree run on the tiny related pair with its costs measured, so its records carry cost rows."""
    pair = tiny_random_pair("related", dtype=torch.float32)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TREEVIZ_CACHE", str(tmp_path_factory.mktemp("cache")))
        pair.costs = calibrate_pair(pair)
    spec = RunSpec(pair="tiny", prompt="def fib(n):\n    return", strategy="dynatree", max_new_tokens=24,
                   stop_on_eos=False)
    return generate(pair, spec)


# -- the file -------------------------------------------------------------------------------------------------------
def test_a_saved_table_loads_back_with_its_numbers(tmp_path):
    written = save(table(), tmp_path / "t.json")
    loaded = load(written)
    data = json.loads(written.read_text())
    assert data["schema"] == "treeviz-gpu-costs" and data["version"] == 1
    assert data["c"] == pytest.approx(0.00302 / 0.00401) and data["t"]["64"] == pytest.approx(0.00464 / 0.00401)
    assert loaded.target_s == table().target_s and loaded.draft_s == table().draft_s and loaded.file == "t.json"
    assert loaded.label == "prediction for Test GPU 80GB, measured 2026-12-01"
    assert load_tables(tmp_path) == [loaded]
    assert load_tables(tmp_path / "none") == [] and load_tables(tmp_path / "t.json") == []


@pytest.mark.parametrize("field, change, complaint", [
    ("c", 0.5, "'c' is 0.5"),
    ("t", {"1": 1.0, "2": 1.5}, "rungs of seconds.target"),
    ("gpu", "", "'gpu' must be a non-empty string"),
    ("measured", "yesterday", "date YYYY-MM-DD"),
    ("seconds", {"target": {"0": 1.0, "1": 1.0}, "draft": {"1": 1.0}}, "'0' is not a positive row count"),
    ("seconds", {"target": {"2": 1.0}, "draft": {"1": 1.0}}, "one-row rung"),
    ("seconds", {"target": {"1": -1.0}, "draft": {"1": 1.0}}, "must be a positive number"),
    ("overhead_s", -0.1, "overhead_s"),
    ("version", 2, "version 1"),
])
def test_a_broken_table_is_refused_naming_the_field(field, change, complaint):
    data = table().to_dict()
    data[field] = change
    with pytest.raises(GpuTableError, match="^broken.json: .*" + complaint.replace("(", r"\(")):
        parse(data, "broken.json")


def test_one_broken_file_stops_the_load(tmp_path):
    save(table(), tmp_path / "a.json")
    (tmp_path / "b.json").write_text("{not json")
    with pytest.raises(GpuTableError, match="b.json: not readable JSON"):
        load_tables(tmp_path)


def test_every_shipped_table_loads_and_was_measured_on_graphs():
    shipped = load_tables(gpu_tables.GPU_DIR)  # raises on a broken file
    assert all(t.steps == "cuda-graphs" for t in shipped), "a CPU dry run's table was shipped"
    assert gpu_tables.shipped() == shipped


# -- finding a run's table --------------------------------------------------------------------------------------
def test_tables_find_a_run_by_its_models_names():
    qwen = table("qwen2.5-1.5b", "qwen2.5-0.5b")
    assert qwen.matches("Qwen2.5-Coder-1.5B-Instruct (GGUF, offline)", "Qwen2.5-Coder-0.5B-Instruct (GGUF, offline)")
    assert qwen.matches("qwen2.5-1.5b shape, random weights (timing only)", "Qwen/Qwen2.5-0.5B-Instruct")
    assert not qwen.matches("Qwen2.5-Coder-0.5B-Instruct", "Qwen2.5-Coder-1.5B-Instruct")  # swapped
    assert not qwen.matches("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct")
    pythia = table("pythia-2.8b", "pythia-70m")
    assert gpu_tables.find([pythia, qwen], "EleutherAI/pythia-2.8b", "EleutherAI/pythia-70m-deduped") is pythia
    assert gpu_tables.find([pythia, qwen], "tiny-random (Qwen2, 2 layers, seed 0)", "x") is None
    assert gpu_tables.find([pythia, qwen], "EleutherAI/pythia-2.8b", None) is None  # AR: no draft to price


# -- pricing a run --------------------------------------------------------------------------------------------------
def test_a_run_is_priced_from_its_own_rows(tiny_run):
    t = table()
    prediction = predict(t, tiny_run.iterations)
    rows = [(it.cost.draft_rows, it.cost.verify_rows) for it in tiny_run.iterations]
    assert all(it.cost is not None for it in tiny_run.iterations) and prediction.estimated == 0
    assert prediction.per_iteration == pytest.approx([price(t, d, v) for d, v in rows])
    assert prediction.tokens == len(tiny_run.output_ids) - 1 == 23  # the first token came from the prefill
    assert prediction.ar_seconds == pytest.approx(23 * t.target_s[1])
    assert prediction.speedup == pytest.approx(prediction.ar_seconds / sum(price(t, d, v) for d, v in rows))


def without_costs(run):
    """`run` as a pair without a measured cost table records it: no cost rows."""
    for it in run.iterations:
        it.cost = None
    return run


def test_records_without_costs_have_their_rows_estimated_from_the_tree():
    run = without_costs(load_run(GALLERY))  # the default pair's DynaTree run
    for it in run.iterations:
        draft_rows, verify_rows, estimated = gpu_tables.iteration_rows(it)
        assert estimated and verify_rows == it.drafted + 1 and len(draft_rows) == it.draft_forwards
        assert sum(draft_rows) == max(it.drafted, it.draft_forwards)
    prediction = predict(table("qwen2.5-1.5b", "qwen2.5-0.5b"), run.iterations)
    assert prediction.estimated == len(run.iterations) and prediction.tokens == len(run.output_ids) - 1


# -- the Costs view -----------------------------------------------------------------------------------------------
def title(figure) -> str:
    """The figure's title as plain text (its lines joined, HTML entities read back)."""
    return html.unescape((figure.layout.title.text or "").replace("<br>", " "))


def test_costs_view_says_plainly_when_no_table_is_shipped(tiny_run):
    assert NO_GPU_TABLE in title(cost_figure(tiny_run, None, []))
    assert "GPU" not in title(cost_figure(tiny_run))  # the figure alone, without the view's tables: no GPU line
    shown = title(baseline_views(tiny_run, None)["costs"])  # the page's view reads assets/gpu/
    assert (NO_GPU_TABLE in shown) == (not gpu_tables.shipped())


def test_costs_view_shows_the_runs_trees_priced_on_the_gpu(tiny_run, tmp_path):
    save(table(), tmp_path / "tiny.json")
    tables = load_tables(tmp_path)
    prediction = predict(tables[0], tiny_run.iterations)
    note = gpu_note(tiny_run, tables)
    assert note.startswith("prediction for Test GPU 80GB, measured 2026-12-01")
    assert f"{prediction.speedup:.2f}× AR" in note and f"{prediction.seconds * 1e3:.1f} ms" in note
    assert "1.00 ms of measured overhead" in note and "estimated" not in note
    figure = cost_figure(tiny_run, None, tables)
    assert note in title(figure)
    line = next(t for t in figure.data if t.name == "iteration, prediction for Test GPU 80GB, measured 2026-12-01")
    assert list(line.y) == pytest.approx([1e3 * s for s in prediction.per_iteration])


def test_costs_view_names_the_tables_shipped_for_other_pairs(tiny_run, tmp_path):
    save(table("pythia-2.8b", "pythia-70m"), tmp_path / "pythia.json")
    note = gpu_note(tiny_run, load_tables(tmp_path))
    assert note.startswith("GPU: tables are shipped for pythia-2.8b + pythia-70m; none for this run's models")
    assert not any((t.name or "").startswith("iteration, prediction") for t in
                   cost_figure(tiny_run, None, load_tables(tmp_path)).data)


def test_the_default_pairs_trace_gets_its_gpu_line_with_or_without_cost_records(tmp_path):
    save(table("qwen2.5-1.5b", "qwen2.5-0.5b", overhead=None), tmp_path / "qwen.json")
    recorded = cost_figure(load_run(GALLERY), None, load_tables(tmp_path))
    assert "prediction for Test GPU 80GB, measured 2026-12-01" in title(recorded)
    assert recorded.layout.title.text.startswith(cost_figure(load_run(GALLERY)).layout.title.text + "<br>")
    assert "no cost record" not in title(recorded) and "measured overhead" not in title(recorded)
    run = without_costs(load_run(GALLERY))
    figure = cost_figure(run, None, load_tables(tmp_path))
    assert title(figure).startswith("prediction for Test GPU 80GB")
    assert f"{len(run.iterations)} iterations have no cost record" in title(figure)
    assert "no cost records in this run" in figure.layout.annotations[-1].text
