"""exact: the graphed path decodes what the eager path decodes.

Every strategy of the registry (engine/strategies) on the three tiny pairs (related, identical, unrelated draft) in
fp32, greedy, against AR on the dynamic eager steps of the same pair, token for token: on CUDA once with graphs on
(the pair's `capture="on"`: static steps, one graph per bucket) and once off; elsewhere off only (graphs need CUDA).
Seeded sampling (T = 0.8) twice with one seed gives one output, and on CUDA graphed sampling gives what eager sampling
gives. Then pytest on the test files that hold CUDA-only tests, with TREEVIZ_TEST_DEVICE set to the device, as a
subprocess. Passed when all of it holds: on CUDA that is the condition for graphs to default to on.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import torch

from engine.core.sampling import Sampling
from engine.models import tiny_random_pair
from engine.recipe import RunSpec, generate
from engine.strategies import STRATEGIES
from scripts.gpu_check.report import tail

KINDS = ("related", "identical", "unrelated")
PROMPT = "def fib(n):\n    return"
SAMPLED = Sampling(temperature=0.8, seed=7)
# Every test file with CUDA-only tests except tests/test_verify_exact.py, which needs more than one call's limit on
# a GPU (docs/experiments/cuda.md: two calls) and is run on its own there.
TESTS = ("tests/test_static_steps.py", "tests/test_gpu_path.py", "tests/test_fused.py",
         "tests/test_device_draft.py::test_cuda_graphs_device_phase_matches_the_host_path_and_syncs_once")
PYTEST_MAX_S = 240.0
RESERVE_S = 30.0  # the section starts no new pair or seeded check with less time than this left (pytest needs it)


def spec(name: str, tokens: int, sampling: Sampling = Sampling(), **steps) -> RunSpec:
    return RunSpec(pair="tiny", prompt=PROMPT, strategy=name, max_new_tokens=tokens, stop_on_eos=False,
                   **sampling.as_dict(), **steps)


def reference(pair, tokens: int) -> list[int]:
    """AR on the dynamic eager steps: what every other run must emit."""
    return generate(pair, spec("ar", tokens, steps="dynamic", capture="off")).output_ids


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def greedy_case(pair, name: str, ar: list[int], tokens: int) -> dict:
    run = generate(pair, spec(name, tokens))
    return {"steps": run.config.steps, "output_ids": run.output_ids, "equal": run.output_ids == ar,
            "first_divergence": first_divergence(run.output_ids, ar), "iterations": len(run.iterations)}


def seeded_case(pairs: dict, name: str, tokens: int) -> dict:
    """The same seed twice on each mode's related pair (`pairs`: graphs mode -> pair): one output; on CUDA graphed
    sampling = eager sampling too."""
    outputs = {mode: [generate(pair, spec(name, tokens, SAMPLED)).output_ids for _ in range(2)]
               for mode, pair in pairs.items()}
    same_seed = all(a == b for a, b in outputs.values())
    across = len({tuple(runs[0]) for runs in outputs.values()}) == 1
    return {"same_seed_same_output": same_seed, "graphs_equal_eager": across if len(pairs) > 1 else None,
            "outputs": {mode: runs[0] for mode, runs in outputs.items()}}


def run_pytest(device, budget_s: float) -> dict:
    """pytest on TESTS with TREEVIZ_TEST_DEVICE=`device`: counts by outcome, return code, the output's tail."""
    env = {**os.environ, "TREEVIZ_TEST_DEVICE": device.type}
    command = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *TESTS]
    start = time.monotonic()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=budget_s)
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        return {"command": " ".join(command[1:]), "returncode": None, "timed_out": True, "seconds": budget_s,
                "counts": {}, "tail": tail(out)}
    out = done.stdout + done.stderr
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)",
                                                     out.strip().splitlines()[-1] if out.strip() else "")}
    return {"command": " ".join(command[1:]), "device": device.type, "returncode": done.returncode,
            "timed_out": False, "seconds": time.monotonic() - start, "counts": counts,
            "tail": tail(out, 1500 if done.returncode == 0 else 6000)}


