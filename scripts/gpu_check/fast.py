"""fast: what the engine's forwards cost on this device at real shapes, and what that predicts for trees.

Per shape pair (random models of published shapes, engine/models/shapes.py; most important first, a pair that no
longer fits the section's time is skipped with the reason), loaded the production way (`load_pair`, capture on for
CUDA, so the pair's cost table is measured through its graphed static steps: engine/measure/graphed.py
`measure_graphed`):
  tables      the graphed table (c, t(n) per rung of engine/core/steps.py LADDER, seconds per rung) and, on CUDA, the
              eager one (engine/measure/costs.py `measure`, a growing cache);
  end_to_end  AR through the pair's one-row graph (engine/bench/captured_ar.py, the bench's `ar-captured`), DynaTree
              at ~16 nodes and a graphed linear chain, each on the host draft phase and on the device one
              (engine/core/device_draft.py: one read per iteration, every planned level run); each iteration's measured seconds
              against its table price.
              Random models accept nothing (L ~ 1), so the speedup is predicted at an assumed L-bar (ASSUMED_L, read
              from a measured CPU bench of the real pair) with the performance model of ARCHITECTURE.md:
              speedup = L-bar / (t(n) + sum of c(rows) + overhead), overhead = measured - priced;
  capture     (CUDA) seconds per bucket, the memory the graphs hold, the peak memory;
  replay      (CUDA) the graphed one-row step's wall time against the summed time of the kernels it ran
              (torch.profiler);
  table file  gpu-tables/TARGET__DRAFT.json in --out (engine/measure/gpu_tables.py's schema).
Once per section: the engine's own host time per iteration at ~16 nodes with the model steps stubbed
(scripts/host_time.py: the tiny identical pair on the CPU, so it is this machine's host, not its GPU).
"""
from __future__ import annotations

import gc
import json
import statistics
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import torch
import transformers

from engine.bench.captured_ar import CapturedAR
from engine.core.steps import LADDER, StaticSteps
from engine.measure import gpu_tables
from engine.measure.costs import PREFIX, measure, probe_ids
from engine.models import load_pair, tiny_random_pair
from engine.recipe import RunSpec, generate
from engine.runtime import synchronize
from scripts import host_time
from scripts.device_costs import one_row_walls

# (target, draft, seconds the pair is expected to need on an H100: a guess until a report says, UNMEASURED)
PAIRS = (
    ("shape:qwen2.5-1.5b", "shape:qwen2.5-0.5b", 45),  # the app's default pair's shapes (Qwen2.5-Coder 1.5B / 0.5B)
    ("shape:pythia-2.8b", "shape:pythia-70m", 40),     # the app's GPU preset (DynaTree's pair)
    ("shape:qwen2.5-7b", "shape:qwen2.5-0.5b", 60),
    ("shape:qwen3-8b", "shape:qwen3-0.6b", 70),
)
QUICK_PAIRS = (("tiny-random", "tiny-random", 10),)  # the CPU dry run: the tiny pair, the same code in seconds
DYNATREE = {"budget": 16, "tau": 0.0, "rho_stop": 0.0, "history": False}  # ~16 nodes whatever the random draft says
CHAIN = {"k": 4, "stop_below": 0.0}
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"
ASSUMED_L = "docs/experiments/bench-2026-11-25-captured.json"  # DynaTree on the real Qwen2.5-Coder pair, 2-core CPU
ROOT = Path(__file__).resolve().parents[2]


def assumed_lbar() -> dict:
    """L-bar (tokens committed per iteration) of DynaTree on the real default pair, from the CPU bench in ASSUMED_L."""
    data = json.loads((ROOT / ASSUMED_L).read_text())
    sets = {r["prompt_set"]: r["mean_tokens_per_iter"] for r in data["rows"] if r["method"] == "dynatree"}
    return {"value": statistics.mean(sets.values()), "per_prompt_set": sets,
            "source": f"{ASSUMED_L}: DynaTree (cpu preset) on Qwen2.5-Coder-1.5B/0.5B, real weights, greedy, "
                      f"{data['config']['max_new_tokens']} new tokens, 2-core CPU; mean of the prompt sets. Applied "
                      "to every shape pair (no other pair's L-bar is measured); the tree there was sized for a CPU"}


