"""Command line: `python -m engine generate|bench|costs ...` (see --help of each).

Every command defaults to the configuration the app runs (engine/bench/configuration.py: the measured draft
vocabulary and draft formats, the `auto` preset, dtype and kernels chosen for this machine), so the command line
measures what the page shows; a flag picks another configuration, and each report names the one it ran."""
from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

from engine.bench.configuration import APP_CONFIGURATION, configuration_text, run_configuration
from engine.core.sampling import Sampling
from engine.measure.metrics import drift_warning
from engine.models import PAIRS
from engine.recipe import RunSpec, check_spec, split_pair, start_run
from engine.strategies import STRATEGIES, StrategyError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pair", help="shorthand for both models: default | tiny-random | tiny-random-unrelated | "
                                  "tiny-random-identical")
    p.add_argument("--target", help="default | tiny-random | hub id | local directory | .gguf path")
    p.add_argument("--draft", help="as --target (default: the pair's draft); none: the target alone (ar, lookup, "
                                   "hf-prompt-lookup)")
    p.add_argument("--dtype", default=APP_CONFIGURATION["dtype"],
                   help="auto | fp32 | bf16 | fp16 (default auto, the app's: bf16 where this CPU has native bf16, "
                        "else fp32). fp32 is the exact mode: greedy trees equal AR token for token; in bf16 a "
                        "near-tie can round differently in a tree's multi-row forward than in AR's one-row step")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda (default auto)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow model code from the hub (off by default)")
    p.add_argument("--packed-weights", default=APP_CONFIGURATION["packed_weights"], choices=("auto", "on", "off"),
                   help="CPU weight formats made by packing once (MKL, oneDNN): auto = offered to the per-shape "
                        "probe beside plain, kept where they measure fastest and fit memory; on = packed only (no "
                        "plain path); off = never packed")
    p.add_argument("--draft-vocab", default=APP_CONFIGURATION["draft_vocab"],
                   help="N | full | auto: the draft scores only the N most frequent tokens (assets/vocab); auto: "
                        "32768 where a committed frequency table fits the tokenizer, else full (default auto, the "
                        "app's)")
    p.add_argument("--draft-quant", default=APP_CONFIGURATION["draft_quant"],
                   choices=("none", "int8", "int4", "dyn8", "auto"),
                   help="quantised path for the draft's linears (CPU), used where measured faster: int8 / int4 "
                        "weight-only, dyn8 int8 weights times int8 activations (fbgemm, x86); auto = all of them "
                        "this CPU has, the router picks per row count; none = the draft's plain and packed formats "
                        "only (default auto, the app's)")
    p.add_argument("--fuse-draft", default=APP_CONFIGURATION["fuse_draft"], choices=("on", "off"),
                   help="CPU: stack the draft's q|k|v and gate|up projections into one linear each before its "
                        "formats are chosen (fewer, wider GEMMs; the target is never fused) (default on, the app's)")
    p.add_argument("--steps", default="auto", choices=("auto", "static", "dynamic"),
                   help="model forwards on a growing cache (dynamic) or a preallocated one with row-count buckets "
                        "(static); auto: static exactly when the run takes captured steps (default auto)")
    p.add_argument("--capture", default=APP_CONFIGURATION["capture"], choices=("auto", "on", "off"),
                   help="captured steps (docs/capture.md): on CPU, each model's forwards compiled ahead of time by "
                        "AOTInductor once per machine (minutes the first time, seconds after) and used at the row "
                        "counts where they measure faster; on CUDA, one CUDA graph per row-count bucket (validated "
                        "on an H100: docs/gpu.md). auto: both where they can be built")
    p.add_argument("--draft-phase", default="host", choices=("host", "device"),
                   help="where a tree's choices are made: host (default: a read of the draft's probabilities per "
                        "level), or device (fixed tree, DynaTree, EAGLE-2 and the linear chain at temperature 0: the "
                        "tree grown as tensors and read back once per iteration with the accepted path, at the cost "
                        "of running every planned level; docs/gpu.md)")
    p.add_argument("--recalibrate", action="store_true",
                   help="measure the forward-cost table again instead of reading it from the cache")
    p.add_argument("--preset", default=None,
                   help="strategy parameter preset: auto (default, the app's: tree size from this machine's "
                        "measured costs) | cpu (fixed sizes tuned on a 2-core CPU; the default when you set a size "
                        "flag yourself) | paper")


