"""Fed docs/experiments/2026-12-06-zen4.md ("The captured steps' attention"): one layer's attention over a static
cache as a captured (AOTInductor) step compiles it, per form, against the engine's eager attention, as the cache's
length grows.

    python -m scripts.lab.captured_attention [--lengths 324,1024,2048] [--rows 1,4,16] [--json F]

A captured step attends over every column of its preallocated cache (the unused ones masked), so its attention's
cost grows with the cache's length, not the context's. Each variant is one `aoti_compile_and_package` of one
layer's attention, q [1, H, n, D], k and v [1, Hkv, L, D], mask [1, 1, n, L], with L dynamic (as in a package), at
the default pair's draft and target shapes (H/Hkv/D 14/2/64 and 12/2/128), in the dtype `auto` picks here:

  math          SDPA's math backend, grouped-query heads unexpanded (`enable_gqa`); compiled outside that context
  flash         SDPA's flash backend, `enable_gqa`: the package calls torch's fused CPU kernel on H one-row heads
  folded-math   tree_sdpa's form (engine/core/attention.py: a group's query heads folded into rows), math backend
  folded-flash  tree_sdpa's form on the flash backend: what packages trace since 2026-12-07
  eager         tree_sdpa's form called eagerly: what the engine's eager steps run

Medians of `--repeats` calls after 20 warm-ups, 2 threads; microseconds per layer. Also each compiled variant's
largest difference from eager, in units of the output's spread (0 where it runs eager's kernel on eager's inputs).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.core.attention import tree_sdpa
from engine.models.devices import resolve_dtype
from engine.runtime import load_package

SHAPES = {"draft": (14, 2, 64), "target": (12, 2, 128)}


class Attention(nn.Module):
    """SDPA with the grouped-query heads unexpanded; out [1, n, H, D], as transformers' attention functions return."""

    def forward(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)


class Folded(nn.Module):
    """The engine's tree_sdpa itself (a group's query heads folded into rows)."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups

    def forward(self, q, k, v, mask):
        return tree_sdpa(self, q, k, v, mask)[0]


VARIANTS = {"math": (False, SDPBackend.MATH), "flash": (False, SDPBackend.FLASH_ATTENTION),
            "folded-math": (True, SDPBackend.MATH), "folded-flash": (True, SDPBackend.FLASH_ATTENTION)}


def module(folded: bool, shape) -> nn.Module:
    heads, kv_heads, _ = shape
    return Folded(heads // kv_heads) if folded else Attention()


def inputs(shape, rows: int, length: int, dtype: torch.dtype):
    heads, kv_heads, dim = shape
    torch.manual_seed(0)
    q = torch.randn(1, heads, rows, dim, dtype=dtype)
    k, v = (torch.randn(1, kv_heads, length, dim, dtype=dtype) for _ in range(2))
    mask = torch.full((1, 1, rows, length), torch.finfo(dtype).min, dtype=dtype)
    mask[..., :300 + rows] = 0  # 300 cached positions and the new rows visible; the rest unused
    return q, k, v, mask


def compiled(variant: str, shape, rows: int, dtype: torch.dtype, folder: Path):
    folded, backend = VARIANTS[variant]
    length = torch.export.Dim("length", min=16, max=1 << 17)
    example = inputs(shape, rows, 512, dtype)
    with sdpa_kernel(backend), torch.inference_mode():
        program = torch.export.export(module(folded, shape), example, dynamic_shapes=({}, {2: length}, {2: length},
                                                                             {3: length}), strict=False)
        file = folder / f"{variant}-{shape[2]}-{rows}.pt2"
        torch._inductor.aoti_compile_and_package(program, package_path=str(file))
    return load_package(file)


def median_us(fn, args, repeats: int) -> float:
    for _ in range(20):
        fn(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def probe(rows_list: list[int], lengths: list[int], repeats: int) -> list[dict]:
    """One row per (model, rows, length): eager's microseconds, and each variant's with its largest difference from
    eager in units of the output's spread."""
    dtype = resolve_dtype("auto", torch.device("cpu"))
    results = []
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        for model, shape in SHAPES.items():
            eager = module(True, shape)
            for rows in rows_list:
                runners = {name: compiled(name, shape, rows, dtype, Path(tmp)) for name in VARIANTS}
                for length in lengths:
                    x = inputs(shape, rows, length, dtype)
                    reference = eager(*x).float()
                    spread = float(reference.std())
                    row = {"model": model, "rows": rows, "length": length, "dtype": str(dtype),
                           "eager_us": median_us(eager, x, repeats)}
                    for name, runner in runners.items():
                        row[f"{name}_us"] = median_us(lambda *a: runner(*a), x, repeats)
                        row[f"{name}_diff"] = float((runner(*x)[0].float() - reference).abs().max()) / spread
                    results.append(row)
                    print(f"{model:6s} rows {rows:2d} L {length:5d}: eager {row['eager_us']:7.1f}, " + ", ".join(
                        f"{name} {row[f'{name}_us']:7.1f} ({row[f'{name}_diff']:.1e})" for name in VARIANTS),
                        flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="324,1024,2048")
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(f"{resolve_dtype('auto', torch.device('cpu'))}, 2 threads; us per layer "
          "(max |diff| from eager / output spread)")
    results = probe([int(r) for r in args.rows.split(",")], [int(n) for n in args.lengths.split(",")], args.repeats)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
