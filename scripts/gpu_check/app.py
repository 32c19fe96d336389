"""app: the app's serving code on the device, driven as the app drives it, and ZeroGPU's process model.

In this process: treeviz/serving/work.py's generators (decode_events, compare_events, race_events, sweep_events) each
through a RunSession of the app's Server, as the handlers drive them (Run, Compare, Race, Sweep), on the tiny pair and a
shape pair loaded by the app's PairManager (capture on for CUDA); every event pickled and read back (what crosses
ZeroGPU's boundary) and each request's seconds beside its `duration` callable's ask. treeviz/serving imports without
gradio (the GPU machine has none); if it did not, this section fails and says why.

Then zerogpu.py in a fresh process (CUDA never initialised there): the same four requests through treeviz/serving, each
one's work in a forked child that alone initialises CUDA, arguments and events pickled, each `duration` asked checked
against the measured wall time from the fork to the last event. Driving app.py itself through gradio_client needs
gradio; the report says whether it is installed (the page's tests, tests/test_ui*.py, drive it on a CPU).
"""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
import traceback

from engine.recipe import RunSpec
from scripts.gpu_check.report import tail

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"
PAIRS = ("tiny-random", "shape:pythia-2.8b + shape:pythia-70m")  # the tiny pair and the app's GPU preset's shapes
QUICK_PAIRS = ("tiny-random",)
# each request: its generator and duration callable (treeviz/serving/work.py), the view its session opens, its good ends
REQUESTS = {
    "run": ("decode_events", "run_seconds", "run", ("BaselineMeasured", "Finished")),
    "compare": ("compare_events", "compare_seconds", "run", ("Finished",)),
    "race": ("race_events", "race_seconds", "race", ("Raced",)),
    "sweep": ("sweep_events", "sweep_seconds", "sweep", ("Swept",)),
}


def arguments(spec: RunSpec) -> dict[str, tuple]:
    """Each request's arguments before the session's key, as its handler builds them."""
    lanes = [("AR", spec.as_method("ar")), ("linear", spec.as_method("linear")), ("DynaTree", spec)]
    return {"run": (spec,), "compare": (spec, ["linear", "dynatree"]), "race": (lanes,), "sweep": (spec, [4, 8])}


def run(ctx) -> dict:
    cuda = ctx.device.type == "cuda"
    tokens = 12 if ctx.quick else 24
    runs, why = treeviz_runs()
    if runs is None:
        raise RuntimeError(f"the app's serving code must run here and does not: {why}")
    result = {"tokens": tokens, "treeviz": "imported: requests ran through treeviz/serving",
              "gradio_client": gradio_client_note(), "pairs": {}}
    pairs = QUICK_PAIRS if ctx.quick else PAIRS
    for name in pairs:
        spec = RunSpec(pair=name, prompt=PROMPT, strategy="dynatree", max_new_tokens=tokens, stop_on_eos=False)
        try:
            result["pairs"][name] = drive_treeviz(runs, spec, ctx.device)
        except Exception as err:  # noqa: BLE001 - recorded; the next pair and the forked requests still run
            result["pairs"][name] = {"error": f"{type(err).__name__}: {err}\n{traceback.format_exc()[-1500:]}"}
        ctx.checkpoint(result)
    result["zerogpu"] = zerogpu(ctx.device, pairs, tokens, max(ctx.left() - 5, 30.0))
    result["passed"] = passed(result, cuda)
    return result


def treeviz_runs():
    """(treeviz.serving.work, None), or (None, why it cannot be imported)."""
    try:
        from treeviz.serving import work as runs
        return runs, None
    except ImportError as err:
        return None, f"treeviz.serving.work not importable ({type(err).__name__}: {err})"


def gradio_client_note() -> str:
    try:
        import gradio
        import gradio_client
    except ImportError as err:
        return f"skipped: gradio not installed ({err})"
    return (f"possible (gradio {gradio.__version__}, gradio_client {gradio_client.__version__} installed); not driven "
            "here: tests/test_ui*.py drive app.py through gradio_client")


# -- in process --------------------------------------------------------------------------------------------------------

def drive_treeviz(runs, spec: RunSpec, device) -> dict:
    """The pair loaded by the app's PairManager, then each request through a RunSession, as its handler runs it (the
    AR cached for Run and Compare handed over in the ticket), its seconds beside the `duration` it would ask."""
    manager = runs.SERVER.pairs
    manager.capture_mode = "on" if device.type == "cuda" else "off"
    started = time.monotonic()
    manager.load(spec.pair, device=str(device))
    out = {"load_s": time.monotonic() - started, "pair": manager.status().description or manager.status().error}
    for label, args in arguments(spec).items():
        generator, duration, view, good = REQUESTS[label]
        session = runs.SERVER.open("gpu-check", view)
        baseline_for = spec if label in ("run", "compare") else None
        estimate = getattr(runs, duration)(*args, session.ticket(baseline_for))
        started = time.monotonic()
        events = list(session.events(f"gpu check: {label}", spec.pair, getattr(runs, generator), *args,
                                     baseline_for=baseline_for))
        seconds = time.monotonic() - started
        checked = check_events(events, good)
        out[label] = {"seconds": seconds, "duration_estimate_s": estimate, **checked,
                      "ok": checked["ok"] and seconds <= estimate}
    return out


