"""Benchmark: every method on the same prompts in one process, AR measured in the same run, warm-up excluded.

`hf-assisted` is transformers' own assisted generation (`generate(assistant_model=draft)`): the peer to beat;
`hf-prompt-lookup` is transformers' prompt lookup decoding (`generate(prompt_lookup_num_tokens=10)`, no draft), the
peer of the `lookup` strategy. Both run greedily only. A method names a strategy, optionally boolean switches of it
and a preset: "dynatree+lookup@auto" is DynaTree with lookup grafted (engine/strategies/graft.py) on its auto preset,
"dynatree-history" DynaTree with its history adaptation off, so variants of one strategy compare on the same prompts
in one run, interleaved.
Every method takes the pair's captured steps where it has them (engine/cpu/packages.py); "dynatree/eager" runs a
method with them off, so captured and eager compare on the same prompts. The ARs: `ar` (the engine's loop, on the pair's
steps), `ar-eager` (the same loop, eager: beside it wherever the pair has captured steps), `ar-captured` (the
target's one-row captured step in a bare loop, engine/bench/captured_ar.py: wherever it exists) and `ar-compiled` (AR
through torch.compile, engine/bench/compiled.py: an independent build of the one-row step on the target's plain
weights, with `compiled_ar` "on", or "auto" wherever torch.compile can build it in the memory free: a captured
one-row step is no proof of AR at its fastest: on a Zen 4, torch.compile's AR ran 1.4-1.9x the engine's, whose
captured step was no faster: docs/experiments/2026-12-06-zen4.md).
Throughput per method and prompt set = new tokens / wall time summed over prompts and repeats; speedup divides by
the fastest AR's throughput on the same prompts (every AR is decoded on each prompt right before the other methods,
so drift of the machine cancels). Quality metrics (L-bar, l-bar, acceptance) average over iterations. Agreement
with AR, per method and prompt set, is the share of its greedy runs whose output equals the `ar` run's on the same
prompt token for token: 1 in float32, the exact mode; in bf16 / fp16 a near-tie may round the other way in a forward
of other row counts (docs/rules.md), so it is measured.
"""
from __future__ import annotations

import re
from dataclasses import asdict
from typing import Any, Callable

import torch

from engine.bench.captured_ar import CapturedAR, has_captured_step
from engine.bench.compiled import CACHE_STEP, CompiledAR, compile_available, round_to_step
from engine.bench.configuration import configuration_text
from engine.bench.peers import hf_assisted, hf_prompt_lookup
from engine.core.prompts import encode_prompt, load_prompt_set
from engine.core.sampling import Sampling
from engine.core.trace import RunResult
from engine.cpu.formats import RESERVE
from engine.cpu.kernels import linear_bytes
from engine.cpu.memory import available_memory
from engine.measure.metrics import (DRIFT_TOLERANCE, acceptance_by_source, compare_outputs, cost_drift, drift_off,
                                    lookup_work, stage_sums)
from engine.models import ModelPair
from engine.models.checkpoint import CheckpointError, map_plain_weights
from engine.recipe import RunSpec, generate
from engine.strategies import STRATEGIES, StrategyError
from engine.verify import Verifier

HF_ASSISTED = "hf-assisted"
HF_PROMPT_LOOKUP = "hf-prompt-lookup"
PEERS = (HF_ASSISTED, HF_PROMPT_LOOKUP)  # transformers' own generate loops: greedy only
AR_COMPILED = "ar-compiled"
AR_CAPTURED = "ar-captured"
AR_EAGER = "ar-eager"
AR_METHODS = ("ar", AR_EAGER, AR_CAPTURED, AR_COMPILED)
EAGER = "/eager"  # a method's suffix: run it with the pair's captured steps off
DEVICE = "/device"  # a method's last suffix: grow its trees on the device (engine/core/device_draft.py)
COMPILED_AR_MODES = ("auto", "on", "off")
REDUCED_PRECISION = ("bfloat16", "float16")  # dtypes whose kernels of different row counts may round near-ties apart


