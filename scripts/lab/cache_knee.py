"""Lab probe: how much last-level cache does this process keep? A warm re-read's rate at each size of
engine/measure/cache.py's grid, beside a buffer of twice what sysfs reports (memory speed), and the size the format
probe takes from them (`cache_knee`). Rounds alternate so a drift of the machine shows as a spread.

    python -m scripts.lab.cache_knee [--rounds 3]
"""
import argparse

import torch

from engine.measure import cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    reported = cache.reported_cache()
    print(f"sysfs reports {reported >> 20} MiB; read on one thread (torch's threads otherwise: "
          f"{torch.get_num_threads()})")
    sizes = [s for s in cache.GRID if s < reported] + [2 * reported]
    rates = {s: [] for s in sizes}
    knees = []
    for _ in range(args.rounds):
        for size in sizes:
            rates[size].append(cache.warm_read_rate(size))
        knees.append(cache.cache_knee(reported))
    memory = max(rates[2 * reported])
    print("size MiB | warm re-read GB/s, each round | best / memory's best")
    for size in sizes:
        row = " ".join(f"{r / 1e9:5.1f}" for r in rates[size])
        print(f"{size >> 20:8d} | {row} | {max(rates[size]) / memory:.2f}")
    print(f"cache_knee, each round: {', '.join(str(k >> 20) for k in knees)} MiB "
          f"(memory speed: within {cache.MEMORY_SPEED} of a {2 * reported >> 20} MiB buffer's rate)")


if __name__ == "__main__":
    main()
