"""The command line on the tiny pair: JSON fields the issue promises, the bench table, clear errors."""
import json
from pathlib import Path

from engine.cli import main, strategy_docs


def test_generate_writes_json_with_metrics_and_comparison(tmp_path, capsys):
    out = tmp_path / "run.json"
    code = main(["generate", "--pair", "tiny-random", "--strategy", "dynatree", "--budget", "8", "--prompt",
                 "hello world", "--max-new-tokens", "24", "--no-eos", "--compare-ar", "--json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert len(data["output_ids"]) == 24 and isinstance(data["output_text"], str)
    for key in ("tokens_per_s", "speedup_vs_ar", "mean_tokens_per_iter", "mean_accepted_len", "acceptance_rate",
                "iterations", "ttft_s", "tpot_s"):
        assert key in data["metrics"], key
    assert data["exact_match"] is True
    assert data["iterations"] and data["iterations"][0]["nodes"][0]["status"] == "root"
    assert data["schema_version"] == 1


def test_bench_prints_table_and_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(["bench", "--pair", "tiny-random", "--strategies", "ar,linear,dynatree,hf-assisted",
                 "--prompt-set", "code", "--limit", "1", "--max-new-tokens", "12", "--json", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    assert "hf-assisted" in table and "dynatree" in table and "speedup" in table
    rows = json.loads(out.read_text())["rows"]
    assert {r["method"] for r in rows} == {"ar", "linear", "dynatree", "hf-assisted"}
    assert next(r for r in rows if r["method"] == "ar")["speedup"] == 1.0


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


def test_readme_strategy_tables_match_the_declarations():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert strategy_docs() in readme, "README parameter tables are stale: run python scripts/update_readme.py"


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
    assert "T=0.6" in proc.stdout and "T=1.0" in proc.stdout
