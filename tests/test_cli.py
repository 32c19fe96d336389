"""The command line on the tiny pair: JSON fields the issue promises, the bench table, clear errors."""
import json
from pathlib import Path

import pytest

from engine.bench.tables import run_method
from engine.cli import main, strategy_docs
from engine.core.trace import SCHEMA_VERSION, load_run
from engine.strategies import STRATEGIES, StrategyError


def test_generate_writes_json_with_metrics_and_comparison(tmp_path, capsys):
    out = tmp_path / "run.json"
    code = main(["generate", "--pair", "tiny-random", "--capture", "off", "--strategy", "dynatree", "--budget", "8", "--prompt",
                 "hello world", "--max-new-tokens", "24", "--no-eos", "--compare-ar", "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert len(data["output_ids"]) == 24 and isinstance(data["output_text"], str)
    for key in ("tokens_per_s", "speedup_vs_ar", "mean_tokens_per_iter", "mean_accepted_len", "acceptance_rate",
                "iterations", "ttft_s", "tpot_s"):
        assert key in data["metrics"], key
    assert data["exact_match"] is True
    assert data["iterations"] and data["iterations"][0]["nodes"][0]["status"] == "root"
    assert data["schema_version"] == SCHEMA_VERSION


def test_compare_ar_warms_up_and_interleaves(monkeypatch, capsys):
    """--compare-ar: a short warm-up run of AR and of the method, then AR and the method alternately
    --compare-repeats times; the fastest of each is compared, and the summary says so."""
    from engine.bench import tables as bench
    calls = []
    real = bench.generate

    def spy(pair, spec, verifier=None):
        calls.append((spec.strategy, spec.max_new_tokens))
        return real(pair, spec, verifier)

    monkeypatch.setattr(bench, "generate", spy)
    assert main(["generate", "--pair", "tiny-random", "--dtype", "fp32", "--capture", "off", "--strategy", "linear", "--prompt", "hello",
                 "--max-new-tokens", "12", "--no-eos", "--compare-ar", "--compare-repeats", "2"]) == 0
    assert calls == [("ar", 8), ("linear", 8), ("ar", 12), ("linear", 12), ("ar", 12), ("linear", 12)]
    err = capsys.readouterr().err
    assert "vs AR: speedup" in err and "the fastest of 2 runs of each, alternating with AR" in err
    assert "exact match True" in err


def test_bench_prints_table_and_json(tmp_path, capsys):
    """The default bench on a CPU with a C++ compiler: captured steps (built once per machine), every AR beside the
    methods (the engine's loop on them, the same loop eager, the captured one-row step in a bare loop, AR through
    torch.compile), in fp32 exactly AR's tokens, and every speedup divided by the fastest AR."""
    out = tmp_path / "bench.json"
    code = main(["bench", "--pair", "tiny-random", "--dtype", "fp32", "--strategies",
                 "ar,linear,dynatree,dynatree/eager,hf-assisted", "--prompt-set", "code", "--limit", "2",
                 "--max-new-tokens", "12", "--json", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    assert "hf-assisted" in table and "dynatree" in table and "speedup" in table
    assert "speedup = tok/s ÷ the faster AR on the set: code ar" in table
    report = json.loads(out.read_text())
    rows = {r["method"]: r for r in report["rows"]}
    assert set(rows) == {"ar", "ar-eager", "ar-captured", "ar-compiled", "linear", "dynatree", "dynatree/eager",
                         "hf-assisted"}
    assert all(r["exact_match_rate"] == 1.0 for r in rows.values())
    assert rows["ar-captured"]["tpot_s"] > 0 and rows["ar-captured"]["ttft_s"] > 0
    assert report["config"]["preset"] == "auto"  # the default: sizes from this machine's measured costs
    ars = ("ar", "ar-eager", "ar-captured", "ar-compiled")
    baseline = rows["ar"]["baseline"]
    assert baseline in ars and rows[baseline]["speedup"] == 1.0 and max(rows[a]["speedup"] for a in ars) == 1.0
    for r in rows.values():
        assert r["speedup"] == r["tokens_per_s"] / rows[baseline]["tokens_per_s"]
    with pytest.raises(SystemExit):  # argparse refuses an unknown mode before anything loads
        main(["bench", "--pair", "tiny-random", "--compiled-ar", "sometimes"])


def test_bench_without_captured_steps_runs_ar_through_torch_compile(tmp_path, capsys):
    """--capture off: no captured one-row step, so AR at its fastest is AR through torch.compile (ar-compiled)."""
    out = tmp_path / "bench.json"
    assert main(["bench", "--pair", "tiny-random", "--dtype", "fp32", "--capture", "off", "--strategies", "ar,linear",
                 "--prompt-set", "code", "--limit", "1", "--max-new-tokens", "8", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {r["method"]: r for r in report["rows"]}
    assert set(rows) == {"ar", "ar-compiled", "linear"} and report["config"]["compiled_ar_compile_s"] > 0
    assert rows["ar-compiled"]["exact_match_rate"] == 1.0


def test_default_preset_is_auto_unless_a_size_is_typed(tmp_path):
    """No --preset: `auto`; but a size knob `auto` would retune, typed by hand, means that fixed size (`cpu`)."""
    import argparse
    from engine.cli import _preset
    bare = argparse.Namespace(preset=None, param_budget=None, param_n=None, param_k=None, param_depth=None)
    assert _preset(bare, ["dynatree"]) == "auto" and _preset(bare, ["ar", "salf"]) == "auto"
    assert _preset(argparse.Namespace(**{**vars(bare), "param_budget": 8}), ["dynatree"]) == "cpu"
    assert _preset(argparse.Namespace(**{**vars(bare), "param_depth": 3}), ["dynatree"]) == "auto"  # not a size knob
    assert _preset(argparse.Namespace(**{**vars(bare), "preset": "paper", "param_budget": 8}), ["dynatree"]) == "paper"
    out = tmp_path / "run.json"
    assert main(["generate", "--pair", "tiny-random", "--dtype", "fp32", "--capture", "off", "--strategy", "dynatree", "--prompt", "hello",
                 "--max-new-tokens", "16", "--no-eos", "--compare-ar", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["exact_match"] is True
    assert all(it["cost"]["auto"] for it in data["iterations"])  # the sizer ran every iteration


def test_bad_input_gives_a_clear_error(capsys):
    assert main(["generate", "--pair", "tiny-random", "--strategy", "nope", "--prompt", "x"]) == 2
    assert "unknown strategy" in capsys.readouterr().err
    assert main(["generate", "--pair", "tiny-random", "--strategy", "linear", "--budget", "3", "--prompt", "x"]) == 2
    assert "does not take --budget" in capsys.readouterr().err
    assert main(["generate", "--pair", "tiny-random", "--prompt", "   "]) == 2
    assert "empty" in capsys.readouterr().err
    assert main(["generate", "--target", "/no/such/dir", "--draft", "/no/such/dir", "--prompt", "x"]) == 2
    assert "error:" in capsys.readouterr().err
    assert main(["generate", "--pair", "tiny-random", "--prompt", "x", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_strategy_tables_match_the_declarations():
    page = (Path(__file__).resolve().parent.parent / "docs" / "strategies.md").read_text()
    assert strategy_docs() in page, "docs/strategies.md parameter tables are stale: run python -m scripts.update_readme"


def test_compile_probe_times_a_compiled_tree_forward_that_equals_the_eager_one(tmp_path):
    import subprocess
    import sys
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "probe.json"
    proc = subprocess.run([sys.executable, "-m", "scripts.lab.compile_probe", "--pair", "tiny-random",
                           "--dtype", "fp32", "--rows", "3", "--prefix", "16", "--repeats", "1", "--mode", "default",
                           "--variants", "shipped:64,gqa:128,sdpa:384",
                           "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    [row] = json.loads(out.read_text())["rows"]
    assert row["rows"] == 3 and row["eager_ms"] > 0
    assert [(v["attention"], v["cache_len"]) for v in row["variants"]] == [("shipped", 64), ("gqa", 128),
                                                                           ("sdpa", 384)]
    for variant in row["variants"]:  # 19 positions filled: the masked, unfilled rest of each cache counts too
        assert variant["compiled_ms"] > 0
        assert variant["max_abs_diff"] < 1e-3  # fp32: the compiled forward under the tree mask gives eager's logits


def test_compile_probe_dynamic_serves_every_row_count_with_one_graph(tmp_path):
    """--dynamic: one compiled graph (the row count symbolic) serves 2 and 3 rows, each giving eager's fp32 logits."""
    import subprocess
    import sys
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "dynamic.json"
    proc = subprocess.run([sys.executable, "-m", "scripts.lab.compile_probe", "--pair", "tiny-random", "--dtype", "fp32",
                           "--rows", "2,3", "--dynamic", "--prefix", "16", "--repeats", "1", "--mode", "default",
                           "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["graphs"] == 1 and [r["rows"] for r in result["rows"]] == [2, 3]
    for row in result["rows"]:
        assert row["eager_ms"] > 0 and row["compiled_ms"] > 0
        assert row["max_abs_diff"] < 1e-3


def test_linear_kernels_probe_compares_onednn_and_inductor_on_one_shape(tmp_path):
    """Both kernels compute the same fp32 GEMM: their outputs differ by no more than fp32 sums of 32 products of
    magnitude <= |x|max * |w|max can (a bound from the reduction length, not from one machine's run)."""
    import subprocess
    import sys
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "linear.json"
    proc = subprocess.run([sys.executable, "-m", "scripts.lab.linear_kernels", "--shape", "64x32", "--rows", "1,3",
                           "--copies", "2", "--dtype", "fp32", "--repeats", "2", "--mode", "default",
                           "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["rows"] for r in rows] == [1, 3]
    import torch
    # x ~ N(0,1) and w ~ 0.02 N(0,1) from seed 0: |x| < 6 and |w| < 0.12 for these sizes; two summation orders of 32 products
    # differ by at most 2 * 32 * eps(fp32) * sum |x w|
    bound = 2 * 32 * torch.finfo(torch.float32).eps * 32 * 6 * 0.12
    for r in rows:
        assert r["onednn_us"] > 0 and r["compiled_us"] > 0 and r["onednn_gbs"] > 0
        assert r["max_abs_diff"] <= bound


def test_format_kernels_probe_times_each_format_the_engine_makes(tmp_path):
    """Each weight-only format's kernel, in fp32, multiplies by the weight the format stands for: its output differs
    from x @ dequantized(w).T by no more than two fp32 summation orders of 64 products can."""
    import subprocess
    import sys
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "formats.json"
    proc = subprocess.run([sys.executable, "-m", "scripts.lab.format_kernels", "--shape", "32x64",
                           "--formats", "plain,packed,int8,int4", "--threads", "1", "--copies", "2",
                           "--dtype", "fp32", "--repeats", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["formats"]
    assert [r["format"] for r in rows] == ["plain", "packed", "int8", "int4"]
    import torch
    # x ~ N(0,1) from seed 0: |x| < 6 over 64 values; nn.Linear's init keeps |w| <= 1/8, a quantised copy within
    # one step of its group's range (< 0.14)
    bound = 2 * 64 * torch.finfo(torch.float32).eps * 64 * 6 * 0.14
    for r in rows:
        assert r["us_1"] > 0 and r["gbs_1"] > 0 and r["gigabytes"] > 0
        assert r["max_abs_diff"] <= bound, r
    sizes = {r["format"]: r["gigabytes"] for r in rows}
    assert sizes["int4"] < sizes["int8"] < sizes["plain"]  # what each format streams, as the cost table counts it


def test_captured_attention_probe_runs_the_eager_kernel_in_the_package(tmp_path):
    """The folded form compiled into a package calls the kernel eager calls on the same inputs: its output equals
    eager's bit for bit (the kernel splits work by query length only, so both take the same order); every variant
    is timed at both shapes."""
    import subprocess
    import sys
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "attention.json"
    proc = subprocess.run([sys.executable, "-m", "scripts.lab.captured_attention", "--rows", "2", "--lengths", "400",
                           "--repeats", "2", "--json", str(out)], capture_output=True, text=True, timeout=900,
                          cwd=root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [(r["model"], r["rows"], r["length"]) for r in rows] == [("draft", 2, 400), ("target", 2, 400)]
    for r in rows:
        assert r["folded-flash_diff"] == 0
        assert all(r[f"{name}_us"] > 0 for name in ("eager", "math", "flash", "folded-math", "folded-flash"))


def test_rules_bench_script_measures_every_rule(tmp_path):
    import subprocess
    import sys
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "rules.json"
    proc = subprocess.run([sys.executable, str(root / "scripts" / "rules_bench.py"), "--pair", "tiny-random",
                           "--prompt-set", "code", "--limit", "1", "--max-new-tokens", "6", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    rules = {r["rule"] for r in rows}
    assert {"naive", "block", "naive_tree", "specinfer", "spectr", "khisti", "traversal", "token_matching"} <= rules
    assert {r["temperature"] for r in rows} == {0.6, 1.0}
    assert all(r["block_efficiency"] >= 1.0 and r["tokens_per_s"] > 0 for r in rows)
    for r in rows:  # the i.i.d. top-down rules record their acceptance next to Appendix C's rate at each branching
        if r["rule"] in ("specinfer", "spectr", "khisti", "naive_tree") and r["tree"].startswith("iid"):
            assert r["branching_nodes"] > 0 and 0 <= r["alpha_measured"] <= 1 and 0 <= r["alpha_theory"] <= 1
    assert "T=0.6" in proc.stdout and "T=1.0" in proc.stdout


def test_costs_command_prints_the_table(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TREEVIZ_CACHE", str(tmp_path))
    out = tmp_path / "costs.json"
    code = main(["costs", "--pair", "tiny-random", "--dtype", "fp32", "--capture", "off", "--packed-weights", "on", "--draft-quant",
                 "int8", "--json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    for needle in ("target  routed", "draft   routed", "t(16)=", "c = draft step / target step", "routing target:",
                   "formats draft (probe", "int8", "GB/s", "streaming read"):
        assert needle in text, needle
    data = json.loads(out.read_text())
    assert data["c"] > 0 and set(data["draft"]["seconds"]) == {"routed"}  # timed as routed per shape group


def test_bench_with_cheap_draft_and_auto_preset(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TREEVIZ_CACHE", str(tmp_path))
    out = tmp_path / "bench.json"
    code = main(["bench", "--pair", "tiny-random", "--dtype", "fp32", "--compiled-ar", "off", "--capture", "off", "--strategies",
                 "ar,dynatree", "--preset", "auto", "--draft-vocab", "128", "--draft-quant", "int4", "--prompt-set",
                 "code", "--limit", "1", "--max-new-tokens", "12", "--json", str(out)])
    assert code == 0
    assert "AR GB/s" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["config"]["draft_vocab"] == 128 and report["config"]["draft_quant"] == "int4"
    assert all(r["ar_gbps"] > 0 for r in report["rows"]) and report["config"]["preset"] == "auto"


def test_bench_compares_presets_of_one_strategy(tmp_path, monkeypatch, capsys, related_pair):
    """strategy@preset rows run on the same prompts as the others; an unknown preset is refused before loading."""
    monkeypatch.setenv("TREEVIZ_CACHE", str(tmp_path))
    out = tmp_path / "bench.json"
    code = main(["bench", "--pair", "tiny-random", "--dtype", "fp32", "--compiled-ar", "off", "--capture", "off", "--strategies",
                 "ar,linear,linear@paper", "--prompt-set", "code", "--limit", "1", "--max-new-tokens", "12",
                 "--json", str(out)])
    assert code == 0
    assert [r["method"] for r in json.loads(out.read_text())["rows"]] == ["ar", "linear", "linear@paper"]
    paper, cpu = (STRATEGIES["linear"].preset_values(p)["k"] for p in ("paper", "cpu"))
    assert paper != cpu  # otherwise this test could not tell the presets apart
    assert run_method(related_pair, "linear@paper", "def f(x):", 4)["result"].params["k"] == paper
    assert run_method(related_pair, "linear", "def f(x):", 4, preset="cpu")["result"].params["k"] == cpu
    assert main(["bench", "--pair", "tiny-random", "--strategies", "ar,linear@fast"]) != 0
    assert "linear has no preset 'fast'" in capsys.readouterr().err


def test_compile_probe_refuses_variants_that_would_share_a_graph():
    """Two compiled variants on same-sized caches would silently share one graph (and one cache): refused."""
    import subprocess
    import sys
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-m", "scripts.lab.compile_probe", "--pair", "tiny-random",
                           "--variants", "shipped:384,sdpa:384"], capture_output=True, text=True, timeout=120, cwd=root)
    assert proc.returncode != 0 and "its own cache length" in proc.stderr


def test_lookup_runs_on_the_target_alone(tmp_path, capsys):
    """--draft none loads the target alone: lookup runs (exactly AR's tokens, its nodes marked "lookup"), a strategy
    that needs a draft is refused."""
    out = tmp_path / "run.json"
    prompt = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"
    code = main(["generate", "--pair", "tiny-random", "--draft", "none", "--dtype", "fp32", "--capture", "off", "--strategy", "lookup",
                 "--min-match", "1", "--prompt", prompt, "--max-new-tokens", "16", "--no-eos", "--compare-ar",
                 "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["exact_match"] is True and data["config"]["draft"] is None
    sources = {n["source"] for it in data["iterations"] for n in it["nodes"]}
    assert "lookup" in sources and "model" not in sources
    assert set(data["metrics"]["acceptance_by_source"]) == {"lookup"}
    assert main(["generate", "--pair", "tiny-random", "--draft", "none", "--strategy", "dynatree", "--prompt",
                 "x"]) != 0
    assert "needs a draft model" in capsys.readouterr().err


def test_bench_grounded_set_with_lookup_peers_and_a_grafted_method(tmp_path, capsys):
    """lookup, hf-prompt-lookup and dynatree beside dynatree+lookup (the graft switched on for that method alone) on
    the grounded prompts, all exactly AR's tokens in fp32; an unknown switch is refused before loading."""
    out = tmp_path / "bench.json"
    code = main(["bench", "--pair", "tiny-random", "--dtype", "fp32", "--compiled-ar", "off", "--capture", "off", "--strategies",
                 "ar,lookup,hf-prompt-lookup,dynatree,dynatree+lookup", "--prompt-set", "grounded", "--limit", "1",
                 "--max-new-tokens", "12", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    rows = {r["method"]: r for r in report["rows"]}
    assert list(rows) == ["ar", "lookup", "hf-prompt-lookup", "dynatree", "dynatree+lookup"]
    assert all(r["exact_match_rate"] == 1.0 and r["prompt_set"] == "grounded" for r in rows.values())
    assert set(rows["dynatree"]["acceptance_by_source"]) == {"model"}
    assert set(rows["lookup"]["acceptance_by_source"]) <= {"lookup"}  # no model nodes (none at all on a short run)
    assert "hf-prompt-lookup" in capsys.readouterr().out
    assert main(["bench", "--pair", "tiny-random", "--strategies", "ar,dynatree+lokup"]) != 0
    assert "dynatree has no switch 'lokup'" in capsys.readouterr().err


def test_bench_help_lists_the_grounded_set_and_the_lookup_peer(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "grounded" in text and "hf-prompt-lookup" in text and "dynatree+lookup" in text


def test_method_names_turn_switches_on_and_off_and_set_values():
    from engine.bench.tables import method_params, split_method
    assert split_method("dynatree+lookup-history@auto") == ("dynatree", "auto")
    assert split_method("dynatree:a_star=0.5@paper") == ("dynatree", "paper")
    assert method_params("dynatree+lookup-history@auto") == {"lookup": True, "history": False}
    assert method_params("dynatree-history") == {"history": False}
    assert method_params("dynatree-history:a_star=0.55:d0=3@cpu") == {"history": False, "a_star": 0.55, "d0": 3}
    assert method_params("ar-compiled") == {} and method_params("hf-prompt-lookup") == {}
    assert split_method("dynatree-history@auto/eager/device") == ("dynatree", "auto")
    assert method_params("dynatree-history@auto/eager/device") == {"history": False}
    with pytest.raises(StrategyError, match="no switch 'budget'"):
        method_params("dynatree-budget")  # a number is not a switch
    with pytest.raises(StrategyError, match="above its maximum"):
        method_params("dynatree:a_star=1.5")
    with pytest.raises(StrategyError, match="not name=value"):
        method_params("dynatree:nonsense=1")


def test_a_bench_method_runs_with_its_own_values(related_pair):
    """Two values of one parameter in one bench, interleaved: each run carries its own."""
    from engine.bench.tables import run_method
    low = run_method(related_pair, "dynatree:budget=3:d0=1", "abcab", 6)["result"]
    high = run_method(related_pair, "dynatree-history:budget=9", "abcab", 6)["result"]
    assert max(it.drafted for it in low.iterations) <= 3 < max(it.drafted for it in high.iterations)
    assert low.params["budget"] == 3 and high.params["history"] is False


def test_bench_runs_a_method_without_a_preset_on_the_default_one_whatever_the_last_method_names(monkeypatch):
    """`--strategies fixed,fixed@auto`: `fixed` runs the command's preset (cpu), not the last method's (auto). The
    loop checking the methods once rebound the default preset to the last method's, so every plain method ran at
    `auto` whenever the list ended with an `@auto` method."""
    import engine.bench.tables
    import engine.cli
    seen = {}

    def fake_bench(pair, methods, prompt_set, max_new_tokens, repeats, limit, preset, params, **kwargs):
        seen["preset"] = preset
        return {"rows": [], "config": {}}

    def fake_configuration(args, pair, preset):
        seen["named"] = preset
        return {"differs_from_app": ["capture", "preset"], "flags": {"capture": "off", "preset": preset}, "ran": {},
                "draft": None}

    monkeypatch.setattr(engine.bench.tables, "bench", fake_bench)
    monkeypatch.setattr(engine.cli, "_load", lambda args: None)
    monkeypatch.setattr(engine.cli, "_configuration", fake_configuration)
    assert main(["bench", "--pair", "tiny-random", "--capture", "off", "--preset", "cpu", "--strategies", "ar,fixed,fixed@auto"]) == 0
    assert seen["preset"] == "cpu" and seen["named"] == "cpu"  # the report names the preset the bench ran


# -- one configuration everywhere: the command line runs what the app runs, and every report names it --------------

class _Loaded(Exception):
    """Raised by a stand-in load_pair once it has recorded how it was called."""


def _load_call(monkeypatch, module, argv_or_load) -> dict:
    """The keyword arguments one load_pair call receives (every default filled in), stopping before any model loads."""
    import inspect

    from engine.models.loading import load_pair  # the real one: engine.models' may be a stand-in by now
    defaults = {k: p.default for k, p in inspect.signature(load_pair).parameters.items()
                if p.default is not inspect.Parameter.empty}
    seen = {}

    def record(target, draft, **kwargs):
        seen.update({**defaults, **kwargs, "target": target, "draft": draft})
        raise _Loaded

    monkeypatch.setattr(module, "load_pair", record)
    if callable(argv_or_load):
        argv_or_load()
    else:
        with pytest.raises(_Loaded):
            main(argv_or_load)
    seen.pop("progress", None)
    return seen


def test_every_command_loads_the_pair_as_the_app_does(monkeypatch):
    """generate, bench and costs with no flag but the pair call load_pair exactly as the app loads its pair (dtype,
    kernels, draft vocabulary, draft formats, captured steps, calibration), and size trees with the app's preset."""
    import importlib

    import engine.models
    from engine.bench.configuration import APP_CONFIGURATION
    from engine.cli import _preset, build_parser
    from treeviz.serving import pairs as app_pairs
    monkeypatch.delenv("TREEVIZ_CAPTURE", raising=False)  # the tests' own setting, not the app's default
    manager = app_pairs.PairManager(capture=importlib.import_module("app").parse_args([]).capture)
    app = _load_call(monkeypatch, app_pairs, lambda: manager.load("tiny-random"))
    assert manager.error and app["draft_quant"] == "auto" and app["draft_vocab"] == "auto"
    commands = {"generate": ["--prompt", "x"], "bench": [], "costs": []}
    for command, extra in commands.items():
        cli = _load_call(monkeypatch, engine.models, [command, "--pair", "tiny-random", *extra])
        assert cli == app, command
        args = build_parser().parse_args([command, "--pair", "tiny-random", *extra])
        assert {k: getattr(args, k) for k in APP_CONFIGURATION if k != "preset"} == {
            "dtype": "auto", "packed_weights": "auto", "draft_vocab": "auto", "draft_quant": "auto", "fuse_draft": "on",
            "capture": "auto"}
        assert _preset(args, ["dynatree"]) == APP_CONFIGURATION["preset"] == "auto"


def test_generate_names_the_configuration_it_ran(tmp_path, capsys):
    """The printed header and the --json trace's config name each knob as asked and as it ran; --capture off (kept
    off here: building the packages takes minutes) is named as the one flag that is not the app's."""
    out = tmp_path / "run.json"
    assert main(["generate", "--pair", "tiny-random", "--capture", "off", "--prompt", "hello", "--max-new-tokens", "8",
                 "--no-eos", "--json", str(out)]) == 0
    err = capsys.readouterr().err
    assert "configuration: differs from the app's in --capture off (the app's: auto): dtype auto → " in err
    assert "draft vocabulary auto → full; draft formats auto → " in err and "; preset auto" in err
    data = json.loads(out.read_text())
    named = data["config"]["configuration"]
    assert named["flags"] == {"dtype": "auto", "packed_weights": "auto", "draft_vocab": "auto", "draft_quant": "auto",
                              "fuse_draft": "on", "capture": "off", "preset": "auto"}
    assert named["ran"]["fuse_draft"] == "q|k|v, gate|up"  # a CPU load stacks the draft's projections
    assert named["differs_from_app"] == ["capture"] and named["app"] is False
    assert named["ran"]["dtype"] == data["config"]["dtype"] and named["ran"]["capture"] == "eager"
    assert named["ran"]["draft_vocab"] == "full"  # tiny-random's tokenizer has no committed frequency table
    assert set(named["routing"]) == {"target", "draft"}
    assert load_run(out).config.dtype == data["config"]["dtype"]  # the trace still loads


def test_flags_pick_another_configuration_and_fp32_is_exact(tmp_path, capsys):
    """Every knob set by flag: the draft keeps no quantised format, the preset is cpu, and the header and the trace
    list every flag that is not the app's. fp32 is the exact mode: the tree's output equals AR's token for token."""
    out = tmp_path / "run.json"
    assert main(["generate", "--pair", "tiny-random", "--dtype", "fp32", "--packed-weights", "off", "--draft-vocab",
                 "128", "--draft-quant", "none", "--capture", "off", "--preset", "cpu", "--prompt", "def f(x):",
                 "--max-new-tokens", "24", "--no-eos", "--compare-ar", "--json", str(out)]) == 0
    err = capsys.readouterr().err
    assert ("configuration: differs from the app's in --dtype fp32 (the app's: auto), --packed-weights off (the app's: "
            "auto), --draft-vocab 128 (the app's: auto), --draft-quant none (the app's: auto), --capture off (the "
            "app's: auto), --preset cpu (the app's: auto): dtype fp32 → float32;") in err
    data = json.loads(out.read_text())
    named = data["config"]["configuration"]
    assert named["differs_from_app"] == ["dtype", "packed_weights", "draft_vocab", "draft_quant", "capture", "preset"]
    assert named["ran"]["draft_vocab"] == 128 and named["ran"]["draft_quant"] == "plain"
    assert data["config"]["dtype"] == "float32" and data["exact_match"] is True
    assert "exact match True" in err


def test_bench_and_costs_reports_name_the_configuration(tmp_path, capsys):
    """The bench's table opens with the configuration and its JSON carries it, beside each method's agreement with
    AR per prompt set; costs prints and writes it too (no preset: costs sizes no tree)."""
    out = tmp_path / "bench.json"
    assert main(["bench", "--pair", "tiny-random", "--dtype", "fp32", "--capture", "off", "--compiled-ar", "off",
                 "--strategies", "ar,dynatree", "--prompt-set", "code", "--limit", "2", "--max-new-tokens", "8",
                 "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert table.startswith("configuration: differs from the app's in --dtype fp32 (the app's: auto), --capture off")
    assert "draft formats auto → " in table.splitlines()[0] and "agreement with AR" in table
    assert table.count("1.00 (2/2)") == 2  # fp32: both methods equal AR on both prompts
    report = json.loads(out.read_text())
    assert report["config"]["configuration"]["flags"]["draft_quant"] == "auto"
    assert report["config"]["configuration"]["differs_from_app"] == ["dtype", "capture"]
    assert [(r["agreement_with_ar"], r["agreed_runs"]) for r in report["rows"]] == [(1.0, 2), (1.0, 2)]
    costs = tmp_path / "costs.json"
    assert main(["costs", "--pair", "tiny-random", "--capture", "off", "--json", str(costs)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("configuration: differs from the app's in --capture off") and "preset" not in first
    named = json.loads(costs.read_text())["configuration"]
    assert named["flags"]["draft_vocab"] == "auto" and named["flags"]["preset"] is None
