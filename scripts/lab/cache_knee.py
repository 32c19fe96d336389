"""Lab probe: how much last-level cache does a sequential re-read find on this machine? A warm re-read's rate on
one thread at sizes from 16 MiB up to what sysfs reports, beside a buffer of twice the report (memory's speed), and
the edge: the smallest size from which a re-read runs within EDGE of memory's speed, two sizes in a row. Rounds
alternate so a drift of the machine shows as a spread.

The format probe does not size itself by this edge: on the AMX Xeon of 2026-12-07 it was 96 MiB of a reported 480,
and a probe sized by twice it routed the target to a slower table
(docs/experiments/2026-12-07-probe-cache.md).

    python -m scripts.lab.cache_knee [--rounds 3]
"""
import argparse

import torch

from engine.cpu.formats import last_level_cache
from engine.measure.costs import stream_bandwidth

GRID = tuple(m << 20 for m in (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072))
EDGE = 1.25


def edge(rates: dict[int, float], reported: int) -> int:
    memory = rates[2 * reported]
    sizes = sorted(s for s in rates if s < reported)
    slow = [rates[s] <= EDGE * memory for s in sizes]
    for i in range(1, len(sizes)):
        if slow[i - 1] and slow[i]:
            return sizes[i - 1]
    return reported


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    reported = last_level_cache()
    print(f"sysfs reports {reported >> 20} MiB; read on one thread")
    sizes = [s for s in GRID if s < reported] + [2 * reported]
    rates = {s: [] for s in sizes}
    edges = []
    for _ in range(args.rounds):
        for size in sizes:
            # stream_bandwidth discards its first read: the rate is a warm re-read's
            rates[size].append(stream_bandwidth(torch.device("cpu"), size, repeats=5, seconds=0.05))
        edges.append(edge({s: r[-1] for s, r in rates.items()}, reported))
    memory = max(rates[2 * reported])
    print("size MiB | warm re-read GB/s, each round | best / memory's best")
    for size in sizes:
        row = " ".join(f"{r / 1e9:5.1f}" for r in rates[size])
        print(f"{size >> 20:8d} | {row} | {max(rates[size]) / memory:.2f}")
    print(f"edge, each round: {', '.join(str(k >> 20) for k in edges)} MiB "
          f"(memory speed: within {EDGE} of a {2 * reported >> 20} MiB buffer's rate)")


if __name__ == "__main__":
    main()