def split_method(method: str, preset: str = "cpu") -> tuple[str, str]:
    """"dynatree+lookup-history:a_star=0.5@auto" -> ("dynatree", "auto"): one bench run may compare presets,
    switches and parameter values of a strategy, interleaved."""
    name, _, own = bare(method).partition("@")
    return re.split(r"[+\-:]", name)[0], own or preset


def bare(method: str) -> str:
    """The method without its run suffixes ("dynatree@auto/eager/device" -> "dynatree@auto")."""
    return method.removesuffix(DEVICE).removesuffix(EAGER)


def method_params(method: str) -> dict[str, Any]:
    """"dynatree+lookup-history:a_star=0.5@auto" -> {"lookup": True, "history": False, "a_star": 0.5}: the
    parameters this method sets for itself: boolean switches on (+name) and off (-name), values (:name=value,
    checked against the parameter's range). A name the strategy does not take raises StrategyError; AR baselines
    and peers (ar-compiled, hf-assisted, ...) have none."""
    if method in AR_METHODS or method in PEERS:
        return {}
    head, *settings = bare(method).partition("@")[0].split(":")
    name, *signed = re.split(r"([+-])", head)
    if name not in STRATEGIES:
        return {}
    declared = {p.name: p for p in STRATEGIES[name].params}
    chosen: dict[str, Any] = {switch: sign == "+" for sign, switch in zip(signed[::2], signed[1::2])}
    for switch in chosen:
        if switch not in declared or declared[switch].kind is not bool:
            flags = sorted(k for k, p in declared.items() if p.kind is bool)
            raise StrategyError(f"method {method!r}: {name} has no switch {switch!r}; its switches: "
                                f"{', '.join(flags) or 'none'}")
    for setting in settings:
        key, eq, value = setting.partition("=")
        if not eq or key not in declared:
            raise StrategyError(f"method {method!r}: {setting!r} is not name=value for one of {name}'s parameters "
                                f"({', '.join(declared)})")
        chosen[key] = declared[key].coerce(value)
    return chosen


def run_method(pair: ModelPair, method: str, prompt, max_new_tokens: int, preset: str = "cpu",
               params: dict | None = None, sampling: Sampling | None = None,
               verifier: str | Verifier | None = None, compiled: CompiledAR | None = None) -> dict[str, Any]:
    """One run of `method` on `prompt`. `params` maps a strategy's name to its parameters; `verifier` is a rule's
    name, or a Verifier instance (scripts/rules_bench.py wraps rules to record acceptance)."""
    sampling = sampling or Sampling()
    if method in (AR_COMPILED, AR_CAPTURED):
        if method == AR_COMPILED and compiled is None:
            raise ValueError("ar-compiled needs the bench's CompiledAR (bench(..., compiled_ar='on'))")
        loop = compiled if method == AR_COMPILED else CapturedAR(pair)
        return loop.generate(encode_prompt(pair.tokenizer, prompt), max_new_tokens, sampling,
                             tuple(pair.eos_token_ids))
    if method in PEERS:
        if not sampling.greedy:
            raise ValueError(f"the {method} baseline is benchmarked greedily only; drop it or use --temperature 0")
        if method == HF_PROMPT_LOOKUP:
            return hf_prompt_lookup(pair, prompt, max_new_tokens)
        return hf_assisted(pair, prompt, max_new_tokens)
    eager = method == AR_EAGER or method.removesuffix(DEVICE).endswith(EAGER)
    name, preset = split_method("ar" if method == AR_EAGER else method, preset)
    spec = RunSpec(pair=pair.target_name, prompt=prompt, strategy=name, preset=preset,
                   params={**(params or {}).get(name, {}), **method_params(method)}, max_new_tokens=max_new_tokens,
                   **sampling.as_dict(), verifier=verifier if isinstance(verifier, str) and verifier else "auto",
                   capture="off" if eager else "auto", draft_phase="device" if method.endswith(DEVICE) else "host")
    result = generate(pair, spec, verifier if isinstance(verifier, Verifier) else None)
    return {"output_ids": result.output_ids, "new_tokens": len(result.output_ids),
            "total_s": result.metrics.total_s, "result": result}


