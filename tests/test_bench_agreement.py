"""Agreement with AR: the bench counts it per method and prompt set, prints it, and says what a rate below 1 means in
bf16 (rounding at near-ties, not a lossy rule; fp32 is the exact mode); the page's badge and the command line's
summary say the same in one line."""
from __future__ import annotations

from engine.bench.tables import agreement_cell, agreement_note, format_table, summarise
from engine.core.trace import Comparison
from engine.recipe import RunSpec, generate
from treeviz.figures.html import badge_html, output_match_html


def _row(method: str, agreed: int, runs: int, prompt_set: str = "code") -> dict:
    outs = [{"new_tokens": 10, "total_s": 1.0, "exact": i < agreed} for i in range(runs)]
    return summarise(prompt_set, method, outs, ar_tps=10.0)


def test_agreement_is_the_share_of_runs_equal_to_ar():
    row = _row("dynatree", 5, 9)
    assert row["agreement_with_ar"] == row["exact_match_rate"] == 5 / 9 and row["agreed_runs"] == 5
    assert agreement_cell(row) == "0.56 (5/9)"
    uncompared = summarise("code", "ar", [{"new_tokens": 4, "total_s": 1.0}], ar_tps=4.0)
    assert uncompared["agreement_with_ar"] is None and uncompared["agreed_runs"] is None
    assert agreement_cell(uncompared) == "-"


def test_the_table_prints_agreement_per_set_and_explains_it_in_bf16():
    rows = [_row("ar", 3, 3), _row("dynatree", 2, 3), _row("ar", 3, 3, "chat"), _row("dynatree", 3, 3, "chat")]
    bf16 = format_table({"config": {"dtype": "bfloat16"}, "rows": rows})
    lines = bf16.splitlines()
    assert lines[0].rstrip().endswith("agreement with AR")
    assert lines[3].startswith("code   dynatree") and lines[3].endswith("0.67 (2/3)")
    assert lines[5].startswith("chat   dynatree") and lines[5].endswith("1.00 (3/3)")
    assert "agreement with AR below 1 (code dynatree): in bfloat16" in bf16
    assert "near-tie" in bf16 and "no rule is lossy" in bf16 and "--dtype fp32 is the exact mode" in bf16
    fp32 = format_table({"config": {"dtype": "float32"}, "rows": rows})
    assert "unexpected" in fp32 and "near-tie" not in fp32  # in fp32 a difference is not rounding to shrug off
    agreeing = [_row("ar", 3, 3), _row("dynatree", 3, 3)]
    assert agreement_note(agreeing, "bfloat16") is None
    assert "below 1" not in format_table({"config": {"dtype": "bfloat16"}, "rows": agreeing})


def test_the_badge_says_what_a_bf16_difference_is():
    differs = Comparison(exact_match=False, first_divergence=7, compared_tokens=48, reference_margin=0.06)
    bf16 = badge_html(differs, dtype="bfloat16")
    assert "differs from AR from token 7" in bf16
    assert "bf16: a near-tie rounded apart by kernels of different row counts, not a lossy rule; fp32 (the Precision " \
           "switch) is the exact mode" in bf16
    assert "fp16: a near-tie" in output_match_html(differs, False, "float16")
    assert "near-tie rounded" not in badge_html(differs, dtype="float32")
    assert "near-tie rounded" not in badge_html(differs)  # a trace that does not say its dtype
    assert "near-tie rounded" not in badge_html(Comparison(exact_match=True, compared_tokens=48), dtype="bfloat16")
    assert "near-tie rounded" not in badge_html(differs, sampled=True, dtype="bfloat16")


def test_the_page_and_the_command_line_pass_the_runs_dtype(related_pair):
    """The page's badge reads the run's own dtype (views.baseline_views), and generate --compare-ar's summary
    explains a bf16 difference the same way."""
    from engine.cli import _summary
    from treeviz.page.views import baseline_views
    run = generate(related_pair, RunSpec(pair="tiny-random", prompt="abc", strategy="linear", max_new_tokens=4))
    run.comparison = Comparison(exact_match=False, first_divergence=2, compared_tokens=4, reference_margin=0.01,
                                runs_each=1, ar_tokens_per_s=50.0)  # as compare_with_ar records it
    assert "near-tie rounded" not in baseline_views(run, None)["badge"]  # the pair is float32
    assert "note: in" not in _summary(run)
    run.config.dtype = "bfloat16"
    assert "bf16: a near-tie rounded apart" in baseline_views(run, None)["badge"]
    assert "note: in bfloat16 a tree's multi-row forward and AR's one-row step can round a near-tie apart" in \
        _summary(run)