def run(ctx) -> dict:
    cuda = ctx.device.type == "cuda"
    pairs = ctx.options.get("pairs") or (QUICK_PAIRS if ctx.quick else PAIRS)
    result = {"dtype": "bfloat16" if cuda else "float32", "prefix": PREFIX, "ladder": list(LADDER),
              "assumed_lbar": assumed_lbar(), "pairs": {}, "skipped": {}}
    result["host"] = stubbed_host_time(20 if ctx.quick else 100)
    ctx.checkpoint(result)
    for target, draft, need in pairs:
        name = f"{short(target)}+{short(draft)}"
        if ctx.left() < need:
            result["skipped"][name] = f"{ctx.left():.0f} s left in the section, the pair needs ~{need} s"
            continue
        started = time.monotonic()
        try:
            result["pairs"][name] = one_pair(ctx, target, draft, result)
        except Exception as err:  # noqa: BLE001 - one pair's failure is recorded, the next pair runs
            result["pairs"][name] = {"error": f"{type(err).__name__}: {err}",
                                     "traceback": traceback.format_exc()[-2000:]}
        result["pairs"][name]["seconds"] = time.monotonic() - started
        release_memory()
        ctx.checkpoint(result)
    result["passed"] = bool(result["pairs"]) and all("error" not in p and not p["errors"]
                                                     for p in result["pairs"].values())
    return result


def short(spec: str) -> str:
    """The shape's name of a `shape:NAME` spec (what a table names its models by), other specs as they are."""
    return spec.removeprefix("shape:")


def stubbed_host_time(iterations: int) -> dict:
    """scripts/host_time.py's stubbed measurement: DynaTree at 16 nodes, the model steps a lookup of fixed logits."""
    pair = tiny_random_pair("identical", dtype=torch.float32, device="cpu", capture="off")
    params = dict(DYNATREE)
    return {"strategy": "dynatree", "params": params, **host_time.stubbed(pair, "dynatree", params, iterations)}


def one_pair(ctx, target: str, draft: str, result: dict) -> dict:
    """Load and calibrate the pair, then each measurement; a measurement that raises is recorded under "errors"
    and the rest still run (the table file is written before the CUDA-only parts)."""
    cuda = ctx.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    started = time.monotonic()
    pair = load_pair(target, draft, dtype=result["dtype"], device=ctx.device, packed="off", calibrate=True,
                     capture="on" if cuda else "off")
    out = {"target": short(target), "draft": short(draft), "load_and_calibrate_s": time.monotonic() - started,
           "steps": "cuda-graphs" if pair.graphs else "eager",
           "table": table_of(pair.costs.target.time, pair.costs.draft.time), "errors": {}}
    tokens, lbar = (8 if ctx.quick else 32), result["assumed_lbar"]["value"]
    parts = [("eager_table", lambda: eager_table(pair))] if cuda else []
    parts += [("end_to_end", lambda: end_to_end(pair, tokens, lbar)),
              ("table_file", lambda: str(write_table(ctx, pair, out)))]
    if cuda:
        parts += [("capture", lambda: capture_of(pair, ctx.device)),
                  ("replay", lambda: replay_vs_kernels(pair.static_steps["target"], pair.target))]
    for key, measure_part in parts:
        try:
            out[key] = measure_part()
        except Exception as err:  # noqa: BLE001 - recorded; the pair's other measurements still run
            out["errors"][key] = f"{type(err).__name__}: {err}\n{traceback.format_exc()[-1500:]}"
    pair.static_steps.clear()
    return out


def eager_table(pair) -> dict:
    """The eager path's table (a growing cache, engine/measure/costs.py `measure`): what graphs save."""
    eager = [measure(m, ["plain"])["plain"] for m in (pair.target, pair.draft)]
    return table_of(*(lambda r, s=s: s[r] for s in eager))


def table_of(target_time, draft_time) -> dict:
    """Seconds per rung of both models, c and t(n), from two `rows -> seconds` functions."""
    target, draft = ({r: fn(r) for r in LADDER} for fn in (target_time, draft_time))
    return {"target_s": target, "draft_s": draft, "c": draft[1] / target[1],
            "t": {r: target[r] / target[1] for r in LADDER}}


# -- end to end --------------------------------------------------------------------------------------------------------

def end_to_end(pair, tokens: int, lbar: float) -> dict:
    """AR on the one-row graph, DynaTree at ~16 nodes and a chain, each warmed up first (the first calls capture).
    The speedup is predicted for DynaTree only: `lbar` is DynaTree's; the chain gets its break-even L-bar."""
    prompt_ids = pair.tokenizer(PROMPT)["input_ids"]
    CapturedAR(pair).generate(prompt_ids, 8)
    ar = CapturedAR(pair).generate(prompt_ids, tokens)
    step = pair.costs.step
    out = {"tokens": tokens, "ar": {"tpot_ms": 1e3 * ar["tpot_s"], "table_step_ms": 1e3 * step}}
    for label, strategy, params, phase in (("dynatree", "dynatree", DYNATREE, "host"),
                                           ("dynatree_device", "dynatree", DYNATREE, "device"),
                                           ("chain", "linear", CHAIN, "host"),
                                           ("chain_device", "linear", CHAIN, "device")):
        spec = RunSpec(pair="shape", prompt=PROMPT, strategy=strategy, params=params, max_new_tokens=tokens,
                       stop_on_eos=False, draft_phase=phase)
        generate(pair, spec.warm_up())
        out[label] = iteration_stats(generate(pair, spec), ar["tpot_s"], step,
                                     None if label.startswith("chain") else lbar)
    return out


