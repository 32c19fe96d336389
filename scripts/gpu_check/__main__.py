"""`python -m scripts.gpu_check --out DIR [--device cuda|cpu] [--quick] [--sections a,b] [--budget-s 480]`: see
__init__.py for what it does and writes, docs/gpu.md for how to run it on a lent GPU."""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import transformers

from scripts.gpu_check import app, exact, fast, roofline
from scripts.gpu_check.report import Context, Report, Section, run_sections

# The sections in the order they run, with their wall-time budgets (seconds): on a GPU (the whole run must stay under
# 8 minutes on an H100) and under --quick (the CPU dry run takes about a minute on 2 cores; its budgets are generous
# caps, so that a slow CI machine never fails it for time). exact runs first: it decides whether CUDA graphs may
# default to on.
SECTIONS = (
    Section("roofline", 150, 400, roofline.run, roofline.summarise,
            "one-row steps against their bytes: transformers' forward, the fused step, the fused step compiled"),
    Section("exact", 110, 300, exact.run, exact.summarise,
            "every strategy = AR token for token (fp32 tiny pairs, graphs on and off), seeded sampling, CUDA tests"),
    Section("fast", 160, 300, fast.run, fast.summarise,
            "real-shape cost tables eager and graphed, capture, replay vs kernels, host time, DynaTree vs AR"),
    Section("app", 80, 300, app.run, app.summarise,
            "the run generators behind the GPU boundary; ZeroGPU's fork: CUDA, capture and pickling in the child"),
)
BUDGET_S = {"cuda": 500.0, "cpu": 1800.0}  # the whole run's default wall-time budget per device


def parse(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m scripts.gpu_check", description=__doc__)
    parser.add_argument("--out", required=True, type=Path, help="folder for report.json, summary.md, gpu-tables/")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--quick", action="store_true", help="tiny models only (the CPU dry run)")
    parser.add_argument("--sections", default=",".join(s.name for s in SECTIONS),
                        help="comma list, run in the default order")
    parser.add_argument("--budget-s", type=float, help="wall-time budget of the whole run (default 480 on cuda, "
                        "1800 on cpu)")
    parser.add_argument("--pairs", default="", help="fast: TARGET/DRAFT model specs instead of its list, e.g. "
                        "shape:qwen2.5-7b/shape:qwen2.5-0.5b (comma-separated; tried whatever time is left)")
    parser.add_argument("--models", default="", help="roofline: model shapes instead of its list (comma-separated)")
    parser.add_argument("--aot-only", action="store_true", help="roofline: only the ahead-of-time packages")
    args = parser.parse_args(argv)
    names = [s for s in args.sections.split(",") if s]
    unknown = set(names) - {s.name for s in SECTIONS}
    if unknown:
        parser.error(f"unknown section(s) {', '.join(sorted(unknown))}; known: {', '.join(s.name for s in SECTIONS)}")
    args.sections = tuple(s for s in SECTIONS if s.name in names)
    args.budget_s = BUDGET_S[args.device] if args.budget_s is None else args.budget_s
    args.pairs = tuple((*p.split("/"), 0) for p in args.pairs.split(",") if p)
    return args


def device_info(device: torch.device) -> dict:
    info = {"type": device.type, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "cpu_cores": os.cpu_count(), "threads": torch.get_num_threads()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {**info, "name": props.name, "memory_gib": props.total_memory / 2**30, "cuda": torch.version.cuda,
                "capability": f"{props.major}.{props.minor}"}
    from engine.measure.costs import machine
    return {**info, "name": machine(device)["cpu"]}


def main(argv=None) -> int:
    args = parse(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: use --device cpu (with --quick for the dry run)", file=sys.stderr)
        return 2
    # a fresh cost cache: nothing measured elsewhere (another torch, another hour) is read back as this run's
    with tempfile.TemporaryDirectory(prefix="treeviz-gpu-check-") as cache:
        os.environ["TREEVIZ_CACHE"] = cache
        return check(args)


def check(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    header = {"script": "python -m scripts.gpu_check", "argv": args.argv,
              "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": device_info(device),
              "quick": args.quick, "budget_s": args.budget_s}
    report = Report(args.out, header, SECTIONS)
    report.save()

    def context(name: str, deadline: float) -> Context:
        return Context(device, args.quick, args.out, deadline, report, name, {"pairs": args.pairs, "models": tuple(m for m in args.models.split(",") if m),
                                                                  "aot_only": args.aot_only})

    statuses = run_sections(report, args.sections, args.budget_s, context)
    report.data["verdict"] = verdict(statuses, device)
    report.save()
    print(f"[gpu_check] {statuses}; {args.out / 'report.json'}, {args.out / 'summary.md'}", flush=True)
    return 0 if all(s in ("passed", "skipped") for s in statuses.values()) else 1


def verdict(statuses: dict, device: torch.device) -> str:
    """Whether CUDA graphs may default to on (`auto` = on for CUDA): only where the exact section passed on CUDA."""
    if device.type != "cuda":
        return "a CPU run: says nothing about CUDA graphs"
    if statuses.get("exact") == "passed":
        return "exact passed on CUDA: graphs may default to on for CUDA (capture auto)"
    return f"exact {statuses.get('exact', 'not run')}: graphs stay off by default"


if __name__ == "__main__":
    started = time.monotonic()
    code = main()
    print(f"[gpu_check] exit {code} after {time.monotonic() - started:.1f} s", flush=True)
    raise SystemExit(code)
