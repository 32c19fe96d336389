"""roofline: each model's one-row step against the bytes it must read, on transformers' forward and on the fused step.

Per model shape (random weights of published shapes, bf16 on CUDA; the tiny model in fp32 under --quick), three ways
of running the same one-row graphed step after a PREFIX-token prefill (engine/core/steps.py StaticSteps):
  transformers    the model's own modules (what ran before engine/cuda/fused.py);
  fused           fused Q/K/V and gate/up, folded grouped-query attention, eager layer (ZeroGPU's path: no compile);
  fused-compiled  the same layer compiled by inductor (dynamic shapes), what load_pair installs on CUDA.
For each: median wall ms of a synchronised forward, the profiler's kernel count (per decoder layer) and summed kernel
time, and the fraction of memory bandwidth it reaches: bytes read per step (every weight once, the KV cache's filled
rows) over the wall time, against this device's measured copy bandwidth (a 1 GiB device-to-device copy: read + write)
and its nominal figure where the name is known. Targets (the GPU issue): >= 50 % for the ~1.5B target, >= 70 % for
7-8B, the 0.5B draft <= 0.7 ms on an H100, <= 15 kernels per layer.
"""
from __future__ import annotations

import gc
import statistics
import time
import traceback

import torch

from engine.core.steps import StaticSteps, graph_capacity
from engine.cuda import fused
from engine.measure.costs import PREFIX, probe_ids
from engine.models import tiny_random_model
from engine.models.shapes import shape_model
from engine.runtime import synchronize
from scripts.device_costs import one_row_walls
from scripts.gpu_check.fast import profile_one_row

MODELS = ("qwen2.5-1.5b", "qwen2.5-0.5b", "qwen2.5-7b", "qwen3-8b")
QUICK_MODELS = ("tiny",)
NOMINAL_GBPS = {"H100 80GB HBM3": 3350, "H100": 3350, "H200": 4800, "A100": 2039, "RTX PRO 6000": 1792, "L40S": 864,
                "A10G": 600, "L4": 300}
WAYS = ("transformers", "fused", "fused-compiled", "fused-aot")
AOT_MODELS = ("qwen2.5-1.5b", "tiny")  # ZeroGPU's path is timed on the default target's shape (building takes a while)
REPEATS = 30


def run(ctx) -> dict:
    cuda = ctx.device.type == "cuda"
    result = {"dtype": "bfloat16" if cuda else "float32", "prefix": PREFIX, "models": {}, "skipped": {}}
    result["bandwidth"] = copy_bandwidth(ctx.device, ctx.report.data["device"].get("name", ""))
    ctx.checkpoint(result)
    names = ctx.options.get("models") or (QUICK_MODELS if ctx.quick else MODELS)
    # every model three ways first, then the ahead-of-time packages (their build is the longest part)
    aot_names = [n for n in names if n in AOT_MODELS]
    ways_first = () if ctx.options.get("aot_only") else WAYS[:3]
    for name, ways in [(n, ways_first) for n in names if ways_first] + [(n, WAYS[3:]) for n in aot_names]:
        if ctx.left() < 25:
            result["skipped"][f"{name} {', '.join(ways)}"] = f"{ctx.left():.0f} s left in the section"
            continue
        try:
            one_model(ctx, name, ways, result)
        except Exception as err:  # noqa: BLE001 - recorded; the next model runs
            result["models"][name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-2000:]}
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        ctx.checkpoint(result)
    result["passed"] = bool(result["models"]) and all("error" not in m for m in result["models"].values())
    return result


def copy_bandwidth(device: torch.device, name: str) -> dict:
    """GB/s of a device-to-device copy (bytes read + written over the time; best of 5), and the nominal figure."""
    nominal = next((v for k, v in NOMINAL_GBPS.items() if k.lower() in name.lower()), None)
    size = (1 << 30) if device.type == "cuda" else (1 << 26)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    del src, dst
    return {"measured_gbps": 2 * size / best / 1e9, "nominal_gbps": nominal}


def build(name: str, dtype: torch.dtype, device: torch.device):
    if name == "tiny":
        return tiny_random_model(0).to(device=device, dtype=dtype)
    return shape_model(name, dtype, device)


def step_bytes(model, prefix: int) -> int:
    """Bytes one step must read: every parameter but the input embedding (one row of it), and the cache's rows."""
    config = model.config.get_text_config()
    embedding = model.get_input_embeddings().weight
    params = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embedding)
    if model.get_output_embeddings().weight is embedding:  # tied: the head reads the table once
        params += embedding.numel() * embedding.element_size()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    cache = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * prefix * embedding.element_size()
    return params + cache


def one_model(ctx, name: str, ways: tuple[str, ...], result: dict) -> dict:
    """`name`'s model built, then measured each of `ways`, into result["models"][name]."""
    dtype = torch.bfloat16 if ctx.device.type == "cuda" else torch.float32
    model = build(name, dtype, ctx.device)
    layers = model.config.get_text_config().num_hidden_layers
    out = result["models"].setdefault(name, {"layers": layers, "step_mb": step_bytes(model, PREFIX) / 1e6,
                                             "ways": {}})
    for way in ways:
        if ctx.left() < 10:
            out["ways"][way] = {"skipped": f"{ctx.left():.0f} s left"}
            continue
        try:
            if way == "fused-aot":
                probe = out["ways"][way] = ahead_of_time_probe(ctx, name)
                if "wall_ms" in probe:
                    probe.update(bandwidth_of(out["step_mb"] * 1e6, probe["wall_ms"] / 1e3, result["bandwidth"]),
                                 setup_s=probe.get("capture_s", 0.0))
                continue
            out["ways"][way] = one_way(ctx, model, way, out["step_mb"] * 1e6, layers, result["bandwidth"])
        except Exception as err:  # noqa: BLE001 - recorded; the next way runs
            out["ways"][way] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-1500:]}
        ctx.checkpoint(result)
    fused.uninstall(model)
    return out


