"""Lab probe behind docs/experiments/2026-11-28-fused-projections-cpu.md: what fusing a layer's projections would
save on this CPU, per layer, before any of it is built.

For the default pair's shapes, on the weight formats its routing takes on a float32 CPU (the draft's q, gate, up in
`dyn8` with k and v `plain`; the target's in `packed`): the separate calls a layer makes today against one call on
the weights concatenated along the output (q|k|v, gate|up). Random weights, 2 threads, medians of 300 calls after
50 warm-ups, at 1, 4, 8 and 16 rows.

    python -m scripts.lab.fused_projections
"""
import statistics
import time

import torch

from engine.cpu.kernels import RoutedLinear, Router, format_unavailable

ROWS = (1, 4, 8, 16)
# (model, hidden, q out, k/v out, mlp width, the formats: projections, k/v)
SHAPES = (("draft 0.5B", 896, 896, 128, 4864, "dyn8", "plain"),
          ("target 1.5B", 1536, 1536, 256, 8960, "packed", "packed"))


def layer(inputs: int, outputs: int, path: str) -> RoutedLinear:
    routed = RoutedLinear(torch.nn.Linear(inputs, outputs, bias=False), Router(path))
    routed.add(path)
    return routed


def median_us(fn, repeats: int = 300) -> float:
    for _ in range(50):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    for name, hidden, q_out, kv_out, width, path, kv_path in SHAPES:
        if format_unavailable(path, torch.device("cpu"), torch.float32):
            print(f"{name}: {path} unavailable here")
            continue
        q, k, v = layer(hidden, q_out, path), layer(hidden, kv_out, kv_path), layer(hidden, kv_out, kv_path)
        qkv = layer(hidden, q_out + 2 * kv_out, path)
        gate, up, gate_up = layer(hidden, width, path), layer(hidden, width, path), layer(hidden, 2 * width, path)
        for rows in ROWS:
            x = torch.randn(rows, hidden)
            apart = median_us(lambda: (q(x), k(x), v(x)))
            fused = median_us(lambda: qkv(x))
            mlp_apart = median_us(lambda: (gate(x), up(x)))
            mlp_fused = median_us(lambda: gate_up(x))
            saved = apart - fused + mlp_apart - mlp_fused
            print(f"{name:11} rows {rows:2}: q+k+v {apart:7.1f} us, q|k|v {fused:7.1f} us; "
                  f"gate+up {mlp_apart:7.1f} us, gate|up {mlp_fused:7.1f} us; saved per layer {saved:7.1f} us")


if __name__ == "__main__":
    main()