def bench(pair: ModelPair, methods: list[str], prompt_set: str = "all", max_new_tokens: int = 96,
          repeats: int = 1, limit: int | None = None, preset: str = "cpu", params: dict | None = None,
          log: Callable[[str], None] = print, sampling: Sampling | None = None,
          verifier: str | None = None, compiled_ar: str = "off") -> dict[str, Any]:
    """compiled_ar: "on" adds the ar-compiled baseline, "auto" adds it where torch.compile can build it, "off"
    leaves it out unless `methods` names it."""
    sampling = sampling or Sampling()
    sets = ["code", "chat", "prose"] if prompt_set == "all" else [prompt_set]
    compiled = compiled_baseline(pair, methods, compiled_ar, sets, limit, max_new_tokens, log)
    # every AR first: every speedup divides by the fastest of them
    ars = (["ar"] + ([AR_EAGER] if pair.capture_ready else []) + ([AR_CAPTURED] if has_captured_step(pair) else [])
           + ([AR_COMPILED] if compiled else []))
    methods = ars + [m for m in methods if m not in AR_METHODS]
    # Warm-up, excluded: first calls pay for allocator growth and kernel selection.
    warm = load_prompt_set(sets[0])[0]["prompt"]
    for method in methods:
        run_method(pair, method, warm, 8, preset, params, sampling, verifier, compiled)

    rows = []
    for set_name in sets:
        prompts = load_prompt_set(set_name)[:limit]
        per_method: dict[str, list[dict]] = {m: [] for m in methods}
        for entry in prompts:
            reference = None
            for method in methods:
                for _ in range(repeats):
                    out = run_method(pair, method, entry["prompt"], max_new_tokens, preset, params, sampling,
                                     verifier, compiled)
                    if method == "ar" and reference is None:
                        reference = out["output_ids"]
                    out["exact"] = out["output_ids"] == reference
                    per_method[method].append(out)
                exact = f"  exact={out['exact']}" if sampling.greedy else ""
                log(f"  {set_name:5s} {entry['name'][:28]:28s} {method:16s} "
                    f"{out['new_tokens'] / out['total_s']:6.2f} tok/s{exact}")
        baseline = max((m for m in methods if m in AR_METHODS), key=lambda m: throughput(per_method[m]))
        ar_tps = throughput(per_method[baseline])
        ar_gbps = ar_bandwidth(pair, per_method[baseline])
        for method in methods:
            row = summarise(set_name, method, per_method[method], ar_tps)
            row["ar_gbps"], row["baseline"] = ar_gbps, baseline
            if not sampling.greedy:  # sampled outputs are not expected to equal AR's sample
                row["exact_match_rate"] = row["agreement_with_ar"] = row["agreed_runs"] = None
            rows.append(row)
    costs = pair.costs.to_dict() if pair.costs is not None else None
    return {"config": {"target": pair.target_name, "draft": pair.draft_name, "device": str(pair.device),
                       "dtype": str(pair.dtype).removeprefix("torch."), "max_new_tokens": max_new_tokens,
                       "repeats": repeats, "preset": preset, "prompt_set": prompt_set, "limit": limit,
                       "sampling": sampling.as_dict(), "verifier": verifier,
                       "threads": torch.get_num_threads(), "draft_vocab": pair.draft_vocab,
                       "compiled_ar_compile_s": sum(compiled.compile_s.values()) if compiled else None,
                       "compiled_ar_cache_sizes": sorted(compiled.compile_s) if compiled else None,
                       "draft_quant": pair.draft_quant, "formats": {r: c.kept for r, c in pair.formats.items()},
                       "memory_notes": pair.memory_notes, "routing": pair.routing(), "costs": costs},
            "rows": rows}


