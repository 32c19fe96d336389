"""Lab probe behind issue 44's item 1 on this machine: where the app's draft spends its one-row step.

The default draft as the app loads it on this CPU (its 32,768-token head, q|k|v and gate|up fused, the formats the
probe routes it to), `--steps` one-row forwards over a 300-token cache under torch.profiler, after 20 warm-ups. Prints
the profiler's table by op (self CPU time per step), the step's median time outside the profiler, and the time the
step's weight bytes take at this machine's streaming bandwidth.

    python -m scripts.lab.draft_profile [--steps 30] [--rows 1]
"""
import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from engine.cpu.fusion import fuse_projections
from engine.cpu.kernels import step_bytes
from engine.cpu.packages import prepare_model, remember_fingerprint
from engine.core.steps import StaticSteps
from engine.measure.costs import PREFIX, filled_cache, machine_bandwidth, probe_ids, timed_forward
from scripts.lab.fused_draft import app_draft, with_formats


def captured_forward(model, name: str, rows: int):
    """A function timing one `rows`-row forward after PREFIX cached tokens through the draft's captured package."""
    captured = prepare_model(model, name, "draft")
    if captured.package_for(rows) is None:
        raise SystemExit(f"no captured package serves {rows} rows here: {captured.notes}")
    captured.serve_all()
    ids = probe_ids(model, PREFIX + rows).tolist()
    steps = StaticSteps(model, PREFIX + rows + 8, (1,), captured=captured)
    steps.prefill(ids[:PREFIX])

    def forward() -> float:
        start = time.perf_counter()
        steps.forward(ids[PREFIX:PREFIX + rows], list(range(PREFIX, PREFIX + rows)))
        seconds = time.perf_counter() - start
        steps.keep(PREFIX, [])
        return seconds
    return forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--captured", action="store_true", help="profile the app's captured package, not eager")
    args = parser.parse_args()
    model, _, name = app_draft()
    fuse_projections(model)
    remember_fingerprint(model)  # a package's key, taken as the app takes it: before a format replaces a weight
    print(f"formats: {with_formats(model, name)}")
    bandwidth = machine_bandwidth(torch.device("cpu"))
    with torch.inference_mode():
        if args.captured:
            forward = captured_forward(model, name, args.rows)
        else:
            ids = probe_ids(model, PREFIX + args.rows)
            cache = filled_cache(model, ids, PREFIX)
            forward = lambda: timed_forward(model, ids, PREFIX, args.rows, cache)  # noqa: E731
        for _ in range(20):
            forward()
        plain = [forward() for _ in range(args.steps)]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                forward()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    nbytes = step_bytes(model)
    print(f"{args.rows}-row step: median {statistics.median(plain) * 1000:.2f} ms outside the profiler "
          f"(min {min(plain) * 1000:.2f}); {nbytes / 1e9:.3f} GB of weights = {nbytes / bandwidth * 1000:.1f} ms at "
          f"{bandwidth / 1e9:.1f} GB/s; divide the table's totals by {args.steps} for one step")


if __name__ == "__main__":
    main()
