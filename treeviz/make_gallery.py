"""Regenerate the gallery of precomputed traces in assets/traces/ (shown before any model loads).

    python -m treeviz.make_gallery                      # tiny random pair (seconds; what ships by default)
    python -m treeviz.make_gallery --pair default       # the real offline pair (slow on CPU)

Each trace is one RunResult JSON (engine.trace) with its comparison against AR on the same prompt; files stay
under --max-kb (default 300 KB): if one is larger it is re-run with fewer new tokens.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from engine.strategies import STRATEGIES
from treeviz.backend import Backend, Cancel, Done, RunSpec, UserError
from treeviz.replay import TRACE_DIR
from treeviz.ui import load_examples

# (file stem, prompt kind, strategy, pair override or None)
PLAN = (
    ("code_dynatree", "code", "dynatree", None),
    ("chat_fixed", "chat", "fixed", None),
    ("prose_linear", "prose", "linear", None),
    ("code_ddtree", "code", "ddtree", None),
    ("chat_salf", "chat", "salf", None),
    ("code_dynatree", "code", "dynatree", "tiny-random-identical"),
)


def run_one(backend: Backend, spec: RunSpec):
    """The run and its comparison with AR, through the same backend loop the app streams from."""
    backend.pairs.request(spec.pair)
    while (pair := backend.pairs.ready(spec.pair)) is None:  # raises UserError if the pair cannot load
        pass
    done = [item for item in backend.decode(pair, spec, Cancel()) if isinstance(item, Done)]
    if not done or done[-1].result is None:
        raise UserError(f"{spec.strategy} on {spec.pair} did not finish")
    return done[-1].result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="tiny-random")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--max-kb", type=int, default=300)
    parser.add_argument("--out", default=str(TRACE_DIR))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    examples = load_examples()
    backend = Backend()
    tiny = args.pair.startswith("tiny-random")
    for stem, kind, strategy, pair_override in PLAN:
        if strategy not in STRATEGIES:
            continue
        if pair_override and not tiny:
            continue  # the identical-draft demo only makes sense with the tiny pairs
        pair = pair_override or args.pair
        prompt = next((e["prompt"] for e in examples if e["kind"] == kind), examples[0]["prompt"])
        tokens = args.max_new_tokens
        while True:
            result = run_one(backend, RunSpec(pair=pair, prompt=prompt, strategy=strategy, max_new_tokens=tokens))
            text = json.dumps(result.to_dict(), ensure_ascii=False, separators=(",", ":"))
            if len(text.encode()) <= args.max_kb * 1024 or tokens <= 4:
                break
            tokens = max(4, tokens // 2)
        name = f"{pair}_{stem}"
        path = out / f"{name.replace('/', '-')}.json"
        path.write_text(text)
        m = result.metrics
        print(f"{path.name}: {len(text) // 1024} KB, {m['new_tokens']} tokens, {m['iterations']} iterations, "
              f"L̄ {m['mean_tokens_per_iter']:.2f}, matches AR: {(result.comparison or {}).get('exact_match')}")


if __name__ == "__main__":
    main()