def compiled_baseline(pair: ModelPair, methods: list[str], mode: str, sets: list[str], limit: int | None,
                      max_new_tokens: int, log: Callable[[str], None]) -> CompiledAR | None:
    """The ar-compiled baseline, compiled before any timing, or None. "auto" adds it wherever torch.compile can
    build it in the memory free (else says why not); the target's plain weights, where the memory plan freed them,
    are mapped back from its checkpoint for it."""
    if mode not in COMPILED_AR_MODES:
        raise ValueError(f"compiled_ar must be one of {', '.join(COMPILED_AR_MODES)}, got {mode!r}")
    if AR_COMPILED not in methods and mode == "off":
        return None
    prompts = [encode_prompt(pair.tokenizer, e["prompt"]) for name in sets for e in load_prompt_set(name)[:limit]]
    totals = [len(ids) + max_new_tokens for ids in prompts]
    reason, mapped = compile_available(pair.device), 0
    if not reason:
        try:
            mapped = map_plain_weights(pair.target)  # the compile traces them
        except CheckpointError as err:
            reason = str(err)
    reason = reason or _compile_memory(pair)
    if mapped:
        log(f"ar-compiled: mapped {mapped} of the target's plain weights back from its checkpoint (the memory plan "
            "had freed them for the trees' formats; AR alone keeps them)")
    if reason:
        if mode == "auto" and AR_COMPILED not in methods:
            log(f"ar-compiled left out: {reason}")
            return None
        raise ValueError(f"ar-compiled cannot run: {reason}")
    compiled = CompiledAR(pair.target, cache_step=_cache_step(pair, totals, mapped > 0))
    sizes = sorted({compiled.cache_size(t) for t in totals})
    log(f"compiling the ar-compiled baseline for static caches of {sizes} positions (torch.compile, max-autotune)...")
    log(f"  compiled in {compiled.warm_up(prompts[0], totals):.0f} s")
    return compiled


def _cache_step(pair: ModelPair, totals: list[int], mapped: bool = False) -> int:
    """CACHE_STEP where a graph per cache size fits what is free (each packs its own copy of the weights) and the
    plain weights were resident already; else one size for every prompt, whose longer cache costs the shorter
    prompts' steps a little attention. Mapped weights mean memory is short: two copies of the fp32 default target
    beside the pair took the 24 GiB Ice Lake to its last 2.5 GB (docs/experiments/2026-11-28-ar-baseline.md)."""
    if not mapped and _compile_memory(pair, graphs=len({round_to_step(t) for t in totals})) is None:
        return CACHE_STEP
    return round_to_step(max(totals))


def _compile_memory(pair: ModelPair, graphs: int = 1) -> str | None:
    """None if `graphs` compiled graphs' packed copies of the target's weights fit in what is free, with RESERVE
    left (or where the free memory cannot be read); else why not."""
    need, free = graphs * linear_bytes(pair.target), available_memory()
    if free is not None and need + RESERVE > free:
        return (f"its graph packs a {need / 2**30:.1f} GiB copy of the target's weights and {free / 2**30:.1f} GiB "
                f"is available ({RESERVE / 2**30:.0f} GiB kept for everything else)")
    return None


def ar_bandwidth(pair: ModelPair, ar_outs: list[dict]) -> float | None:
    """GB/s AR achieved: the target's linear weight bytes per step ÷ AR's measured time per output token (TPOT,
    prefill excluded). None without a cost table (it knows the bytes a step reads on the installed routing)."""
    tpots = [o["result"].metrics.tpot_s if "result" in o else o.get("tpot_s") for o in ar_outs]
    tpots = [t for t in tpots if t]
    if pair.costs is None or not tpots:
        return None
    return pair.costs.target.step_bytes / (sum(tpots) / len(tpots)) / 1e9


def throughput(outs: list[dict]) -> float:
    return sum(o["new_tokens"] for o in outs) / sum(o["total_s"] for o in outs)


