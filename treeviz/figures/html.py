"""HTML built from trace records: the generated text coloured by provenance, its legend, the output-vs-AR badge
(with where AR's figure came from) and the run's metrics row. Every piece of text is escaped here.
"""
from __future__ import annotations

import html
import time
import unicodedata
from typing import Any

from engine.core.trace import Comparison, RunResult, SourceAcceptance

WHITESPACE = {" ": "␣", "\n": "⏎", "\t": "⇥", "\r": "␍"}
TOKEN_KIND_STYLE = {  # generated-text provenance
    "prompt": ("#f0f0f0", "prompt"),
    "prefill": ("#d6e4f0", "first token, from the prefill pass"),
    "accepted": ("#c9ecc9", "accepted draft token"),
    "bonus": ("#fde3c4", "bonus token (target's choice)"),
}


def visible_token(text: str | None) -> str:
    """A token's text with whitespace made visible, with <, > and & escaped (safe inside plotly text and HTML text;
    quotes stay as they are, since plotly would print the entity &quot; literally)."""
    if text is None:
        return "∅"
    if text == "":
        return "∅"
    out = []
    for ch in text:
        if ch in WHITESPACE:
            out.append(WHITESPACE[ch])
        elif unicodedata.category(ch) in ("Cc", "Cf", "Zs", "Zl", "Zp"):
            out.append(f"\\x{ord(ch):02x}" if ord(ch) < 256 else f"\\u{ord(ch):04x}")  # invisible: show its code
        else:
            out.append(ch)
    return html.escape("".join(out), quote=False)



def token_pieces(run: RunResult) -> list[dict[str, Any]]:
    """Output tokens with their text and provenance, as the engine recorded them (RunResult.token_sources).
    A trace written before sources carried text shows its output text as one piece."""
    sources = run.token_sources
    if not sources or any(src.text is None for src in sources):
        return [{"text": run.output_text, "kind": "prefill", "iteration": -1, "margin": None}]
    return [{"text": src.text, "kind": src.kind, "iteration": src.iteration, "margin": src.margin}
            for src in sources]


def tokens_html(run: RunResult | None, selected: int | None = None, show_prompt: bool = True,
                divergence: int | None = None) -> str:
    """Generated text as HTML spans coloured by provenance, with a tooltip per token; the selected iteration's
    tokens are outlined; the first divergence from AR (if any) is marked."""
    if run is None:
        return "<div class='tv-text tv-empty'>No run yet.</div>"
    parts = ["<div class='tv-text'>"]
    if show_prompt and run.prompt:
        prompt = str(run.prompt)
        if len(prompt) > 160:
            prompt = "…" + prompt[-160:]
        parts.append(f"<span class='tv-prompt' title='prompt'>{html.escape(prompt)}</span>")
    for i, piece in enumerate(token_pieces(run)):
        kind = piece["kind"]
        color, label = TOKEN_KIND_STYLE.get(kind, ("#eeeeee", kind))
        it = piece["iteration"]
        tip = f"token {i} · {label}"
        if it is not None and it >= 0:
            tip += f" · iteration {it}"
        if piece["margin"] is not None:
            tip += f" · target top-2 margin {piece['margin']:.2f}"
        tip += f" · {piece['text']!r}"
        style = f"background:{color};"
        cls = "tv-tok"
        if selected is not None and it == selected:
            cls += " tv-sel"
        if divergence is not None and i == divergence:
            cls += " tv-div"
            tip += " · FIRST DIVERGENCE FROM AR"
        text = piece["text"]
        shown = html.escape(text).replace("\n", "⏎\n") if text.strip() or "\n" in text else (
            html.escape(text) if text else "∅")
        parts.append(f"<span class='{cls}' style='{style}' title='{html.escape(tip, quote=True)}'>{shown}</span>")
    parts.append("</div>")
    return "".join(parts)



def token_legend_html() -> str:
    spans = "".join(f"<span style='background:{c}'>{html.escape(label)}</span>"
                    for kind, (c, label) in TOKEN_KIND_STYLE.items() if kind != "prompt")
    return f"<div class='tv-legend'>{spans}<span style='outline:2px solid #e74c3c'>selected iteration</span></div>"


SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}  # torch's names -> the page's words


def badge_html(comparison: Comparison | None, sampled: bool = False, dtype: str = "") -> str:
    """Does the output equal AR's, and (when the comparison records it) where AR's figure came from. `dtype` is the
    run's (RunConfig.dtype): in bf16 / fp16 a difference is explained as rounding."""
    if not comparison:
        return "<span class='tv-badge tv-na'>output vs AR: not compared</span>"
    source = ar_source_text(comparison)
    note = f" <span class='tv-badge tv-na tv-ar-source'>{html.escape(source)}</span>" if source else ""
    return output_match_html(comparison, sampled, dtype) + note


