"""Regenerate the gallery of precomputed traces in assets/traces/ (what a visitor sees before any model loads).

    python -m scripts.make_gallery --pair default        # the real offline pair: several minutes of CPU
    python -m scripts.make_gallery --pair tiny-random --out /tmp/gallery   # seconds; what the tests use

Code, chat and prose prompts (the first of each kind in assets/prompts/); DynaTree, DySpec, SALF and DDTree with
their `paper` presets (big trees), `delayed` at temperature 0.8, then the `cpu` preset of the strategy that ran
fastest among them on the code prompt. Each trace is one compact RunResult JSON (engine.core.trace) with its comparison
against AR on the same prompt, through the same backend loop the app streams from. A file over --max-kb is run
again with proportionally fewer new tokens, so every file stays bounded; the total is printed at the end.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from engine.recipe import RunSpec
from engine.strategies import STRATEGIES
from treeviz.page.replay import TRACE_DIR
from treeviz.page.ui import load_examples
from treeviz.serving.errors import UserError
from treeviz.serving.events import BaselineMeasured, Failed, Finished
from treeviz.serving.server import SERVER
from treeviz.serving.work import decode_events

MIN_TOKENS = 8


@dataclass(frozen=True)
class Entry:
    kind: str                  # prompt kind: code, chat, prose
    strategy: str
    preset: str = "paper"
    temperature: float = 0.0
    tokens: float = 1.0        # share of --max-new-tokens

    @property
    def stem(self) -> str:
        return f"{self.kind}_{self.strategy}_{self.preset}"


PLAN = (
    # 256-node trees (DynaTree's and DDTree's paper budgets) write ~100 KB of records per iteration: fewer tokens
    Entry("code", "dynatree", tokens=0.5), Entry("code", "dyspec"), Entry("code", "salf"),
    Entry("code", "ddtree", tokens=0.4), Entry("chat", "dynatree", tokens=0.5), Entry("chat", "ddtree", tokens=0.4),
    Entry("prose", "dyspec"), Entry("prose", "salf"),
    Entry("chat", "delayed", "cpu", 0.8),
)


def run_one(spec: RunSpec):
    """The run with AR beside it, through the run session the app's Run goes through."""
    last = None
    for event in SERVER.open("make_gallery", "run").events("", spec.pair, decode_events, spec, baseline_for=spec):
        if isinstance(event, Failed):
            raise UserError(event.message)
        last = event
    if not isinstance(last, (Finished, BaselineMeasured)) or last.ar is None:
        raise UserError(f"{spec.strategy} on {spec.pair} did not finish")
    return last.result


def bounded_run(pair: str, prompt, entry: Entry, tokens: int, max_bytes: int):
    """(result, compact JSON) with the JSON under max_bytes: re-run with fewer tokens while it is larger."""
    while True:
        spec = RunSpec(pair=pair, prompt=prompt, strategy=entry.strategy, preset=entry.preset,
                       max_new_tokens=tokens, temperature=entry.temperature)
        result = run_one(spec)
        text = result.to_json(compact=True)
        size = len(text.encode())
        if size <= max_bytes or tokens <= MIN_TOKENS:
            return result, text
        tokens = max(MIN_TOKENS, int(tokens * max_bytes / size * 0.9))


def trace_name(pair: str, entry: Entry) -> str:
    return f"{pair.replace('/', '-')}_{entry.stem}.json"


def write(out: Path, pair: str, entry: Entry, result, text: str) -> int:
    path = out / trace_name(pair, entry)
    path.write_text(text)
    m, c = result.metrics, result.comparison
    speedup = c.speedup_vs_ar if c is not None else None
    print(f"{path.name}: {len(text.encode()) / 1024:.0f} KB, {m.new_tokens} tokens, {m.iterations} iterations, "
          f"L̄ {m.mean_tokens_per_iter:.2f}, speedup {speedup or 0:.2f}×, "
          f"matches AR: {c.exact_match if c is not None else None}", flush=True)
    return len(text.encode())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="default")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--max-kb", type=int, default=450, help="bound on each trace file")
    parser.add_argument("--out", default=str(TRACE_DIR))
    parser.add_argument("--only", default="", help="comma-separated strategies to keep from the plan (quick checks)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    examples = load_examples()
    prompts = {kind: next((e["prompt"] for e in examples if e["kind"] == kind), examples[0]["prompt"])
               for kind in ("code", "chat", "prose")}
    keep = {s for s in args.only.split(",") if s}
    plan = [e for e in PLAN if e.strategy in STRATEGIES and (not keep or e.strategy in keep)]
    total, code_speedups = 0, {}
    for entry in plan:
        tokens = max(MIN_TOKENS, round(args.max_new_tokens * entry.tokens))
        result, text = bounded_run(args.pair, prompts[entry.kind], entry, tokens, args.max_kb * 1024)
        total += write(out, args.pair, entry, result, text)
        if entry.kind == "code" and entry.temperature == 0:
            code_speedups[entry.strategy] = (result.comparison.speedup_vs_ar if result.comparison else None) or 0.0
    if code_speedups:
        # the first view: small trees, so a longer run fits in the same bound
        best = Entry("code", max(code_speedups, key=code_speedups.get), "cpu", tokens=1.5)
        tokens = round(args.max_new_tokens * best.tokens)
        result, text = bounded_run(args.pair, prompts["code"], best, tokens, args.max_kb * 1024)
        total += write(out, args.pair, best, result, text)
    if not keep:
        remove_stale(out, args.pair, plan + ([best] if code_speedups else []))
    print(f"gallery: {total / 1024 / 1024:.2f} MB in {out}")


def remove_stale(out: Path, pair: str, written: list[Entry]) -> None:
    """A whole plan replaces the pair's gallery: traces of an earlier run that this one did not rewrite (e.g. the
    cpu preset of another strategy) would otherwise stay, with numbers from another time."""
    fresh = {trace_name(pair, entry) for entry in written}
    for path in out.glob(f"{pair.replace('/', '-')}_*.json"):
        if path.name not in fresh:
            path.unlink()
            print(f"removed {path.name} (not part of this run)")


if __name__ == "__main__":
    main()
