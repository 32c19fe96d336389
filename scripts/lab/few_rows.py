"""Fed docs/experiments/2026-11-28-quiet-measurements.md: each fp32 weight format at 1-16 rows, per target shape.

    python -m scripts.lab.few_rows

One RoutedLinear per weight shape of the default target (engine/cpu/kernels.py), each format forced in turn, 2
threads, the mean of 30 calls after 3 warm-ups per row count. Prints the one-row time, its bandwidth, and each row
count's time over the one-row time: what a verification of n rows costs per linear on this CPU.
"""
import time

import torch
from torch import nn

from engine.cpu.kernels import RoutedLinear, Router

SHAPES = ((1536, 8960), (8960, 1536), (1536, 1536), (1536, 256))  # (in, out): gate/up, down, q/o, k/v
ROWS = (1, 2, 4, 8, 16)


def seconds(layer: RoutedLinear, rows: int, calls: int = 30) -> float:
    x = torch.randn(rows, layer.in_features)
    for _ in range(3):
        layer(x)
    start = time.perf_counter()
    for _ in range(calls):
        layer(x)
    return (time.perf_counter() - start) / calls


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    for features, out in SHAPES:
        layer = RoutedLinear(nn.Linear(features, out, bias=False), Router(), "probe")
        layer.add("mkl")
        layer.add("packed", torch.float32)
        for path in ("plain", "mkl", "packed"):
            layer.router.forced = path
            times = [seconds(layer, rows) for rows in ROWS]
            rate = features * out * 4 / times[0] / 1e9
            ratios = " ".join(f"{rows}:{t / times[0]:.2f}" for rows, t in zip(ROWS[1:], times[1:]))
            print(f"{features}x{out} {path:7s} 1 row {times[0] * 1e3:6.2f} ms ({rate:5.1f} GB/s)  x one row: {ratios}")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