SAMPLING_FLAGS = {"temperature", "top_k", "top_p", "seed", "verifier"}


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (temperature 0 = greedy, exact)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--verifier", default=None, help="verification rule (default: greedy at T=0, token_matching for "
                                                    "top-k trees, specinfer for sampled trees)")


def _sampling(args):
    return Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)


def param_flag(strategy_name: str, param) -> str:
    """The command-line flag of a strategy parameter (prefixed where it would collide with a sampling flag)."""
    flag = "--" + param.name.replace("_", "-")
    if param.name in SAMPLING_FLAGS:  # e.g. delayed's own draft temperature: --delayed-temperature
        flag = f"--{strategy_name}-{param.name.replace('_', '-')}"
    return flag


def strategy_docs() -> str:
    """docs/strategies.md's per-strategy parameter tables, generated from the declarations (tests keep them in sync)."""
    blocks = []
    for cls in STRATEGIES.values():
        lines = [f"**`{cls.name}`** — {cls.label}. {cls.summary}"]
        if cls.params:
            lines += ["", "| flag | meaning | cpu | paper |", "|---|---|---|---|"]
            for param in cls.params:
                flag = param_flag(cls.name, param)
                if param.kind is bool:
                    flag = f"{flag} / --no-{flag.removeprefix('--')}"
                meaning = f"{param.label}: {param.help}" if param.help else param.label
                cpu, paper = (cls.presets.get(k, {}).get(param.name, param.default) for k in ("cpu", "paper"))
                lines.append(f"| `{flag}` | {meaning} | {cpu} | {paper} |")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def _add_strategy_params(p: argparse.ArgumentParser) -> None:
    """One flag per strategy parameter, collected from every strategy's declaration."""
    group = p.add_argument_group("strategy options (each applies to the strategies that declare it)")
    seen = {}
    for cls in STRATEGIES.values():
        for param in cls.params:
            if param.name in seen:
                seen[param.name].append(cls.name)
                continue
            seen[param.name] = [cls.name]
            flag = param_flag(cls.name, param)
            if param.kind is bool:
                group.add_argument(flag, dest=f"param_{param.name}", action=argparse.BooleanOptionalAction,
                                   default=None, help=param.help or param.label)
            else:
                group.add_argument(flag, dest=f"param_{param.name}", type=param.kind, default=None,
                                   metavar=param.kind.__name__.upper(), help=param.help or param.label)


def _strategy_params(args, strategy: str, strict: bool = True) -> dict:
    if strategy not in STRATEGIES:
        raise StrategyError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    given = {k.removeprefix("param_"): v for k, v in vars(args).items() if k.startswith("param_") and v is not None}
    declared = {p.name for p in STRATEGIES[strategy].params}
    unknown = sorted(set(given) - declared)
    if not strict:
        return {k: v for k, v in given.items() if k in declared}
    if unknown:
        raise StrategyError(f"strategy {strategy!r} does not take {', '.join('--' + u.replace('_', '-') for u in unknown)}")
    return given


def _preset(args, strategies: list[str]) -> str:
    """--preset if given. Otherwise `auto`, unless a size knob that `auto` would retune (--budget, --n, --k of the
    strategies run) was set by hand: a size typed on the command line is meant as a fixed size, so it runs on `cpu`."""
    if args.preset:
        return args.preset
    knobs = {STRATEGIES[s].auto_param for s in strategies if s in STRATEGIES} - {None}
    return "cpu" if any(getattr(args, f"param_{k}", None) is not None for k in knobs) else APP_CONFIGURATION["preset"]