def output_match_html(comparison: Comparison, sampled: bool, dtype: str = "") -> str:
    """The badge's words on the output against AR's. A greedy run that differs in bf16 / fp16 says in one line why:
    a near-tie rounded apart by kernels of different row counts, not a lossy rule; fp32 is the exact mode. Without
    it a reader takes a bf16 difference for a bug of the rule."""
    if sampled:
        first = comparison.first_divergence
        where = "identical to AR's sample" if comparison.exact_match else f"differs from AR from token {first}"
        return ("<span class='tv-badge tv-na'>sampling: lossless in distribution, not token for token "
                f"({html.escape(where)})</span>")
    if comparison.exact_match:
        n = comparison.compared_tokens
        return f"<span class='tv-badge tv-ok'>✓ output matches AR token for token ({n} tokens)</span>"
    first = comparison.first_divergence
    extra = ""
    margin = comparison.reference_margin
    if margin is not None:
        extra = f"; AR's top-2 logit margin there: {margin:.3f}" + (" (a near-tie)" if margin < 0.5 else "")
    rounding = ""
    if dtype in ("bfloat16", "float16"):
        rounding = (f"<br><span class='tv-ar-rounding'>{SHORT_DTYPES[dtype]}: a near-tie rounded apart by kernels "
                    "of different row counts, not a lossy rule; fp32 (the Precision switch) is the exact mode</span>")
    return (f"<span class='tv-badge tv-bad'>✗ output differs from AR from token {first}{html.escape(extra)}"
            f"{rounding}</span>")


def ar_source_text(comparison: Comparison | None) -> str:
    """Where the AR figure beside a run came from (serving.Server records it with the comparison): measured for this
    run, or reused from the AR cache, measured when and how long before; "" for a comparison that does not say."""
    if not comparison or comparison.ar_measured_at is None:
        return ""
    at = time.strftime("%H:%M:%S UTC", time.gmtime(comparison.ar_measured_at))
    steps = f"; AR's forwards {comparison.ar_steps}" if comparison.ar_steps else ""
    if not comparison.ar_reused:
        return f"AR measured for this run ({at}){steps}"
    return (f"AR reused from the cache: measured at {at}, {duration_text(comparison.ar_age_s or 0.0)} "
            f"earlier{steps}")


def duration_text(seconds: float) -> str:
    """e.g. "8 s", "4 min 12 s", "2 h 5 min"."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def metrics_rows(run: RunResult, ar_run: RunResult | None = None) -> dict[str, Any]:
    m = run.metrics
    row = {"strategy": run.strategy,
           "tokens/s": m.tokens_per_s,
           "speedup": None,
           "L̄": m.mean_tokens_per_iter,
           "ℓ̄": m.mean_accepted_len,
           "acceptance": m.acceptance_rate,
           "#iterations": m.iterations,
           "new tokens": m.new_tokens}
    ar_tps = ar_run.metrics.tokens_per_s if ar_run is not None else None
    if ar_tps and row["tokens/s"]:
        row["speedup"] = row["tokens/s"] / ar_tps
    elif run.comparison is not None and run.comparison.speedup_vs_ar:
        row["speedup"] = run.comparison.speedup_vs_ar  # recorded with a replayed trace
    return row


def metrics_html(run: RunResult | None, ar_run: RunResult | None = None) -> str:
    """The run-level metrics row (the selected iteration's numbers are in the tree's title)."""
    if run is None:
        return ""
    row = metrics_rows(run, ar_run)

    def f(v, spec=".2f"):
        return "–" if v is None else (format(v, spec) if isinstance(v, float) else str(v))
    speedup = f(row["speedup"], ".2f") + "×" if row["speedup"] else "–"
    cells = [("run", str(run.strategy)), ("tokens/s", f(row["tokens/s"], ".1f")), ("speedup vs AR", speedup),
             ("L̄", f(row["L̄"])), ("ℓ̄", f(row["ℓ̄"])), ("acceptance", f(row["acceptance"])),
             ("iterations", f(row["#iterations"])), ("new tokens", f(row["new tokens"]))]
    cells += source_cells(run.metrics.acceptance_by_source)
    body = "".join(f"<div style='display:inline-block;margin:0 14px 4px 0'><div style='font-size:11px;"
                   f"color:#6b7280'>{html.escape(k)}</div><div style='font-size:16px;font-weight:600'>"
                   f"{html.escape(v)}</div></div>" for k, v in cells)
    return f"<div class='tv-metrics'>{body}{auto_html(run)}</div>"


def auto_html(run: RunResult) -> str:
    """What the `auto` preset decided last and why (engine/measure/autosize.py): the tree size, or that no tree pays
    on this machine and it takes AR steps; with the predicted speeds and c, t(n) behind it. Empty for other presets."""
    last = next((it.cost.auto for it in reversed(run.iterations) if it.cost is not None and it.cost.auto), None)
    if not last or not last.get("why"):
        return ""
    rest = sum(1 for it in run.iterations if it.cost is not None and it.cost.auto and len(it.nodes) <= 2
               and not it.draft_forwards)
    head = "auto: AR steps" if last.get("draft") == "none" else f"auto: next tree {last['param']}={last['next']}"
    tail = f" ({rest} of {len(run.iterations)} iterations were AR steps)" if rest else ""
    return (f"<div class='tv-auto' style='font-size:12px;color:#4b5563'>{html.escape(head)}: "
            f"{html.escape(last['why'])}{html.escape(tail)}</div>")


SOURCE_NAMES = {"model": "draft", "lookup": "lookup", "both": "draft + lookup"}


def source_cells(by_source: dict[str, SourceAcceptance]) -> list[tuple[str, str]]:
    """Acceptance per proposing source (engine/measure/metrics.py), as (label, "rate (accepted/drafted)") cells: only
    when the run has lookup nodes (a draft-only run's single source repeats the acceptance cell)."""
    if not set(by_source) & {"lookup", "both"}:
        return []
    return [(f"acceptance · {SOURCE_NAMES.get(name, name)}", f"{s.rate:.2f} ({s.accepted}/{s.drafted})")
            for name, s in by_source.items()]