def summarise(set_name: str, method: str, outs: list[dict], ar_tps: float) -> dict[str, Any]:
    """One table row from a method's runs on one prompt set. agreement_with_ar (also under its older name
    exact_match_rate) is the share of runs whose output equals AR's token for token and agreed_runs their count;
    both None where runs were not compared with AR (no "exact" key)."""
    tps = throughput(outs)
    exact = [o["exact"] for o in outs if "exact" in o]
    compared = len(exact) == len(outs)
    rate = sum(exact) / len(outs) if compared else None
    row: dict[str, Any] = {"prompt_set": set_name, "method": method, "runs": len(outs), "tokens_per_s": tps,
                           "speedup": tps / ar_tps, "agreement_with_ar": rate, "exact_match_rate": rate,
                           "agreed_runs": sum(exact) if compared else None}
    results: list[RunResult] = [o["result"] for o in outs if "result" in o]
    if not results and all(o.get("tpot_s") for o in outs):  # ar-compiled / ar-captured time their own prefill, steps
        row["ttft_s"] = sum(o["ttft_s"] for o in outs) / len(outs)
        row["tpot_s"] = sum(o["tpot_s"] for o in outs) / len(outs)
    if results:
        iters = [it for r in results for it in r.iterations]
        drafted = sum(it.drafted for it in iters)
        row.update({
            "mean_tokens_per_iter": sum(it.committed for it in iters) / len(iters),
            "mean_accepted_len": sum(it.accepted for it in iters) / len(iters),
            "acceptance_rate": sum(it.accepted for it in iters) / drafted if drafted else None,
            "iterations": sum(len(r.iterations) for r in results) / len(results),
            "ttft_s": sum(r.metrics.ttft_s for r in results) / len(results),
            "tpot_s": sum(r.metrics.tpot_s or 0.0 for r in results) / len(results),
            "stage_s": {s: t / len(results)
                        for s, t in asdict(stage_sums([r.metrics.stage_s for r in results])).items()},
            "cost_drift": cost_drift(iters),
            "acceptance_by_source": {s: asdict(a) for s, a in acceptance_by_source(iters).items()},
            "lookup": lookup_work(iters),
        })
    return row


def agreement_cell(row: dict[str, Any]) -> str:
    """A row's agreement with AR as the table prints it: "0.56 (5/9)", or "-" where runs were not compared."""
    rate, agreed = row.get("agreement_with_ar", row.get("exact_match_rate")), row.get("agreed_runs")
    if rate is None:
        return "-"
    return f"{rate:.2f}" + (f" ({agreed}/{row['runs']})" if agreed is not None else "")


def agreement_note(rows: list[dict[str, Any]], dtype: str | None) -> str | None:
    """What an agreement with AR below 1 means for this report's dtype, or None where every compared row agrees.
    In bf16 / fp16 it is rounding, which the reader must not take for a lossy rule; in float32 it is a bug."""
    below = [f"{r['prompt_set']} {r['method']}" for r in rows
             if r.get("agreement_with_ar") is not None and r["agreement_with_ar"] < 1]
    if not below:
        return None
    if dtype in REDUCED_PRECISION:
        return (f"agreement with AR below 1 ({', '.join(below)}): in {dtype} a tree's forward of several rows and "
                "AR's one-row step use different kernels, which can round a near-tie between the top two tokens "
                "apart; no rule is lossy (docs/rules.md). --dtype fp32 is the exact mode: there greedy trees "
                "equal AR token for token")
    return (f"agreement with AR below 1 ({', '.join(below)}) in {dtype or 'this dtype'}: unexpected, the test suite "
            "finds greedy trees equal to AR token for token in float32; `generate --compare-ar` on that prompt prints "
            "the first divergence and AR's top-2 margin there")


