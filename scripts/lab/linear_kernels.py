"""Fed docs/experiments/2026-12-06-zen4.md: one weight shape's GEMM for a few rows, oneDNN's packed kernel (the
engine's `packed` format) against inductor's choice under torch.compile (max-autotune, frozen weights: what
`ar-compiled` runs), out of cache.

    python -m scripts.lab.linear_kernels --shape 8960x1536 --rows 1,2,4,8,16
    python -m scripts.lab.linear_kernels --shape 151936x1536 --rows 1,4,8 --copies 3      # the default pair's head

`--copies` different weights of the shape are applied in turn, so each call streams its weight from memory, not from
a cache that would hold one (a 1536x8960 bf16 weight is 27.5 MB, within a Zen 4's 32 MB L3). Times are the fastest
of `--repeats` passes over every copy, per call, the two kernels taken in turn; GB/s is the weight's bytes over that
time. Each row count gets its own compiled graph (shapes static, as ar-compiled's step is). `max_abs_diff` compares
the two kernels' outputs.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch import nn


class Linears(nn.Module):
    """Every weight applied to the same rows: one GEMM per weight, as one per layer in a forward."""

    def __init__(self, weights: list[torch.Tensor]):
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(w, requires_grad=False) for w in weights)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [F.linear(x, w) for w in self.weights]


def fastest_per_call(runs, x: torch.Tensor, calls: int, repeats: int) -> list[float]:
    """Seconds per GEMM of each of `runs` (each makes `calls` GEMMs): the fastest of `repeats` passes, the runs taken
    in turn within every pass so the machine's drift hits them alike, after 3 warm-ups each."""
    for run in runs:
        for _ in range(3):
            run(x)
    best = [float("inf")] * len(runs)
    for _ in range(repeats):
        for i, run in enumerate(runs):
            start = time.perf_counter()
            run(x)
            best[i] = min(best[i], time.perf_counter() - start)
    return [b / calls for b in best]


def probe(out_features: int, in_features: int, rows_list: list[int], copies: int, dtype: torch.dtype,
          repeats: int, mode: str) -> list[dict]:
    import torch._inductor.config as inductor_config
    inductor_config.freezing = True  # the weights are constants: inductor picks and packs its own GEMM per shape
    torch.manual_seed(0)
    weights = [torch.randn(out_features, in_features, dtype=dtype) * 0.02 for _ in range(copies)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights]
    gigabytes = out_features * in_features * weights[0].element_size() / 1e9
    results = []
    with torch.inference_mode():
        for rows in rows_list:
            x = torch.randn(rows, in_features, dtype=dtype)

            def onednn(x):
                return [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed]
            torch._dynamo.reset()  # a graph per row count, and none left over from the last
            compiled = torch.compile(Linears(weights).eval(), dynamic=False,
                                     mode=None if mode == "default" else mode)
            difference = max(float((a.float() - b.float()).abs().max()) for a, b in zip(onednn(x), compiled(x)))
            onednn_s, compiled_s = fastest_per_call([onednn, compiled], x, copies, repeats)
            results.append({"rows": rows, "onednn_us": onednn_s * 1e6, "compiled_us": compiled_s * 1e6,
                            "onednn_gbs": gigabytes / onednn_s, "compiled_gbs": gigabytes / compiled_s,
                            "max_abs_diff": difference})
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="8960x1536", help="OUTxIN, as nn.Linear's weight")
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--copies", type=int, default=12, help="weights of the shape taken in turn (out of cache)")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--mode", default="max-autotune", choices=("max-autotune", "default"))
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    out_features, in_features = (int(n) for n in args.shape.split("x"))
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    rows = probe(out_features, in_features, [int(r) for r in args.rows.split(",")], args.copies, dtype,
                 args.repeats, args.mode)
    print(f"{args.shape} {args.dtype}, {args.copies} copies, {torch.get_num_threads()} threads")
    print(f"{'rows':>5s} {'oneDNN us':>10s} {'GB/s':>6s} {'compiled us':>12s} {'GB/s':>6s} {'ratio':>6s} "
          f"{'max |diff|':>11s}")
    for r in rows:
        print(f"{r['rows']:5d} {r['onednn_us']:10.0f} {r['onednn_gbs']:6.1f} {r['compiled_us']:12.0f} "
              f"{r['compiled_gbs']:6.1f} {r['onednn_us'] / r['compiled_us']:5.2f}x {r['max_abs_diff']:11.3g}")
    if args.json:
        from pathlib import Path
        Path(args.json).write_text(json.dumps({"shape": args.shape, "dtype": args.dtype, "copies": args.copies,
                                               "mode": args.mode, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
