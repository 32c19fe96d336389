"""Lab probe: does copying the plain weights beside the formats being made shorten a warm start's load?

    TREEVIZ_CACHE=DIR python -m scripts.lab.copy_beside_formats [--rounds 3]     # DIR: a cache a start has filled

Loads the default pair as the app does (`load_pair`, the app's options), in a fresh process per load, alternating two
orders round by round:

- `beside`: what `loading.make_formats` does, the weights no format is made from copied on the formats' two
  workers while the formats are made, the rest after;
- `after`: every copy after the making (the order before; `untouched_by_make_whole` answers "none" in that child).

Prints, per load, the seconds of `load_pair` and of its part from the "probing the target's weight formats" line to
the end (the formats made whole and the copies: what the order changes), then the medians.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

CHILD = "--child"


def child(order: str) -> None:
    import engine.models.loading as loading
    from treeviz.serving.pairs import split_pair
    if order == "after":
        loading.untouched_by_make_whole = lambda model, choice: []
    marks, t0 = [], time.perf_counter()
    target, draft = split_pair("default")
    loading.load_pair(target, draft, progress=lambda f, m: marks.append((time.perf_counter() - t0, m)),
                      draft_quant="auto", draft_vocab="auto", capture="auto")
    end = time.perf_counter() - t0
    probe = next(t for t, m in marks if m.startswith("probing the target"))
    print(json.dumps({"order": order, "load_s": end, "formats_and_copies_s": end - probe}))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    seen = {"beside": [], "after": []}
    for round_ in range(args.rounds):
        for order in (("beside", "after") if round_ % 2 == 0 else ("after", "beside")):
            out = subprocess.run([sys.executable, "-m", "scripts.lab.copy_beside_formats", CHILD, order],
                                 capture_output=True, text=True, check=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            seen[order].append(row["formats_and_copies_s"])
            print(f"round {round_ + 1} {order:6s}: load_pair {row['load_s']:.2f} s, from the probe line to the end "
                  f"{row['formats_and_copies_s']:.2f} s", flush=True)
    for order, values in seen.items():
        print(f"{order}: median {statistics.median(values):.2f} s over {len(values)} loads")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == CHILD:
        child(sys.argv[2])
    else:
        main()
