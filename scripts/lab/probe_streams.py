"""Lab probe: does the format probe time a small shape group as a forward reads it? The app's draft's q|k|v (896x1152).

Two measurements on the default draft as the app loads it (its 32,768-token head, q|k|v and gate|up fused):

1. The probe's one-row seconds of `plain` and `dyn8` for the q|k|v group, timed the old way (the first two decoder
   layers, which filled twice the last-level cache over every group, and no flush between sweeps) and the new way
   (`formats.probe_groups`: the group's own layers until they fill the cache, `CacheFlush` before every sweep).
2. Whole one-row forwards of the draft over a 300-token cache with q|k|v on `plain` and on `dyn8` at one row, every
   other group on `dyn8`: `--rounds` rounds of `--steps` forwards each, the two alternating; eagerly, and through
   the captured one-row steps of both routings where this machine's cache holds them (`python -m engine costs
   --capture on` builds a routing's packages; none is built here).

    python -m scripts.lab.probe_streams [--rounds 6] [--steps 10]
"""
import argparse
import re
import statistics
import time

import torch

from engine.cpu import formats
from engine.cpu.fusion import fuse_projections
from engine.core.steps import StaticSteps
from engine.cpu.kernels import add_format, named_routed_linears, route_linears, router_of, routed_linears
from engine.cpu.packages import prepare_model
from engine.measure.costs import PREFIX, filled_cache, probe_ids, timed_forward
from scripts.lab.fused_draft import app_draft

QKV = "896x1152"


def probe_both_ways(model) -> None:
    old = [m for name, m in named_routed_linears(model) if m.group == QKV and re.search(r"\.layers\.[01]\.", name)]
    new = formats.probe_groups(model)[QKV]
    for label, chosen, flush in (("old: 2 layers, no flush", old, False), (f"new: {len(new)} layers, flushed", new,
                                                                           True)):
        seconds = formats.time_formats(chosen, ["plain", "dyn8"], ladder=(1,)) if flush else \
            _unflushed(chosen)
        per = {p: t[1] / len(chosen) * 1e6 for p, t in seconds.items()}
        print(f"probe {label}: plain {per['plain']:.0f} us, dyn8 {per['dyn8']:.0f} us a call; plain/dyn8 "
              f"{per['plain'] / per['dyn8']:.2f}")


def _unflushed(layers):
    class NoFlush(formats.CacheFlush):
        def __call__(self):
            pass
    saved, formats.CacheFlush = formats.CacheFlush, NoFlush
    try:
        return formats.time_formats(layers, ["plain", "dyn8"], ladder=(1,))
    finally:
        formats.CacheFlush = saved


def forwards(model, name: str, rounds: int, steps: int) -> None:
    router = router_of(model)
    groups = {m.group for m in routed_linears(model)}
    routes = {qkv: {g: [qkv if g == QKV else "dyn8"] + ["dyn8"] * 63 for g in groups} for qkv in ("plain", "dyn8")}
    ids = probe_ids(model, PREFIX + 1)
    with torch.inference_mode():
        cache = filled_cache(model, ids, PREFIX)
    eager = {qkv: (lambda: timed_forward(model, ids, PREFIX, 1, cache)) for qkv in routes}
    _alternate("eager", router, routes, eager, rounds, steps)
    captured = {}
    for qkv, by_group in routes.items():
        router.install(["dyn8"] * 64, by_group)
        packages = prepare_model(model, name, "draft", build_missing=False)
        one = packages.package_for(1)
        if one is None or one.recipe.rows != 1:
            print(f"captured, q|k|v {qkv}: no one-row package on this machine ({'; '.join(packages.notes)})")
            return
        packages.serve_all()
        captured[qkv] = _captured_step(model, packages, ids.tolist())
    _alternate("captured", router, routes, captured, rounds, steps)


def _captured_step(model, packages, ids: list[int]):
    steps = StaticSteps(model, PREFIX + 16, (1,), captured=packages)
    with torch.inference_mode():
        steps.prefill(ids[:PREFIX])

    def one() -> float:
        with torch.inference_mode():
            start = time.perf_counter()
            steps.forward(ids[PREFIX:PREFIX + 1], [PREFIX])
            seconds = time.perf_counter() - start
            steps.keep(PREFIX, [])
        return seconds
    return one


def _alternate(label: str, router, routes, step, rounds: int, steps: int) -> None:
    times = {qkv: [] for qkv in routes}
    with torch.inference_mode():
        for qkv, by_group in routes.items():  # warm-up
            router.install(["dyn8"] * 64, by_group)
            for _ in range(5):
                step[qkv]()
        for r in range(rounds):
            for qkv, by_group in (routes.items() if r % 2 == 0 else reversed(routes.items())):
                router.install(["dyn8"] * 64, by_group)
                times[qkv].append(statistics.median(step[qkv]() for _ in range(steps)))
    for qkv, ts in times.items():
        print(f"{label} one-row forward, q|k|v {qkv}: round medians " + ", ".join(f"{t * 1e3:.1f}" for t in ts) +
              f" ms; median {statistics.median(ts) * 1e3:.1f}")
    wins = sum(d < p for d, p in zip(times["dyn8"], times["plain"]))
    print(f"{label}: q|k|v on dyn8 faster in {wins} of {rounds} rounds; median ratio dyn8/plain "
          f"{statistics.median(d / p for d, p in zip(times['dyn8'], times['plain'])):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    model, _, name = app_draft()
    fuse_projections(model)
    route_linears(model)
    add_format(model, "dyn8")
    print(f"last-level cache {formats.last_level_cache() / 2**20:.0f} MiB; threads {torch.get_num_threads()}")
    probe_both_ways(model)
    forwards(model, name, args.rounds, args.steps)


if __name__ == "__main__":
    main()