def _configuration(args, pair, preset: str | None) -> dict:
    """The configuration this command ran (engine/bench/configuration.py), from its flags and the loaded pair;
    `preset` None for a command that sizes no tree (costs). Every report carries it: a number names its setup."""
    asked = {key: getattr(args, key) for key in APP_CONFIGURATION if key != "preset"}
    return run_configuration(pair, {**asked, "preset": preset})


def _models(args) -> tuple[str, str | None]:
    """(target, draft) from --pair (a named pair) and --target/--draft, which override it. Without a draft,
    "default" and "tiny-random" draft with their pair's own draft; any other target runs AR only."""
    target, draft = "default", None
    if args.pair:
        if args.pair not in PAIRS:
            raise SystemExit(f"error: unknown pair {args.pair!r}; choose from {', '.join(PAIRS)}")
        target, draft = split_pair(args.pair)
    target, draft = args.target or target, args.draft or draft
    if draft is None and target in ("default", "tiny-random"):
        draft = target
    return target, draft


def _load(args):
    from engine.cpu.packages import prepare_capture
    from engine.models import load_pair
    target, draft = _models(args)

    def progress(fraction: float, message: str) -> None:
        print(f"[{fraction * 100:5.1f}%] {message}", file=sys.stderr, flush=True)

    pair = load_pair(target, draft, dtype=args.dtype, device=args.device,
                     trust_remote_code=args.trust_remote_code, packed=args.packed_weights, progress=progress,
                     draft_vocab=args.draft_vocab, draft_quant=args.draft_quant, recalibrate=args.recalibrate,
                     capture=args.capture, fuse_draft=args.fuse_draft == "on")
    prepare_capture(pair, progress, args.recalibrate)
    print(pair.describe(), file=sys.stderr)
    return pair


def _run_spec(args) -> RunSpec:
    """The generate command's run, checked before any model loads."""
    prompt = Path(args.prompt_file).read_text() if args.prompt_file else args.prompt
    if prompt is None:
        raise SystemExit("error: give --prompt TEXT or --prompt-file F")
    if args.chat:
        prompt = [{"role": "user", "content": prompt}]
    target, draft = _models(args)
    spec = RunSpec(pair=args.pair or (f"{target} + {draft}" if draft else target), prompt=prompt,
                   strategy=args.strategy, preset=_preset(args, [args.strategy]),
                   params=_strategy_params(args, args.strategy), max_new_tokens=args.max_new_tokens,
                   temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                   verifier=args.verifier or "auto", stop_on_eos=not args.no_eos, stop_strings=tuple(args.stop or ()),
                   steps=args.steps, draft_phase=args.draft_phase)
    check_spec(spec)
    return spec


def _iteration_line(record) -> str:
    cost = record.cost
    vs = (f"  draft+verify predicted {cost.predicted_s * 1000:6.1f} / measured {cost.measured_s * 1000:6.1f} ms"
          if cost is not None else "")
    return (f"iter {record.index:4d}  drafted {record.drafted:4d}  accepted {record.accepted:3d}  "
            f"+{record.committed} tokens  {record.times.total * 1000:7.1f} ms{vs}")


