"""Lab probe: could dyn8's rows be independent of their batch? Two ways of quantising every call over the one fixed
range [-1, 1], against the production kernel (engine/cpu/kernels.py `_dyn8`: one row as it is, several rows each
scaled to max |x| = 1, then the call's own range), on this CPU.

  edge rows     each row scaled to max |x| = 1, two rows appended (+1 and -1 in the first column): the call's range
                is [-1, 1] whatever the batch. fbgemm then multiplies two rows more.
  edge columns  the same rows, and two columns appended to each (+1, -1) against two zero columns of the weight:
                the same codes and sums, the same number of rows.

1. Batch independence: a row alone against the row in a batch of 16, bit for bit.
2. Speed: each variant interleaved call by call at the default draft's fused shapes (q|k|v, o, gate|up, down, the
   32,768-token head), 1, 4, 8 and 16 rows, medians of `--repeats` calls after 30 warm-ups.
3. What the draft proposes: the app's draft (fused, every linear in dyn8) stepped one row at a time over the first
   64 tokens of each of the bench's code, chat and prose prompts; the top-1 token under the fixed range (both
   variants compute the same codes) and under the production kernel, each against the same draft's in fp32.

    python -m scripts.lab.dyn8_range [--repeats 200]
"""
import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from engine.core.prompts import encode_prompt, load_prompt_set
from engine.cpu import kernels
from engine.cpu.fusion import fuse_projections
from engine.cpu.kernels import RoutedLinear, Router, add_format, dyn8_params, route_linears
from engine.runtime import forcing
from scripts.lab.fused_draft import app_draft

SHAPES = ((896, 1152), (896, 896), (896, 9728), (4864, 896), (896, 32768))
ROWS = (1, 4, 8, 16)
TOKENS = 64  # of each prompt, one row at a time
PRODUCTION = kernels.KERNELS["dyn8"]


def scaled(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.abs().amax(dim=1, keepdim=True).clamp_(min=1e-30)
    return x / rows, rows


def edge_rows(x, tensors, bias, out_features, group):
    unit, rows = scaled(x)
    edges = torch.zeros(2, x.shape[1])
    edges[0, 0], edges[1, 0] = 1.0, -1.0
    out = torch.ops.quantized.linear_dynamic(torch.cat((unit, edges)), dyn8_params(tensors[0]), True)[:-2]
    return out.mul_(rows) if bias is None else out.mul_(rows) + bias


def edge_columns(x, padded, bias):
    unit, rows = scaled(x)
    edges = torch.tensor([[1.0, -1.0]]).expand(x.shape[0], 2)
    out = torch.ops.quantized.linear_dynamic(torch.cat((unit, edges), 1), padded, True).mul_(rows)
    return out if bias is None else out + bias


def padded_params(layer: RoutedLinear):
    """The layer's dyn8 weight with two zero columns appended, packed for fbgemm."""
    qweight, _ = torch.ops.quantized.linear_unpack(dyn8_params(layer.dyn8_handle))
    codes = torch.nn.functional.pad(qweight.int_repr(), (0, 2))
    qweight = torch._make_per_channel_quantized_tensor(codes, qweight.q_per_channel_scales(),
                                                       qweight.q_per_channel_zero_points(), 0)
    return kernels._prepack_dyn8(qweight)[0]


def variants(layer: RoutedLinear) -> dict:
    tensors, padded = layer.tensors("dyn8"), padded_params(layer)
    return {"production": lambda x: PRODUCTION(x, tensors, None, layer.out_features, 0),
            "edge rows": lambda x: edge_rows(x, tensors, None, layer.out_features, 0),
            "edge columns": lambda x: edge_columns(x, padded, None)}


def independence() -> None:
    layer = RoutedLinear(torch.nn.Linear(896, 1152, bias=False), Router())
    layer.add("dyn8")
    x = torch.randn(16, 896, generator=torch.Generator().manual_seed(3))
    x[1:] *= torch.linspace(-3.0, 3.0, 15)[:, None]
    with torch.inference_mode():
        for name, run in variants(layer).items():
            alone = torch.cat([run(row[None]) for row in x])
            print(f"{name}: a row alone equals the row in a batch of 16, bit for bit: {torch.equal(alone, run(x))}")


def speed(repeats: int) -> None:
    for inputs, outputs in SHAPES:
        layer = RoutedLinear(torch.nn.Linear(inputs, outputs, bias=False), Router())
        layer.add("dyn8")
        runs = variants(layer)
        for rows in ROWS:
            x = torch.randn(rows, inputs)
            samples = {name: [] for name in runs}
            for i in range(30 + repeats):
                for name, run in runs.items():
                    start = time.perf_counter()
                    run(x)
                    if i >= 30:
                        samples[name].append(time.perf_counter() - start)
            us = {name: statistics.median(s) * 1e6 for name, s in samples.items()}
            print(f"{inputs}x{outputs} rows {rows:2}: " + ", ".join(f"{n} {v:7.1f} us" for n, v in us.items()))


def proposals() -> None:
    model, tokenizer, _ = app_draft()
    fuse_projections(model)
    route_linears(model)
    add_format(model, "dyn8")
    kernels_of = {"fixed range": edge_rows, "production": PRODUCTION}
    agree, steps = dict.fromkeys(kernels_of, 0), 0
    entries = load_prompt_set("all")
    with torch.inference_mode():
        for entry in entries:
            ids = torch.tensor(encode_prompt(tokenizer, entry["prompt"])[:TOKENS])
            want = one_row_steps(model, ids, "plain", PRODUCTION)
            for name, kernel in kernels_of.items():
                agree[name] += int((one_row_steps(model, ids, "dyn8", kernel) == want).sum())
            steps += len(ids)
    print(f"{len(entries)} prompts, {steps} one-row steps, top-1 equal to the fp32 draft's: "
          + ", ".join(f"{name} {count / steps:.4f}" for name, count in agree.items()))


def one_row_steps(model, ids: torch.Tensor, path: str, kernel) -> torch.Tensor:
    """The top-1 token after each prefix of `ids`, one row per forward over the growing cache (a decode's calls)."""
    kernels.KERNELS["dyn8"] = kernel
    cache, tops = DynamicCache(config=model.config), []
    try:
        with forcing(model, path):
            for token in ids:
                logits = model(input_ids=token.view(1, 1), past_key_values=cache, use_cache=True).logits
                tops.append(int(logits[0, -1].argmax()))
    finally:
        kernels.KERNELS["dyn8"] = PRODUCTION
    return torch.tensor(tops)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--skip", choices=("speed", "proposals"), action="append", default=[])
    args = parser.parse_args()
    torch.manual_seed(0)
    independence()
    if "speed" not in args.skip:
        speed(args.repeats)
    if "proposals" not in args.skip:
        proposals()


if __name__ == "__main__":
    main()