def iteration_stats(run, ar_token_s: float, step_s: float, lbar: float | None) -> dict:
    """Medians over the run's iterations (the first, which also drafts over the prompt, left out) and the
    predicted speedups at `lbar` tokens per iteration (None: none predicted)."""
    its = run.iterations[1:] or run.iterations
    med = lambda values: statistics.median(values)  # noqa: E731
    total = med([it.times.total for it in its])
    priced = med([it.cost.predicted_s for it in its])
    return {"iterations": len(run.iterations), "drafted_nodes": med([it.drafted for it in its]),
            "verify_rows": med([it.cost.verify_rows for it in its]),
            "draft_forwards": med([it.draft_forwards for it in its]),
            "tokens_per_iteration_measured": med([len(it.new_tokens) for it in its]),
            "iteration_ms": 1e3 * total, "priced_ms": 1e3 * priced, "overhead_ms": 1e3 * (total - priced),
            "draft_ms": 1e3 * med([it.times.draft for it in its]),
            "verify_ms": 1e3 * med([it.times.verify for it in its]),
            "break_even_lbar": total / ar_token_s,
            "predicted_speedup_table_only": None if lbar is None else lbar / (priced / step_s),
            "predicted_speedup_measured": None if lbar is None else lbar * ar_token_s / total}


# -- capture and replay ------------------------------------------------------------------------------------------------

