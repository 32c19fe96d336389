"""The cost tables of real model shapes on a device, eager and on captured CUDA graphs, with no download.

    python -m scripts.device_costs --pairs qwen2.5-1.5b/qwen2.5-0.5b,pythia-2.8b/pythia-70m --json costs.json
    python -m scripts.device_costs --device cpu --pairs pythia-2.8b/pythia-70m --dtype fp32 --no-graphs

Models are randomly initialised at their published shapes (engine/models/shapes.py; cost depends on the shapes, not
the weights). Per model, the engine's own calibration (engine/measure/costs.py): `measure` on the eager path (a growing
cache), and, on CUDA, `measure_graphed` (engine/measure/graphed.py) through the engine's static steps with one captured
graph per rung -- the steps runs take. Then, on CUDA:
- capture: seconds per bucket and the GPU memory the graphs hold (StaticSteps.capture_info);
- a single-row replay's wall time against the summed duration of the kernels it ran (torch.profiler): how close a
  replayed step is to the GPU's own time (launch gaps and host work are the difference);
- the single-row replay on caches of 1,024 and 8,192 positions: what the unused columns of a long static cache cost.
Per pair: c = draft step / target step and t(n) = verifying n rows / target step, eager and graphed.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from engine.core.steps import StaticSteps
from engine.measure.costs import LADDER, PREFIX, measure, probe_ids
from engine.measure.graphed import measure_graphed
from engine.models.shapes import shape_model
from engine.runtime import synchronize

DEFAULT_PAIRS = ("qwen2.5-1.5b/qwen2.5-0.5b,qwen2.5-7b/qwen2.5-0.5b,qwen3-8b/qwen3-0.6b,"
                 "smollm2-1.7b/smollm2-135m,pythia-2.8b/pythia-70m")


def one_row_walls(steps, ids: list[int], repeats: int, warmup: int = 3) -> list[float]:
    """Wall seconds of `repeats` one-row forwards at position PREFIX after the prefilled prefix (synchronised; the
    cache rolled back after each), after `warmup` untimed ones."""
    walls = []
    for _ in range(repeats + warmup):
        synchronize(steps.device)
        start = time.perf_counter()
        steps.forward([ids[PREFIX]], [PREFIX])
        synchronize(steps.device)
        walls.append(time.perf_counter() - start)
        steps.keep(PREFIX, [])
    return walls[warmup:]


def replay_vs_kernels(model, repeats: int = 20) -> dict:
    """A single-row graphed step after a PREFIX-token cache: median wall ms of one forward (synchronised), the summed
    ms of the kernels that forward ran (profiler), and the median wall ms on a cache of 8,192 positions."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for max_len in (1024, 8192):
        steps = StaticSteps(model, max_len, (1,), graphs=True)
        ids = probe_ids(model, PREFIX + 1).tolist()
        steps.prefill(ids[:PREFIX])
        walls = one_row_walls(steps, ids, repeats)
        out[f"wall_ms_{max_len}"] = 1e3 * sorted(walls)[repeats // 2]
        if max_len == 1024:  # the same call as timed: input copies, the replay, the logits' copy out
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                steps.forward([ids[PREFIX]], [PREFIX])
                synchronize(steps.device)
            steps.keep(PREFIX, [])
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            out["kernel_ms"] = sum(e.device_time for e in kernels) / 1e3
            out["kernels"] = len(kernels)
            out["capture"] = steps.capture_info
        del steps
        torch.cuda.empty_cache()
    return out


def one_model(name: str, dtype: torch.dtype, device: torch.device, graphs: bool) -> dict:
    start = time.perf_counter()
    model = shape_model(name, dtype, device)
    row: dict = {"name": name, "build_s": time.perf_counter() - start,
                 "params": sum(p.numel() for p in model.parameters())}
    with torch.inference_mode():
        row["eager"] = measure(model, ["plain"])["plain"]
        if graphs:
            start = time.perf_counter()
            row["graphed"] = measure_graphed(model, ["plain"])["plain"]
            row["graphed_table_s"] = time.perf_counter() - start  # captures (7 graphs) + the timing sweeps
            row.update(replay_vs_kernels(model))
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def pair_summary(target: dict, draft: dict) -> dict:
    out = {}
    for mode in ("eager", "graphed"):
        if mode in target:
            t, d = target[mode], draft[mode]
            out[mode] = {"c": d[1] / t[1], "t": {r: t[r] / t[1] for r in LADDER},
                         "target_ms": {r: 1e3 * t[r] for r in LADDER}, "draft_ms": {r: 1e3 * d[r] for r in LADDER}}
    return out


def print_pair(name: str, summary: dict, target: dict, draft: dict) -> None:
    print(f"\n{name}")
    for mode, s in summary.items():
        ms = "  ".join(f"{r}:{s['target_ms'][r]:.2f}" for r in LADDER)
        print(f"  {mode:8s} target ms {ms}")
        print(f"  {mode:8s} draft 1-row {s['draft_ms'][1]:.2f} ms   c = {s['c']:.3f}   t(n): "
              + " ".join(f"{r}:{s['t'][r]:.2f}" for r in LADDER))
    for row in (target, draft):
        if "kernel_ms" in row:
            cap = row["capture"]
            print(f"  {row['name']:14s} 1-row replay {row['wall_ms_1024']:.2f} ms vs kernels {row['kernel_ms']:.2f} ms "
                  f"({row['kernels']} kernels) = {row['wall_ms_1024'] / row['kernel_ms']:.2f}x; cache 8192: "
                  f"{row['wall_ms_8192']:.2f} ms; capture {sum(cap['seconds'].values()):.2f} s, "
                  f"{cap['reserved_bytes'] / 2**20:.0f} MiB reserved")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--pairs", default=DEFAULT_PAIRS, help="comma list of target/draft shape names")
    parser.add_argument("--no-graphs", action="store_true", help="eager tables only (any device)")
    parser.add_argument("--json", help="write every measurement to this file")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    graphs = device.type == "cuda" and not args.no_graphs
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"device: {where} | torch {torch.__version__} | dtype {args.dtype} | prefix {PREFIX} | min of 3")
    report, models = {"device": where, "torch": torch.__version__, "dtype": args.dtype, "pairs": {}}, {}
    for pair in args.pairs.split(","):
        target, draft = pair.split("/")
        for name in (target, draft):
            if name not in models:
                models[name] = one_model(name, dtype, device, graphs)
                print(f"  measured {name} in {models[name]['build_s']:.1f} s build"
                      + (f" + {models[name]['graphed_table_s']:.1f} s graphed table" if graphs else ""), flush=True)
        summary = pair_summary(models[target], models[draft])
        report["pairs"][pair] = summary
        print_pair(pair, summary, models[target], models[draft])
    report["models"] = models
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
