"""Fed docs/experiments/2026-12-06-zen4.md: the engine's weight formats' kernels on one weight shape, a few rows, at
one thread and at all of them, out of cache. It asks whether a format's kernel streams its weight at the memory's
rate or is held back by its own arithmetic (then its GB/s doubles with a second thread, as memory would not).

    python -m scripts.lab.format_kernels --shape 9728x896 --formats int4,dyn8,int8,packed   # the draft's gate|up
    python -m scripts.lab.format_kernels --shape 32768x896 --copies 4                      # the draft's trimmed head

Each format is made by the engine itself (`RoutedLinear.add`) and called through the kernel a step calls
(`engine/cpu/kernels.py KERNELS`). `--copies` layers of the shape are applied in turn so each call streams its weight
from memory. Times are the median of `--repeats` passes over every copy, per call; GB/s is the format's resident
bytes (what the cost table and the memory plan count) over that time. `max_abs_diff` compares each output with the
rows times the weight the format stands for (`RoutedLinear.dequantized`), in fp32.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from engine.cpu.kernels import KERNELS, format_bytes, route_linears


def layers_in(fmt: str, out_features: int, in_features: int, copies: int, dtype: torch.dtype) -> list:
    """`copies` routed linears of the shape holding format `fmt` (their plain weights kept: the reference)."""
    layers = []
    for _ in range(copies):
        holder = nn.Sequential(nn.Linear(in_features, out_features, bias=False, dtype=dtype)).eval()
        route_linears(holder)
        if not holder[0].add(fmt):
            raise SystemExit(f"{fmt} cannot take a {out_features}x{in_features} weight")
        layers.append(holder)
    return layers


def median_per_call(fmt: str, layers: list, x: torch.Tensor, repeats: int) -> float:
    """Seconds per call of `fmt`'s kernel: the median of `repeats` passes over every layer, after one warm pass."""
    def one_pass():
        for holder in layers:
            layer = holder[0]
            KERNELS[fmt](x, layer.tensors(fmt), None, layer.out_features, layer.int4_group)
    one_pass()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / len(layers)


def probe(out_features: int, in_features: int, formats: list[str], rows: int, threads: list[int], copies: int,
          dtype: torch.dtype, repeats: int) -> list[dict]:
    torch.manual_seed(0)
    results = []
    before = torch.get_num_threads()
    with torch.inference_mode():
        x = torch.randn(rows, in_features, dtype=dtype)
        for fmt in formats:
            layers = layers_in(fmt, out_features, in_features, copies, dtype)
            layer = layers[0][0]
            reference = x.float() @ layer.dequantized(fmt).T
            out = KERNELS[fmt](x, layer.tensors(fmt), None, out_features, layer.int4_group)
            gigabytes = format_bytes(layers[0], fmt) / 1e9
            row = {"format": fmt, "gigabytes": gigabytes, "max_abs_diff": float((out.float() - reference).abs().max())}
            for count in threads:
                torch.set_num_threads(count)
                seconds = median_per_call(fmt, layers, x, repeats)
                row[f"us_{count}"] = seconds * 1e6
                row[f"gbs_{count}"] = gigabytes / seconds
            torch.set_num_threads(before)
            results.append(row)
            del layers
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="9728x896", help="OUTxIN, as nn.Linear's weight")
    parser.add_argument("--formats", default="int4,dyn8,int8,packed")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--threads", default=None, help="thread counts to time (default: 1 and all of them)")
    parser.add_argument("--copies", type=int, default=24, help="layers of the shape taken in turn (out of cache)")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    out_features, in_features = (int(n) for n in args.shape.split("x"))
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    threads = ([int(n) for n in args.threads.split(",")] if args.threads
               else sorted({1, torch.get_num_threads()}))
    rows = probe(out_features, in_features, args.formats.split(","), args.rows, threads, args.copies, dtype,
                 args.repeats)
    print(f"{args.shape} {args.dtype}, {args.rows} row(s), {args.copies} copies")
    print(f"{'format':>7s} {'MB':>7s} " + " ".join(f"{f'us@{n}':>8s} {f'GB/s@{n}':>8s}" for n in threads)
          + f" {'max |diff|':>11s}")
    for r in rows:
        print(f"{r['format']:>7s} {r['gigabytes'] * 1e3:7.2f} "
              + " ".join(f"{r[f'us_{n}']:8.1f} {r[f'gbs_{n}']:8.1f}" for n in threads)
              + f" {r['max_abs_diff']:11.3g}")
    if args.json:
        from pathlib import Path
        Path(args.json).write_text(json.dumps({"shape": args.shape, "dtype": args.dtype, "rows": args.rows,
                                               "copies": args.copies, "threads": threads, "formats": rows},
                                              indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