def capture_of(pair, device) -> dict:
    """Each kept static steps' buckets, capture seconds and graph memory (StaticSteps.capture_info); peak memory."""
    out = {}
    for role, steps in pair.static_steps.items():
        info = steps.capture_info
        out[role] = {"buckets": list(steps.buckets), "max_len": steps.max_len,
                     "capture_s": sum(info["seconds"].values()), "per_bucket_s": info["seconds"],
                     "allocated_mib": info["allocated_bytes"] / 2**20, "reserved_mib": info["reserved_bytes"] / 2**20,
                     "grown": info["grown"]}
    out["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    out["reserved_gib"] = torch.cuda.memory_reserved(device) / 2**30
    return out


def replay_vs_kernels(steps, model, repeats: int = 20) -> dict:
    """The kept target steps' one-row graph after a PREFIX-token prefill: median wall ms of a forward (input copies,
    replay, logits out; synchronised) against the summed device time of what the profiler saw it run."""
    ids = probe_ids(model, PREFIX + 1).tolist()
    steps.reset()
    steps.prefill(ids[:PREFIX])
    out = {"wall_ms": 1e3 * statistics.median(one_row_walls(steps, ids, repeats)), "graphed": 1 in steps.graphs.graphs,
           **profile_one_row(steps, ids)}
    if not out["kernels"]:  # the replay's kernels were invisible to the profiler: an eager static step's instead
        eager = StaticSteps(model, steps.max_len, (1,))
        eager.prefill(ids[:PREFIX])
        out.update(profile_one_row(eager, ids), kernel_source="an eager static one-row step (the profiler saw no "
                                                                "kernels inside the replay)")
    out["wall_over_kernels"] = out["wall_ms"] / out["kernel_ms"] if out["kernel_ms"] else None
    steps.reset()
    return out


def profile_one_row(steps, ids: list[int]) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        steps.forward([ids[PREFIX]], [PREFIX])
        synchronize(steps.device)
    steps.keep(PREFIX, [])
    device = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [e for e in device if not e.name.startswith(("Memcpy", "Memset"))]
    return {"kernels": len(kernels), "kernel_ms": sum(e.device_time for e in kernels) / 1e3,
            "copies_ms": sum(e.device_time for e in device if e not in kernels) / 1e3}


# -- the table file ----------------------------------------------------------------------------------------------------

def write_table(ctx, pair, out: dict) -> Path:
    """The pair's table as the app reads it (engine/measure/gpu_tables.py), in --out/gpu-tables/."""
    report = ctx.report.data
    overhead = out["end_to_end"]["dynatree"]["overhead_ms"] / 1e3  # the e2e part ran before: this part needs it
    table = gpu_tables.GpuTable(
        gpu=report["device"]["name"], measured=datetime.now(timezone.utc).date().isoformat(),
        torch=torch.__version__, transformers=transformers.__version__, dtype=str(pair.dtype).removeprefix("torch."),
        steps=out["steps"], prefix=PREFIX, target=out["target"], draft=out["draft"],
        target_s=out["table"]["target_s"], draft_s=out["table"]["draft_s"], overhead_s=max(overhead, 0.0),
        source=f"python -m scripts.gpu_check, report.json started {report['started']}")
    # letters, digits, '.', '_' and '-' only: a file name any copy tool takes back (a device run's $OUT does)
    return gpu_tables.save(table, ctx.out / "gpu-tables" / f"{out['target']}__{out['draft']}.json")


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# -- summary -----------------------------------------------------------------------------------------------------------

def summarise(result: dict) -> list[str]:
    lbar = result["assumed_lbar"]
    host = result.get("host", {})
    lines = [f"{result['dtype']}, prefix {result['prefix']} tokens. Assumed L̄ = {lbar['value']:.2f} "
             f"({lbar['source']}).",
             "", f"Engine host time per iteration, steps stubbed (tiny pair, this machine's CPU): "
                 f"{host.get('median_iteration_ms', float('nan')):.3f} ms at {host.get('median_nodes')} nodes.", ""]
    for name, reason in result.get("skipped", {}).items():
        lines.append(f"- {name}: skipped ({reason})")
    for name, p in result["pairs"].items():
        lines += ["", f"### {name} ({p.get('seconds', 0):.0f} s)", ""]
        if "error" in p:
            lines += [f"error: {p['error']}", "```", p.get("traceback", ""), "```"]
            continue
        lines += table_lines(p)
        for key, error in p.get("errors", {}).items():
            lines += [f"- {key} failed:", "```", error, "```"]
        for label in ("dynatree", "dynatree_device", "chain", "chain_device") if "end_to_end" in p else ():
            e = p["end_to_end"][label]
            line = (f"- {label}: {e['drafted_nodes']:.0f} nodes, {e['draft_forwards']:.0f} draft forwards, iteration "
                    f"{e['iteration_ms']:.2f} ms (priced by the table {e['priced_ms']:.2f} ms, overhead "
                    f"{e['overhead_ms']:.2f} ms); break-even L̄ {e['break_even_lbar']:.2f}")
            if e["predicted_speedup_measured"] is not None:
                line += (f"; at L̄ {lbar['value']:.2f}: {e['predicted_speedup_measured']:.2f}× AR as measured, "
                         f"{e['predicted_speedup_table_only']:.2f}× by the table alone (no overhead)")
            lines.append(line)
        if "end_to_end" in p:
            ar = p["end_to_end"]["ar"]
            lines.append(f"- AR at its fastest (engine/bench/captured_ar.py: the one-row graph on CUDA): "
                         f"{ar['tpot_ms']:.2f} ms per token (the table's one-row step {ar['table_step_ms']:.2f} ms)")
        if "replay" in p:
            r = p["replay"]
            lines.append(f"- one-row replay {r['wall_ms']:.2f} ms vs kernels {r['kernel_ms']:.2f} ms "
                         f"({r['kernels']} kernels{', ' + r['kernel_source'] if 'kernel_source' in r else ''})")
        if "capture" in p:
            c = p["capture"]
            for role in ("target", "draft"):
                if role in c:
                    lines.append(f"- capture {role}: buckets {c[role]['buckets']}, {c[role]['capture_s']:.2f} s, "
                                 f"{c[role]['reserved_mib']:.0f} MiB reserved; peak {c['peak_allocated_gib']:.1f} GiB")
        if "table_file" in p:
            lines.append(f"- table file: gpu-tables/{Path(p['table_file']).name}")
    return lines


def table_lines(p: dict) -> list[str]:
    rungs = list(p["table"]["t"])
    head = "| table | target 1 row ms | draft 1 row ms | c | " + " | ".join(f"t({r})" for r in rungs) + " |"
    lines = [head, "|---|---|---|---|" + "---|" * len(rungs)]
    for label, key in ((p["steps"], "table"), ("eager", "eager_table")):
        if key in p:
            t = p[key]
            lines.append(f"| {label} | {1e3 * t['target_s'][1]:.2f} | {1e3 * t['draft_s'][1]:.2f} | {t['c']:.3f} | "
                         + " | ".join(f"{t['t'][r]:.2f}" for r in rungs) + " |")
    return lines
