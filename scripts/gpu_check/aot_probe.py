"""The fused layer's AOTInductor packages on one model shape, in a process of its own (roofline.py runs it so): a
crash inside the compiler or the package loader (a segfault on the first H200 run) ends this process, not the check.

    python -m scripts.gpu_check.aot_probe --model qwen2.5-1.5b --device cuda --json FILE

Prints each stage as it is reached (build, load, an eager-steps forward, graph capture, timing), so a crash still
says how far it got; FILE gets the numbers: build and load seconds, the first and the median one-row forward.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def stage(name: str, **numbers) -> None:
    print(f"[aot] {name} {json.dumps(numbers)}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-1.5b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    from engine.core.steps import StaticSteps, graph_capacity
    from engine.cuda import aot, fused
    from engine.measure.costs import PREFIX, probe_ids
    from scripts.device_costs import one_row_walls
    from scripts.gpu_check.roofline import build
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    model = build(args.model, torch.bfloat16 if cuda else torch.float32, device)
    step = fused.install(model, compiled=False)
    out = {"model": args.model}
    with tempfile.TemporaryDirectory(prefix="treeviz-aot-probe-") as folder:
        started = time.monotonic()
        out["built"] = aot.build(step, Path(folder))
        out["build_s"] = time.monotonic() - started
        stage("built", seconds=out["build_s"])
        out["load_s"] = aot.load(step, Path(folder))
        stage("loaded", seconds=out["load_s"])
    ids = probe_ids(model, PREFIX + 1).tolist()
    eager = StaticSteps(model, graph_capacity(PREFIX + 64), (1,))
    eager.prefill(ids[:PREFIX])
    out["eager_steps_ms"] = 1e3 * statistics.median(one_row_walls(eager, ids, 5))
    stage("ran on eager steps", ms=out["eager_steps_ms"])
    del eager
    started = time.monotonic()
    steps = StaticSteps(model, graph_capacity(PREFIX + 64), (1,), graphs=cuda)
    out["capture_s"] = time.monotonic() - started
    stage("graph captured" if cuda else "static steps made", seconds=out["capture_s"])
    steps.prefill(ids[:PREFIX])
    walls = one_row_walls(steps, ids, args.repeats)
    out.update(first_ms=1e3 * walls[0], wall_ms=1e3 * statistics.median(walls))
    stage("timed", ms=out["wall_ms"])
    args.json.write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