def run(ctx) -> dict:
    tokens = 12 if ctx.quick else 24
    modes = ("on", "off") if ctx.device.type == "cuda" else ("off",)
    names = list(STRATEGIES)
    result = {"dtype": "float32", "tokens": tokens, "prompt": PROMPT, "graphs": list(modes), "ar": {}, "greedy": {},
              "seeded": {}, "incomplete": []}
    related = {}  # graphs mode -> the related pair, for the seeded runs
    for kind in KINDS:
        for mode in modes:
            if ctx.left() < RESERVE_S:
                result["incomplete"].append(f"{kind} pair, graphs {mode}: not run, the section's time was up")
                continue
            pair = tiny_random_pair(kind, dtype=torch.float32, device=ctx.device, capture=mode)
            related.update({mode: pair} if kind == "related" else {})
            ar = result["ar"][kind] = reference(pair, tokens)
            for name in names:
                case = greedy_case(pair, name, ar, tokens)
                result["greedy"].setdefault(name, []).append({"pair": kind, "graphs": mode, **case})
            ctx.checkpoint(result)
    for name in names:
        if ctx.left() < RESERVE_S or len(related) < len(modes):
            result["incomplete"].append(f"seeded {name}: not run, the section's time was up")
            continue
        result["seeded"][name] = seeded_case(related, name, tokens)
    ctx.checkpoint(result)
    result["pytest"] = run_pytest(ctx.device, max(min(PYTEST_MAX_S, ctx.left()), RESERVE_S))
    result["passed"] = passed(result)
    return result


def passed(result: dict) -> bool:
    """Every greedy run equal to AR, every seeded pair of runs equal (graphed = eager on CUDA), the tests passed,
    nothing left out for lack of time."""
    greedy = all(case["equal"] for cases in result["greedy"].values() for case in cases)
    seeded = all(s["same_seed_same_output"] and s["graphs_equal_eager"] is not False
                 for s in result["seeded"].values())
    tests = result["pytest"]["returncode"] == 0 and not result["pytest"]["counts"].get("failed")
    return greedy and seeded and tests and not result["incomplete"]


def summarise(result: dict) -> list[str]:
    modes = result["graphs"]
    lines = [f"{result['dtype']}, {result['tokens']} tokens, greedy = AR on dynamic eager steps, graphs "
             f"{' and '.join(modes)}; seeded: T = {SAMPLED.temperature}, seed {SAMPLED.seed}, twice", "",
             "| strategy | " + " | ".join(f"= AR, graphs {m}" for m in modes) + " | same seed, same output |"
             + (" graphed = eager (sampled) |" if len(modes) > 1 else ""),
             "|---|" + "---|" * len(modes) + "---|" + ("---|" if len(modes) > 1 else "")]
    for name, cases in result["greedy"].items():
        cells = []
        for mode in modes:
            mine = [c for c in cases if c["graphs"] == mode]
            bad = [f"{c['pair']}@{c['first_divergence']}" for c in mine if not c["equal"]]
            cells.append(f"{sum(c['equal'] for c in mine)}/{len(mine)}" + (f" (differs: {', '.join(bad)})" if bad
                                                                            else ""))
        seeded = result["seeded"].get(name, {})
        row = f"| {name} | " + " | ".join(cells) + f" | {seeded.get('same_seed_same_output', '–')} |"
        if len(modes) > 1:
            row += f" {seeded.get('graphs_equal_eager', '–')} |"
        lines.append(row)
    lines += [f"- not run: {why}" for why in result.get("incomplete", [])]
    test = result.get("pytest")
    if test:
        counts = ", ".join(f"{n} {k}" for k, n in test["counts"].items()) or "no summary line"
        lines += ["", f"`TREEVIZ_TEST_DEVICE={test.get('device', '?')} python {test['command']}`: {counts}, "
                      f"return code {test['returncode']}{' (timed out)' if test['timed_out'] else ''}, "
                      f"{test['seconds']:.0f} s"]
        if test["returncode"] != 0:
            lines += ["```", test["tail"], "```"]
    return lines
