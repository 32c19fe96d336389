"""Lab probe behind docs/experiments/2026-12-06-zen4.md ("Padded to four rows"): the captured steps with the padding
the cost table chose (engine/cpu/packages.py `pads`) against the same steps unpadded, in one process, interleaved.

    python -m scripts.lab.padded_rows                     # the app's configuration, 2 prompts per set, 64 tokens

Per prompt and in turn: AR on the captured one-row step in a bare loop (the bench's `ar-captured`) and DynaTree
(`auto`), each padded and unpadded. Prints each one's tokens per second summed over the prompts, the padded ÷
unpadded ratio, and how many outputs were token for token the same both ways (bf16 rounds a row differently in a
GEMM of four rows than of one, so near-ties may flip; fp32 tests hold them equal: tests/test_captured_steps.py).
"""
import argparse
from contextlib import contextmanager

from engine.bench.captured_ar import CapturedAR
from engine.core.prompts import encode_prompt, load_prompt_set
from engine.cpu.packages import prepare_capture
from engine.models import load_pair
from engine.recipe import RunSpec, generate

SETS = ("code", "chat", "prose")


@contextmanager
def unpadded(pair):
    """Inside the block every row count a padded package served runs at its own rows, on its own package, and the
    cost table prices it so (the `auto` sizer reads the table: the A/B covers its choices too)."""
    tables = {"target": pair.costs.target, "draft": pair.costs.draft}
    saved = {role: (c.serves, c.pads, tables[role].serves) for role, c in pair.captured.items()}
    for role, captured in pair.captured.items():
        captured.serves = {n: (captured.package_for(n) if n in captured.pads else p)
                           for n, p in captured.serves.items()}
        captured.pads = {}
        tables[role].serves = {n: captured.rows_of(p, n) for n, p in captured.serves.items()}
    pair.static_steps.clear()
    try:
        yield
    finally:
        for role, captured in pair.captured.items():
            captured.serves, captured.pads, tables[role].serves = saved[role]
        pair.static_steps.clear()


def ar(pair, prompt: str, max_new_tokens: int) -> tuple[list[int], float]:
    out = CapturedAR(pair).generate(encode_prompt(pair.tokenizer, prompt), max_new_tokens)
    return out["output_ids"], out["total_s"]


def dynatree(pair, prompt: str, max_new_tokens: int) -> tuple[list[int], float]:
    result = generate(pair, RunSpec(pair="default", prompt=prompt, strategy="dynatree", max_new_tokens=max_new_tokens,
                                    stop_on_eos=False))
    return result.output_ids, result.metrics.total_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-set", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    pair = load_pair("default", "default", draft_quant="auto", draft_vocab="auto", capture="auto")
    prepare_capture(pair, None, False)
    print(pair.describe(), flush=True)
    for role, captured in pair.captured.items():
        print(f"{role}: padded rows {captured.info()['pads'] or 'none'}", flush=True)
    prompts = [p["prompt"] for s in SETS for p in load_prompt_set(s)[:args.per_set]]
    for name, run in (("ar-captured", ar), ("dynatree", dynatree)):
        run(pair, prompts[0], 8)  # warm-up: first calls allocate
        tokens, seconds, same = 0, {"padded": 0.0, "unpadded": 0.0}, 0
        for prompt in prompts:
            padded_ids, padded_s = run(pair, prompt, args.max_new_tokens)
            with unpadded(pair):
                plain_ids, plain_s = run(pair, prompt, args.max_new_tokens)
            tokens += len(padded_ids)
            seconds["padded"] += padded_s
            seconds["unpadded"] += plain_s * len(padded_ids) / len(plain_ids)  # per token, should lengths differ
            same += padded_ids == plain_ids
        padded, plain = tokens / seconds["padded"], tokens / seconds["unpadded"]
        print(f"{name}: padded {padded:.2f} tok/s, unpadded {plain:.2f} tok/s, padded / unpadded {padded / plain:.2f}x; "
              f"{same}/{len(prompts)} outputs the same", flush=True)


if __name__ == "__main__":
    main()
