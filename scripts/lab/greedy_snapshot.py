"""Lab probe behind docs/experiments/2026-11-28-house-for-two-devices.md: the greedy tokens of every strategy, to
compare two commits token for token.

Every strategy and AR on the tiny pair (presets `cpu` and `auto`, 24 tokens) and, with --default, on the default
pair as the app loads it (captured steps off, `auto`, 32 tokens), written as {"tiny/NAME/PRESET": [ids], ...}. Run it
from each commit's checkout (PYTHONPATH=that checkout) and compare the two files.

    python -m scripts.lab.greedy_snapshot OUT.json [--default]
"""
import argparse
import json

from engine.models import load_pair, tiny_random_pair
from engine.recipe import RunSpec, generate
from engine.strategies import STRATEGIES

PROMPT_TINY, PROMPT_DEFAULT = "hello tree", "def fibonacci(n):"


def tokens(pair, pair_name: str, prompt: str, name: str, preset: str, new: int) -> list[int] | str:
    spec = RunSpec(pair=pair_name, prompt=prompt, strategy=name, preset=preset, max_new_tokens=new, stop_on_eos=False)
    try:
        return generate(pair, spec).output_ids
    except Exception as err:  # a strategy that cannot run is part of the snapshot, not the end of it
        return f"error {type(err).__name__}: {err}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--default", action="store_true", help="also the default pair (loads it: minutes)")
    args = parser.parse_args()
    names, out = ["ar", *STRATEGIES], {}
    tiny = tiny_random_pair(seed=0)
    for name in names:
        for preset in ("cpu", "auto"):
            out[f"tiny/{name}/{preset}"] = tokens(tiny, "tiny", PROMPT_TINY, name, preset, 24)
    if args.default:
        pair = load_pair("default-target", "default-draft", dtype="auto", packed="auto", draft_vocab="auto",
                         draft_quant="auto", capture="off")
        for name in names:
            out[f"default/{name}"] = tokens(pair, "default", PROMPT_DEFAULT, name, "auto", 32)
    with open(args.out, "w") as file:
        json.dump(out, file, indent=0)
    print(f"{len(out)} runs; {sum(isinstance(v, str) for v in out.values())} errors")


if __name__ == "__main__":
    main()