def cmd_generate(args) -> int:
    from engine.bench.tables import compare_with_ar
    spec = _run_spec(args)
    pair = _load(args)
    configuration = _configuration(args, pair, spec.preset)
    print(configuration_text(configuration), file=sys.stderr)
    if args.compare_ar:
        result = compare_with_ar(pair, spec, args.compare_repeats)
        if args.verbose:  # the kept run's iterations (the runs decode silently: printing is not decoding time)
            for record in result.iterations:
                print(_iteration_line(record), file=sys.stderr)
    else:
        run = start_run(pair, spec)
        for record in run:
            if args.verbose:
                print(_iteration_line(record), file=sys.stderr)
        result = run.result
    print(result.output_text)
    print(_summary(result), file=sys.stderr)
    if args.json:
        data = result.to_dict()
        data["config"]["configuration"] = configuration
        if result.comparison:
            data["exact_match"] = result.comparison.exact_match
        Path(args.json).write_text(json.dumps(data, ensure_ascii=False, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _summary(result) -> str:
    """The run's numbers in one paragraph, and against AR where it was compared (why it may differ in bf16)."""
    from engine.bench.tables import REDUCED_PRECISION
    m = result.metrics
    summary = (f"\n[{result.strategy}] {m.new_tokens} tokens in {m.total_s:.2f} s = {m.tokens_per_s:.2f} "
               f"tok/s | L̄ {m.mean_tokens_per_iter:.2f} | ℓ̄ {m.mean_accepted_len:.2f} | "
               f"iterations {m.iterations} | TTFT {m.ttft_s:.3f} s")
    if m.acceptance_rate is not None:
        summary += f" | acceptance {m.acceptance_rate:.2f}"
    if result.comparison:
        c = result.comparison
        runs = "one run of each" if c.runs_each == 1 else \
            f"the fastest of {c.runs_each} runs of each, alternating with AR"
        speedup = c.speedup_vs_ar if c.speedup_vs_ar is not None else float("nan")
        summary += (f"\nvs AR: speedup {speedup:.2f}× (AR "
                    f"{c.ar_tokens_per_s:.2f} tok/s; {runs}, after a warm-up run of each), "
                    f"exact match {c.exact_match}")
        if not c.exact_match:
            summary += f" (first divergence at token {c.first_divergence}, AR top-2 margin " \
                       f"{c.reference_margin})"
            if result.config.dtype in REDUCED_PRECISION and result.config.sampling.greedy:
                summary += (f"\nnote: in {result.config.dtype} a tree's multi-row forward and AR's one-row step "
                            "can round a near-tie apart; no rule is lossy (docs/rules.md). --dtype fp32 is exact")
    warning = drift_warning(m.cost_drift)
    if warning:
        summary += f"\nnote: {warning}"
    return summary


def cmd_bench(args) -> int:
    from engine.bench.tables import AR_METHODS, PEERS, bench, format_table, method_params, split_method
    methods = [m.strip() for m in args.strategies.split(",") if m.strip()]
    preset = _preset(args, [split_method(m)[0] for m in methods])
    names = {m: split_method(m, preset) for m in methods}
    for m, (name, own) in names.items():  # `own`: the method's preset (named apart: `preset` is every method's default)
        if m not in (*PEERS, *AR_METHODS) and name not in STRATEGIES:
            raise StrategyError(f"unknown method {m!r}; choose from {', '.join(STRATEGIES)}, {', '.join(PEERS)}, "
                                "ar-eager, ar-captured, ar-compiled (a strategy may name switches and its preset, and "
                                "end in /eager to run without captured steps, /device to grow its trees on the "
                                "device: dynatree+lookup@auto/eager, dynatree@auto/device)")
        method_params(m)
        if name in STRATEGIES and own not in STRATEGIES[name].preset_names():
            raise StrategyError(f"{name} has no preset {own!r}; choose from {STRATEGIES[name].preset_names()}")
    params = {name: _strategy_params(args, name, strict=False) for name, _ in names.values() if name in STRATEGIES}
    pair = _load(args)
    report = bench(pair, methods, args.prompt_set, args.max_new_tokens, args.repeats, args.limit, preset,
                   params, log=lambda s: print(s, file=sys.stderr, flush=True), sampling=_sampling(args),
                   verifier=args.verifier, compiled_ar=args.compiled_ar)
    report["config"]["configuration"] = _configuration(args, pair, preset)
    print(format_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def cmd_costs(args) -> int:
    from engine.cpu.packages import format_capture
    from engine.measure.costs import format_costs
    pair = _load(args)
    configuration = _configuration(args, pair, None)
    print(configuration_text(configuration))
    print(format_costs(pair.costs, pair.routing(), {role: c.summary() for role, c in pair.formats.items()}))
    for note in pair.memory_notes:
        print(f"memory plan: {note}")
    if pair.capture_info:
        print(format_capture(pair))
    if args.json:
        Path(args.json).write_text(json.dumps({**pair.costs.to_dict(), "configuration": configuration}, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def load_request_pair(request: dict):
    """The pair a builder's request names, loaded as the app loads it (so its package keys are the app's), then
    stripped of the weights no package build reads (aoti.release_weights): the builder holds norms and biases, not
    gigabytes."""
    from engine.cpu.aoti import release_weights
    from engine.models.loading import load_pair
    pair = load_pair(request["target"], request["draft"], dtype=request["dtype"], device=request["device"],
                     packed="off", calibrate=False, draft_vocab=request.get("draft_vocab"),
                     fuse_draft=request.get("fuse_draft", True), own_weights=False)
    for _, model, _ in pair.models():  # a package's key does not depend on the formats the app's models keep
        release_weights(model)
    return pair


def cmd_build(args) -> int:
    """The builder process (engine/cpu/builder.py `start_builder` starts it): a failure ends it with status 1 and its
    traceback in the log, as the builder's contract says, never with this command line's one-line errors."""
    from engine.cpu.builder import run
    try:
        return run(Path(args.request), load_request_pair)
    except Exception:
        traceback.print_exc()
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="decode one prompt with one strategy")
    _add_model_args(g)
    g.add_argument("--strategy", default="dynatree", help=f"one of {', '.join(STRATEGIES)} (default dynatree)")
    g.add_argument("--prompt", help="prompt text")
    g.add_argument("--prompt-file", help="read the prompt from a file")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--no-eos", action="store_true", help="do not stop at the end-of-sequence token")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--compare-ar", action="store_true",
                   help="also run AR on the prompt: speedup and exact match. Both are warmed up first, then run "
                        "interleaved (AR, method, ...) --compare-repeats times; the fastest run of each is compared")
    g.add_argument("--compare-repeats", type=int, default=1, help="runs of each with --compare-ar (default 1)")
    g.add_argument("--json", help="write the run (metrics + per-iteration records) to this file")
    g.add_argument("-v", "--verbose", action="store_true", help="print one line per iteration")
    _add_sampling_args(g)
    _add_strategy_params(g)
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="all methods on a prompt set, AR in the same process, paper-style table")
    _add_model_args(b)
    b.add_argument("--strategies", default="ar,linear,fixed,dynatree,hf-assisted",
                   help="comma list of strategies and/or hf-assisted, hf-prompt-lookup (transformers' peers, "
                        "greedy only); strategy@preset picks one strategy's preset, strategy+switch / -switch turns a "
                        "boolean parameter on / off and strategy:name=value sets a parameter for that method alone "
                        "(dynatree, dynatree@auto, dynatree+lookup and dynatree:a_star=0.5 in one list "
                        "compare them on the same prompts)")
    b.add_argument("--compiled-ar", default="auto", choices=("auto", "on", "off"),
                   help="also run AR through torch.compile (ar-compiled) and divide speedups by the faster AR; "
                        "auto: wherever inductor can build it in the memory free (the target's plain weights mapped "
                        "back from its checkpoint where the memory plan freed them); compiling takes minutes once")
    b.add_argument("--prompt-set", default="all",
                   help="code | chat | prose | all (the three) | grounded (answers found in the prompt: lookup's)")
    b.add_argument("--max-new-tokens", type=int, default=96)
    b.add_argument("--repeats", type=int, default=1)
    b.add_argument("--limit", type=int, default=None, help="prompts per set (default: all)")
    b.add_argument("--json", help="write the report to this file")
    _add_sampling_args(b)
    _add_strategy_params(b)
    b.set_defaults(func=cmd_bench)

    c = sub.add_parser("costs", help="the measured forward-cost table of a pair: c, t(n), routing, AR bandwidth")
    _add_model_args(c)
    c.add_argument("--json", help="write the table to this file")
    c.set_defaults(func=cmd_costs)

    d = sub.add_parser("build", help="compile a pair's missing captured CPU steps from a request file: the process "
                                     "the app starts on a fresh cache (engine/cpu/builder.py)")
    d.add_argument("request", help="the request JSON (engine/cpu/builder.py build_request)")
    d.set_defaults(func=cmd_build)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as err:  # StrategyError, ModelLoadError, SamplingError, ... are ValueErrors
        print(f"error: {err}", file=sys.stderr)
        return 2
