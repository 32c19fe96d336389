"""Fed docs/experiments/2026-11-27-zen3.md and 2026-12-06-zen4.md: SDPA against two GEMMs and a softmax for a few
query rows on this CPU.

    python -m scripts.lab.attention_probe [--columns 430]

The folded grouped-query rows the engine's tree_sdpa hands SDPA (engine/core/attention.py), masked, at the default
pair's attention shapes, fp32 and bf16, 2 threads; medians of 200 calls after 30 warm-ups. 300 cached positions and
the new rows are visible; with `--columns` above that, the static cache's unused columns are attended over masked (as
StaticSteps does), and `sliced` is SDPA over the visible columns alone.
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(2)
def few_rows(q, k, v, mask, scale):
    s = torch.matmul(q, k.transpose(-1, -2)).to(torch.float32) * scale + mask
    return torch.matmul(torch.softmax(s, -1).to(v.dtype), v)
def med(fn, reps=200):
    for _ in range(30): fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6
parser = argparse.ArgumentParser()
parser.add_argument("--columns", type=int, default=0, help="cache columns attended over (default: the visible ones)")
columns = parser.parse_args().columns
for dtype in (torch.float32, torch.bfloat16):
    for name, kvh, g in (("draft 0.5B", 2, 7), ("target 1.5B", 2, 6)):
        for n in (1, 4, 16):
            seen = 300 + n
            L = max(columns, seen)
            q = torch.randn(1, kvh, g * n, 128, dtype=dtype); k = torch.randn(1, kvh, L, 128, dtype=dtype); v = torch.randn_like(k)
            mask = torch.zeros(1, 1, g * n, L, dtype=dtype); mask[..., seen - 1:] = torch.finfo(dtype).min
            a = med(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=128 ** -0.5))
            m32 = mask.to(torch.float32)
            b = med(lambda: few_rows(q, k, v, m32, 128 ** -0.5))
            ks, vs, ms = k[:, :, :seen], v[:, :, :seen], mask[..., :seen]
            c = med(lambda: F.scaled_dot_product_attention(q, ks, vs, attn_mask=ms, scale=128 ** -0.5))
            print(f"{str(dtype)[6:]:9} {name:12} rows {n:2}: sdpa {a:7.1f} us  gemms+softmax {b:7.1f} us  "
                  f"ratio {a / b:5.2f}  sdpa sliced {c:7.1f} us")
