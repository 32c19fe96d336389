"""How fast this CPU's int8 GEMM kernels stream a draft's worth of weights at one row: fbgemm's dynamic int8 linear
(the `dyn8` format) and oneDNN's int8 linear (`onednn::qlinear_pointwise`, the kernel inductor's x86 quantisation
lowers to), over the default draft's 97 linears with distinct weights, so each call reads its weights from memory as a
step does (a single shape called again and again reads them from the cache and looks faster than it is).

    python -m scripts.lab.int8_stream [--threads 1 2] [--steps 30]

Prints each kernel's one-row step in ms and the GB/s it streams, interleaved, per thread count, beside the streaming
read of that many threads (`engine.measure.costs.stream_bandwidth`, a sum of 1 GiB). oneDNN's time is the GEMM alone
(its activations quantised outside the timing), so it is a lower bound on that format's cost. Compare each kernel
with the read of its own thread count: one core of a server part cannot draw the machine's bandwidth alone
(docs/experiments/2026-11-29-probe-streams.md), so a time that halves from one thread to two does not by itself say
the kernel is bound by its cores' work.
"""
from __future__ import annotations

import argparse
import warnings

import torch

from engine.measure.costs import stream_bandwidth
from scripts.lab.fused_projections import median_us

LAYER = [(896, 1152), (896, 896), (896, 9728), (4864, 896)]  # in x out: q|k|v, o, gate|up, down (fused draft)
HEAD = (896, 32768)


def weights(layers: int) -> list[tuple[int, int, torch.Tensor]]:
    torch.manual_seed(0)
    shapes = [s for _ in range(layers) for s in LAYER] + [HEAD]
    return [(k, n, torch.randn(n, k) * 0.02) for k, n in shapes]


def fbgemm_step(ws) -> callable:
    calls = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantize_per_channel's deprecation notice
        for k, n, w in ws:
            scale = w.abs().amax(1) / 127
            q = torch.quantize_per_channel(w, scale, torch.zeros(n, dtype=torch.long), 0, torch.qint8)
            calls.append((torch.randn(1, k), torch.ops.quantized.linear_prepack(q, None)))
    return lambda: [torch.ops.quantized.linear_dynamic(x, p) for x, p in calls]


def onednn_step(ws) -> callable:
    calls, x_scale, x_zero = [], torch.tensor(0.01), torch.tensor(128, dtype=torch.int32)
    for k, n, w in ws:
        scale = w.abs().amax(1) / 127
        codes = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        calls.append((torch.randint(0, 255, (1, k), dtype=torch.uint8), torch.ops.onednn.qlinear_prepack(codes, [1, k]),
                      scale, torch.zeros(n, dtype=torch.int32)))
    return lambda: [torch.ops.onednn.qlinear_pointwise.tensor(qx, x_scale, x_zero, packed, scale, zeros, None, 1.0, 0,
                                                              torch.float32, "none", [], "")
                    for qx, packed, scale, zeros in calls]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=24)
    args = parser.parse_args()
    ws = weights(args.layers)
    gigabytes = sum(k * n for k, n, _ in ws) / 1e9
    kernels = {"fbgemm dyn8": fbgemm_step(ws), "oneDNN int8 (GEMM only)": onednn_step(ws)}
    print(f"{len(ws)} int8 linears, {gigabytes:.3f} GB of weights, one row")
    for threads in args.threads:
        torch.set_num_threads(threads)
        read = stream_bandwidth(torch.device("cpu")) / 1e9
        print(f"  {threads} thread(s)  {'streaming read (sum)':<24} {'':>9}  {read:5.1f} GB/s", flush=True)
        for _ in range(2):  # interleaved twice
            for name, step in kernels.items():
                ms = median_us(step, repeats=args.steps) / 1e3
                print(f"  {threads} thread(s)  {name:<24} {ms:6.1f} ms  {gigabytes / ms * 1e3:5.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