def format_table(report: dict[str, Any]) -> str:
    """The bench report as text: the configuration it ran, one row per method and prompt set, then notes."""
    width = max([16] + [len(r["method"]) for r in report["rows"]])  # method names with :name=value run long
    head = (f"{'set':6s} {'method':{width}s} {'tok/s':>7s} {'speedup':>8s} {'AR GB/s':>8s} {'L̄':>6s} {'ℓ̄':>6s} "
            f"{'accept':>7s} {'#iter':>6s} {'TTFT s':>7s} {'TPOT s':>7s} {'agreement with AR':>17s}")
    config = report.get("config", {})
    lines = ([configuration_text(config["configuration"]), ""] if config.get("configuration") else [])
    lines += [head, "-" * len(head)]

    def fmt(value, spec):
        return format(value, spec) if value is not None else "-".rjust(len(format(0.0, spec)))

    for r in report["rows"]:
        lines.append(
            f"{r['prompt_set']:6s} {r['method']:{width}s} {r['tokens_per_s']:7.2f} {r['speedup']:7.2f}× "
            f"{fmt(r.get('ar_gbps'), '8.1f')} {fmt(r.get('mean_tokens_per_iter'), '6.2f')} {fmt(r.get('mean_accepted_len'), '6.2f')} "
            f"{fmt(r.get('acceptance_rate'), '7.2f')} {fmt(r.get('iterations'), '6.1f')} "
            f"{fmt(r.get('ttft_s'), '7.3f')} {fmt(r.get('tpot_s'), '7.3f')} {agreement_cell(r):>17s}")
    baselines = {r["prompt_set"]: r.get("baseline", "ar") for r in report["rows"]}
    if any(r["method"] in AR_METHODS[1:] for r in report["rows"]):  # else the baseline is "ar"
        lines += ["", "speedup = tok/s ÷ the faster AR on the set: " +
                  ", ".join(f"{name} {b}" for name, b in baselines.items())]
    note = agreement_note(report["rows"], config.get("dtype"))
    if note:
        lines += ["", note]
    costs = config.get("costs")
    if costs:
        t16 = costs["t"].get(16, costs["t"].get("16"))  # int keys in memory, str keys once read back from JSON
        line = f"cost table: c = {costs['c']:.3f}, t(16) = {t16:.2f}" if costs.get("c") is not None \
            else f"cost table: t(16) = {t16:.2f}"
        if costs.get("bandwidth_bytes_per_s"):
            line += (f"; streaming-read bandwidth {costs['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s "
                     f"(AR GB/s = target weight bytes per step / AR's TPOT)")
        lines += ["", line]
    looked = [f"{r['prompt_set']} {r['method']}: {100 * r['lookup']['share']:.2f} % of the time, lookup alone in "
              f"{100 * r['lookup']['alone']:.0f} % of iterations" for r in report["rows"] if r.get("lookup")]
    if looked:
        lines += ["", "context lookup's own work (index queries, tree building): " + "; ".join(looked)]
    drifts = ((r, drift_off(r.get("cost_drift") or {})) for r in report["rows"])
    off = [f"{r['prompt_set']} {r['method']}: {text}" for r, text in drifts if text]
    if off:
        lines += [f"measured ÷ predicted times beyond ×{DRIFT_TOLERANCE} (the machine's speed changed since the cost "
                  f"table was measured; `python -m engine costs --recalibrate`): " + "; ".join(off)]
    return "\n".join(lines)


def compare_with_ar(pair: ModelPair, spec: RunSpec, repeats: int = 1) -> RunResult:
    """`spec` against AR on the same prompt and settings, measured like the bench: one short warm-up run of each
    first (excluded: first calls pay for allocator growth and kernel selection), then `repeats` runs of each,
    interleaved (AR, method, AR, method, ...) so the machine's drift hits both alike. The fastest run of each is
    compared: the method's is returned, its `comparison` (speedup, exact match) and metrics.speedup_vs_ar set."""
    if repeats < 1:
        raise ValueError(f"compare with AR needs at least one run of each, got {repeats}")
    ar = spec.as_method("ar")
    for warm in (ar, spec):
        generate(pair, warm.warm_up())
    ar_runs, runs = [], []
    for _ in range(repeats):
        ar_runs.append(generate(pair, ar))
        runs.append(generate(pair, spec))
    result, reference = fastest(runs), fastest(ar_runs)
    comparison = compare_outputs(result, reference)
    comparison.runs_each, comparison.ar_tokens_per_s = repeats, reference.metrics.tokens_per_s
    result.comparison = comparison
    result.metrics.speedup_vs_ar = comparison.speedup_vs_ar
    return result


def fastest(runs: list[RunResult]) -> RunResult:
    """The run with the highest tokens/s: the one the busy machine disturbed least."""
    return max(runs, key=lambda r: r.metrics.tokens_per_s or 0.0)
