"""The GPU check (scripts/gpu_check) through its production entry point: the CPU dry run (`--device cpu --quick`)
runs every section on tiny models and writes a report whose results are real (every strategy's tokens equal AR's,
which this test recomputes), a table the app's loader reads, the app's requests and a forked ZeroGPU-style request;
the budget skips what does not fit, with the reason; a section that raises is recorded and the next one runs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.measure.gpu_tables import load
from engine.models import tiny_random_pair
from engine.recipe import RunSpec, generate
from engine.strategies import STRATEGIES
from scripts.gpu_check.__main__ import SECTIONS, parse
from scripts.gpu_check.report import Context, Report, Section, run_sections

ROOT = Path(__file__).resolve().parents[1]


def check(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scripts.gpu_check", "--out", str(out), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    done = check(out, "--device", "cpu", "--quick")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return out, json.loads((out / "report.json").read_text())


def test_dry_run_runs_every_section_and_says_so(dry_run):
    out, report = dry_run
    sections = report["sections"]
    assert list(sections) == [s.name for s in SECTIONS]
    for name, entry in sections.items():
        assert entry["status"] == "passed", (name, entry.get("error"))
        assert entry["seconds"] > 0 and entry["budget_s"] > 0 and entry["result"]["passed"] is True
    summary = (out / "summary.md").read_text()
    assert all(f"## {s.name}: passed" in summary for s in SECTIONS)
    assert report["device"]["type"] == "cpu" and "elapsed_s" in report and "says nothing" in report["verdict"]


def test_dry_run_tokens_equal_ar_for_every_strategy(dry_run):
    exact = dry_run[1]["sections"]["exact"]["result"]
    pair = tiny_random_pair("related", dtype=torch.float32)
    ar = generate(pair, RunSpec(pair="tiny", prompt=exact["prompt"], strategy="ar", max_new_tokens=exact["tokens"],
                                stop_on_eos=False, steps="dynamic", capture="off")).output_ids
    assert exact["ar"]["related"] == ar and len(ar) == exact["tokens"]
    assert set(exact["greedy"]) == set(STRATEGIES)
    for name, cases in exact["greedy"].items():
        assert {(c["pair"], c["graphs"]) for c in cases} == {(k, "off") for k in ("related", "identical", "unrelated")}
        for case in cases:
            assert case["output_ids"] == exact["ar"][case["pair"]], (name, case["pair"])
    for name, seeded in exact["seeded"].items():
        assert seeded["same_seed_same_output"] and seeded["outputs"]["off"] != ar, name  # sampled, not greedy
    tests = exact["pytest"]
    assert tests["returncode"] == 0 and tests["counts"]["passed"] > 0 and "failed" not in tests["counts"]


def test_dry_run_writes_a_table_the_app_reads(dry_run):
    out, report = dry_run
    fast = report["sections"]["fast"]["result"]
    (name, measured), = fast["pairs"].items()
    assert not measured["errors"] and measured["steps"] == "eager"
    table = load(Path(measured["table_file"]))
    assert Path(measured["table_file"]).parent == out / "gpu-tables" and "+" not in Path(measured["table_file"]).name
    assert table.steps == "eager" and table.gpu == report["device"]["name"] and table.target == "tiny-random"
    assert table.c == pytest.approx(measured["table"]["c"])
    tree = measured["end_to_end"]["dynatree"]
    assert tree["drafted_nodes"] == 16 and tree["iteration_ms"] > 0 and tree["break_even_lbar"] > 0
    assert fast["assumed_lbar"]["value"] > 1 and "bench-2026-11-25-captured.json" in fast["assumed_lbar"]["source"]


def test_dry_run_drives_the_app_requests_and_forked_requests(dry_run):
    """Run, Compare, Race and Sweep through treeviz/serving in process and, each, with its work in a forked child
    (no CUDA on a CPU), every one within the `duration` it asks for; the AR measured in a child reached the parent's
    cache, so the forked Compare asked for its methods alone."""
    app = dry_run[1]["sections"]["app"]["result"]
    requests = app["pairs"]["tiny-random"]
    assert {k for k, v in requests.items() if isinstance(v, dict)} == {"run", "compare", "race", "sweep"}
    for label in ("run", "compare", "race", "sweep"):
        row = requests[label]
        assert row["ok"] and row["pickled_bytes"] > 0 and 0 < row["seconds"] <= row["duration_estimate_s"], label
    assert requests["race"]["events"][-1] == "Raced" and requests["compare"]["events"].count("Finished") == 3
    forked = {row["request"]: row for row in app["zerogpu"]["requests"]}
    assert set(forked) == {"run", "compare", "race", "sweep"} and app["treeviz"].startswith("imported")
    for label, row in forked.items():
        assert row["exitcode"] == 0 and row["last_has_result"] and not row.get("failed"), (label, row)
        assert row["child"]["cuda_initialized"] is False and not row["cuda_initialized_in_parent_after"]
        assert 0 < row["seconds"] <= row["duration_estimate_s"], label
    assert forked["run"]["session_events"][-1] == "BaselineMeasured" and "ARMeasured" in forked["run"]["events"]
    assert "ARMeasured" not in forked["compare"]["events"]  # AR handed over from the parent's cache


def test_a_spent_budget_skips_sections_with_the_reason(tmp_path):
    done = check(tmp_path, "--device", "cpu", "--quick", "--sections", "exact,app", "--budget-s", "5")
    assert done.returncode == 0, done.stderr[-2000:]
    sections = json.loads((tmp_path / "report.json").read_text())["sections"]
    assert list(sections) == ["exact", "app"]
    for entry in sections.values():
        assert entry["status"] == "skipped" and entry["seconds"] == 0.0 and "of the 5 s budget left" in entry["reason"]
    assert "Skipped: " in (tmp_path / "summary.md").read_text()


def test_a_section_that_raises_is_recorded_and_the_next_still_runs(tmp_path):
    def broken(ctx: Context) -> dict:
        ctx.checkpoint({"done": 1})
        return {"ratio": 1 / 0}

    sections = (Section("broken", 60, 60, broken, lambda r: [f"done {r['done']}"], "raises"),
                Section("next", 60, 60, lambda ctx: {"passed": True, "left": ctx.left()}, lambda r: [], "passes"))
    header = {"started": "now", "device": {"type": "cpu", "name": "x", "torch": "t", "transformers": "t"},
              "quick": True, "budget_s": 100}
    report = Report(tmp_path, header, sections)
    statuses = run_sections(report, sections, 100, lambda name, deadline: Context(
        torch.device("cpu"), True, tmp_path, deadline, report, name))
    assert statuses == {"broken": "error", "next": "passed"}
    saved = json.loads((tmp_path / "report.json").read_text())["sections"]
    assert "ZeroDivisionError" in saved["broken"]["error"] and saved["broken"]["result"] == {"done": 1}
    assert 0 < saved["next"]["result"]["left"] <= 60
    assert "ZeroDivisionError" in (tmp_path / "summary.md").read_text()


def test_unknown_sections_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        parse(["--out", str(tmp_path), "--sections", "exact,gradio"])
    assert [s.name for s in parse(["--out", str(tmp_path), "--sections", "app,exact"]).sections] == ["exact", "app"]


def test_the_docs_list_every_section_with_its_budget():
    page = (ROOT / "docs" / "gpu.md").read_text()
    for section in SECTIONS:
        assert f"| {section.name} | {section.budget_s:.0f} s |" in page, f"docs/gpu.md: {section.name}'s budget"
    assert "--budget-s 500" in page and "timeout_s` 560" in page
