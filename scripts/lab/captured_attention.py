"""Lab probe: one layer's attention over a static cache as a captured (AOTInductor) step compiles it, per SDPA
backend, against eager SDPA, as the cache's length grows.

    python -m scripts.lab.captured_attention [--lengths 324,1024,2048] [--rows 1,8]

A captured step attends over every column of its preallocated cache (the unused ones masked), so its attention's
cost grows with the cache's length, not the context's. Each variant is one `aoti_compile_and_package` of
`scaled_dot_product_attention(q [1, H, n, D], k, v [1, Hkv, L, D], mask [1, 1, n, L])` with L dynamic (as a package
is), at the default pair's draft and target shapes (H/Hkv/D 14/2/64 and 12/2/128), in the dtype `auto` picks here:

  math    SDPA's math backend with grouped-query heads unexpanded (`enable_gqa`): inductor decomposes and fuses it
  flash   SDPA's flash backend, `enable_gqa`: inductor calls torch's fused CPU kernel
  eager   torch's fused CPU kernel, called eagerly (what the engine's eager steps run)

Medians of `--repeats` calls after 20 warm-ups, 2 threads; microseconds per layer. Also the largest difference of
each compiled variant from eager, in units of the output's spread.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.models.devices import resolve_dtype
from engine.runtime import load_package

SHAPES = {"draft": (14, 2, 64), "target": (12, 2, 128)}
class Attention(nn.Module):
    def forward(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class Folded(nn.Module):
    """engine/core/attention.py's tree_sdpa: a group's query heads folded into rows, the mask's rows repeated."""

    def forward(self, q, k, v, mask):
        _, heads, n, dim = q.shape
        kv_heads = k.shape[1]
        groups = heads // kv_heads
        folded = q.contiguous().view(1, kv_heads, groups * n, dim)
        mask = mask.expand(1, 1, n, mask.shape[-1]).repeat(1, 1, groups, 1)
        out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask)
        return out.reshape(1, heads, n, dim)


VARIANTS = {"math": (Attention, SDPBackend.MATH), "flash": (Attention, SDPBackend.FLASH_ATTENTION),
            "folded-math": (None, SDPBackend.MATH), "folded-flash": (None, SDPBackend.FLASH_ATTENTION)}


def inputs(shape, rows: int, length: int, dtype: torch.dtype):
    heads, kv_heads, dim = shape
    torch.manual_seed(0)
    q = torch.randn(1, heads, rows, dim, dtype=dtype)
    k, v = (torch.randn(1, kv_heads, length, dim, dtype=dtype) for _ in range(2))
    mask = torch.full((1, 1, rows, length), torch.finfo(dtype).min, dtype=dtype)
    mask[..., :300 + rows] = 0  # 300 cached positions and the new rows visible; the rest unused
    return q, k, v, mask


def compiled(variant: str, shape, rows: int, dtype: torch.dtype, folder: Path):
    module, backend = VARIANTS[variant]
    module = (module or Folded)()
    length = torch.export.Dim("length", min=16, max=1 << 17)
    example = inputs(shape, rows, 512, dtype)
    with sdpa_kernel(backend), torch.inference_mode():
        program = torch.export.export(module, example, dynamic_shapes=({}, {2: length}, {2: length},
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="324,1024,2048")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(2)
    dtype = resolve_dtype("auto", torch.device("cpu"))
    eager = Folded()
    print(f"{dtype}, 2 threads; us per layer (max |diff| from eager / output spread)")
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        for model, shape in SHAPES.items():
            for rows in (int(r) for r in args.rows.split(",")):
                runners = {name: compiled(name, shape, rows, dtype, Path(tmp)) for name in VARIANTS}
                for length in (int(n) for n in args.lengths.split(",")):
                    x = inputs(shape, rows, length, dtype)
                    reference = eager(*x).float()
                    spread = float(reference.std())
                    cells = [f"eager {median_us(eager, x, args.repeats):7.1f}"]
                    for name, runner in runners.items():
                        diff = float((runner(*x)[0].float() - reference).abs().max()) / spread
                        cells.append(f"{name} {median_us(lambda *a: runner(*a), x, args.repeats):7.1f} ({diff:.1e})")
                    print(f"{model:6s} rows {rows:2d} L {length:5d}: " + ", ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