def one_way(ctx, model, way: str, step_bytes_: float, layers: int, bandwidth: dict) -> dict:
    cuda = ctx.device.type == "cuda"
    fused.uninstall(model)
    out = {}
    if way != "transformers":
        fused.install(model, compiled=way == "fused-compiled")
    started = time.monotonic()
    steps = StaticSteps(model, graph_capacity(PREFIX + 64), (1,), graphs=cuda)  # a compiled layer compiles here
    out["setup_s"] = time.monotonic() - started
    ids = probe_ids(model, PREFIX + 1).tolist()
    steps.prefill(ids[:PREFIX])
    walls = one_row_walls(steps, ids, REPEATS)
    wall = statistics.median(walls)
    kernels = profile_one_row(steps, ids) if cuda else {}  # the fast section's kernel count
    out.update({"wall_ms": 1e3 * wall, "first_ms": 1e3 * walls[0], **kernels})
    step = fused.installed(model)
    if step is not None and step.compile_error:
        out["compile_error"] = step.compile_error
    if kernels.get("kernels"):
        out["kernels_per_layer"] = kernels["kernels"] / layers
    out.update(bandwidth_of(step_bytes_, wall, bandwidth))
    if steps.graphs is not None:
        steps.graphs.release()
    return out


def ahead_of_time_probe(ctx, name: str) -> dict:
    """scripts/gpu_check/aot_probe.py on `name` in a process of its own (a crash in the compiler or the loader ends
    that process only): its numbers, or how far it got, its return code and its output's tail."""
    import json
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="treeviz-aot-") as folder:
        file = Path(folder) / "aot.json"
        command = [sys.executable, "-m", "scripts.gpu_check.aot_probe", "--model", name, "--device",
                   ctx.device.type, "--json", str(file)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=max(ctx.left() - 5, 30))
        except subprocess.TimeoutExpired as err:
            return {"error": "timed out", "stages": _stages(err.stdout or "")}
        out = json.loads(file.read_text()) if file.exists() else {}
        out.update(returncode=done.returncode, stages=_stages(done.stdout))
        if done.returncode != 0:
            out["error"] = f"exit {done.returncode}"
            out["tail"] = (done.stdout + done.stderr)[-1500:]
        return out


def _stages(text) -> list[str]:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return [line[6:] for line in text.splitlines() if line.startswith("[aot] ")]


def bandwidth_of(step_bytes_: float, wall_s: float, bandwidth: dict) -> dict:
    """GB/s of a step that reads `step_bytes_` in `wall_s`, and its fraction of the measured and nominal bandwidth."""
    gbps = step_bytes_ / wall_s / 1e9
    out = {"gbps": gbps, "of_measured": gbps / bandwidth["measured_gbps"]}
    if bandwidth.get("nominal_gbps"):
        out["of_nominal"] = gbps / bandwidth["nominal_gbps"]
    return out


def summarise(result: dict) -> list[str]:
    bw = result.get("bandwidth", {})
    lines = [f"{result['dtype']}, one-row graphed step after {result['prefix']} tokens; copy bandwidth measured "
             f"{bw.get('measured_gbps', float('nan')):.0f} GB/s (nominal {bw.get('nominal_gbps')} GB/s).", "",
             "| model | way | ms | kernels/layer | kernel ms | GB/s | of measured | of nominal | setup s |",
             "|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for name, m in result.get("models", {}).items():
        if "error" in m:
            lines.append(f"| {name} | error: {m['error'][:80]} | | | | | | | |")
            continue
        for way, w in m["ways"].items():
            if "wall_ms" not in w:
                lines.append(f"| {name} | {way}: {w.get('error', w.get('skipped', ''))[:80]} | | | | | | | |")
                if w.get("stages") is not None:
                    notes.append(f"- {name}, {way}: reached {w['stages'] or 'no stage'}; {w.get('tail', '')[-300:]}")
                continue
            lines.append(f"| {name} ({m['step_mb']:.0f} MB) | {way} | {w['wall_ms']:.3f} | "
                         f"{w.get('kernels_per_layer', float('nan')):.1f} | {w.get('kernel_ms', float('nan')):.3f} | "
                         f"{w['gbps']:.0f} | {w['of_measured']:.0%} | {w.get('of_nominal', float('nan')):.0%} | "
                         f"{w['setup_s']:.1f} |")
            if "build_s" in w:
                notes.append(f"- {name}, ahead of time (its own process): 2 packages built in {w['build_s']:.1f} s, "
                             f"loaded in {w['load_s']:.2f} s; graph capture {w.get('capture_s', 0):.1f} s; first "
                             f"one-row forward {w['first_ms']:.2f} ms, then {w['wall_ms']:.3f} ms")
            if w.get("compile_error"):
                notes.append(f"- {name}, {way}: compile failed, ran eager: {w['compile_error'][:200]}")
    lines += [""] + notes if notes else []
    for name, reason in result.get("skipped", {}).items():
        lines.append(f"- {name}: skipped ({reason})")
    return lines