def check_events(events: list, good: tuple[str, ...]) -> dict:
    """Every event pickled and read back as its own type; the last one one of `good`; none Failed or Stopped."""
    names, size = [], 0
    for event in events:
        data = pickle.dumps(event)
        size += len(data)
        if type(pickle.loads(data)) is not type(event):
            raise TypeError(f"{type(event).__name__} does not survive pickling")
        names.append(type(event).__name__)
    failed = [getattr(e, "message", "") for e in events if type(e).__name__ == "Failed"]
    ok = bool(names) and names[-1] in good and not failed and "Stopped" not in names
    return {"events": names, "pickled_bytes": size, "ok": ok, **({"failed": failed} if failed else {})}


# -- ZeroGPU -----------------------------------------------------------------------------------------------------------

def zerogpu(device, pairs: tuple[str, ...], tokens: int, timeout: float) -> dict:
    """zerogpu.py in a fresh process; its JSON, with the command and its output's tail."""
    with tempfile.TemporaryDirectory(prefix="treeviz-zerogpu-") as folder:
        path = os.path.join(folder, "zerogpu.json")
        command = [sys.executable, "-m", "scripts.gpu_check.zerogpu", "--device", device.type, "--tokens", str(tokens),
                   "--timeout", f"{timeout / len(pairs):.0f}", "--json", path]
        for name in pairs:
            command += ["--pair", name]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout + 30)
            output, code = done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired as err:
            output, code = str(err.stdout or ""), None
        report = json.loads(open(path).read()) if os.path.exists(path) else {"requests": []}
    return {"command": " ".join(command[1:]), "returncode": code, **report,
            **({"tail": tail(output)} if code != 0 else {})}


def request_ok(row: dict, cuda: bool) -> bool:
    """A forked request: it ended with a result within the duration it asked for, nothing went wrong, and on CUDA the
    child alone initialised CUDA."""
    child = row.get("child") or {}
    alone = not row["cuda_initialized_in_parent_before_fork"] and not row["cuda_initialized_in_parent_after"]
    return (row.get("exitcode") == 0 and "error" not in row and not row.get("failed")
            and row.get("last_has_result", False) and alone and (child.get("cuda_initialized") is True) == cuda
            and row["seconds"] <= row["duration_estimate_s"])


def passed(result: dict, cuda: bool) -> bool:
    in_process = all("error" not in p and all(r["ok"] for r in p.values() if isinstance(r, dict))
                     for p in result["pairs"].values())
    forked = result["zerogpu"]
    return (in_process and forked["returncode"] == 0 and bool(forked["requests"])
            and all(request_ok(r, cuda) for r in forked["requests"]))


def summarise(result: dict) -> list[str]:
    lines = [f"treeviz layer: {result['treeviz']}", f"app.py through gradio_client: {result['gradio_client']}", "",
             "| pair | request | ok | seconds | duration estimate s | events |", "|---|---|---|---|---|---|"]
    for name, p in result["pairs"].items():
        if "error" in p:
            lines.append(f"| {name} | (load or a request raised) | False | | | {p['error'].splitlines()[0]} |")
        for label in REQUESTS:
            if label in p:
                r = p[label]
                events = ", ".join(dict.fromkeys(r["events"]))
                lines.append(f"| {name} | {label} | {r['ok']} | {r['seconds']:.1f} | "
                             f"{r.get('duration_estimate_s', '–')} | {events} |")
    forked = result.get("zerogpu", {})
    lines += ["", f"ZeroGPU process model (`{forked.get('command')}`, return code {forked.get('returncode')}; "
                  f"{forked.get('treeviz')}):", ""]
    for row in forked.get("requests", []):
        child = row.get("child") or {}
        capture = sum(s["capture_s"] for s in child.get("steps", {}).values())
        place = child.get("place_s", float("nan"))
        lines.append(f"- {row['pair']}, {row['request']}: {row['seconds']:.1f} s from fork to last event (placing the "
                     f"pair {place:.1f} s, capture {capture:.1f} s) against a duration asked of "
                     f"{row.get('duration_estimate_s', 'n/a')} s; CUDA initialised in the parent: "
                     f"{row['cuda_initialized_in_parent_before_fork']} before, "
                     f"{row['cuda_initialized_in_parent_after']} after; in the child: {child.get('cuda_initialized')}; "
                     f"events {', '.join(row['events'])}" + (f"; error: {row['error']}" if row.get("error") else "")
                     + (f"; failed: {row['failed']}" if row.get("failed") else ""))
    if forked.get("tail"):
        lines += ["```", forked["tail"], "```"]
    return lines
