"""ZeroGPU's process model around the app's own serving code, emulated in a fresh process (CUDA never initialised in
the parent):

    python -m scripts.gpu_check.zerogpu --device cuda --pair tiny-random --pair "shape:A + shape:B" --json OUT.json

The parent holds each pair as the Space's main process does (loaded on the CPU, served by the app's PairManager) and
drives Run, Compare, Race and Sweep through treeviz/serving itself: a RunSession per request (its wait for the pair,
run lock, compute thread, Ticket, AR cache) stepping `spaces_gpu(work)`, this module's stand-in for `spaces.GPU`. Like
spaces' wrapper it asks the work's `duration` callable first, then forks one child per request (multiprocessing
"fork") and sends the arguments (the request's, and its Ticket) as pickle bytes. The child places the pair on the GPU
(the first CUDA call of the process tree), turns CUDA graphs on (captured inside the child, inside its slot), runs
treeviz/serving/work.py's generator and sends every event back pickled. The parent times each request from the fork
to the child's last message and sets it beside the `duration` asked. On a CPU the same runs with the pair left on the
CPU, eager.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pickle
import time
import traceback
from dataclasses import replace

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # availability checks must not initialise CUDA here

import torch  # noqa: E402

from engine.models import load_pair  # noqa: E402
from engine.recipe import RunSpec, split_pair  # noqa: E402
from scripts.gpu_check.app import PROMPT, REQUESTS, arguments  # noqa: E402
from treeviz.serving import work  # noqa: E402
from treeviz.serving.pairs import Serving  # noqa: E402
from treeviz.serving.server import SERVER  # noqa: E402


def place(pair, device: torch.device):
    """The pair as the child runs it: on the GPU with graphs on (its models moved there now), or unchanged."""
    if device.type != "cuda":
        return pair
    for model in (pair.target, pair.draft):
        if model is not None:
            model.to(device)
    return replace(pair, device=device, capture="cuda-graphs", static_steps={}, captured={}, capture_info={})


def child(name: str, payload: bytes, device: str, conn) -> None:
    """The forked worker: unpickle the request, place the pair, run the work on it (served as the app's manager
    serves it), send each event pickled, then a report. One CPU thread: the parent's OpenMP workers do not exist in a
    forked child, and a parallel region that expects them never ends (seen on a CPU: the child hung in libgomp)."""
    try:
        torch.set_num_threads(1)
        args = pickle.loads(payload)
        serving = SERVER.pairs.serving
        started = time.monotonic()
        placed = place(serving.pair, torch.device(device))
        place_s = time.monotonic() - started
        SERVER.pairs.serving = Serving(serving.name, placed)
        for event in getattr(work, name)(*args):
            conn.send_bytes(pickle.dumps(("event", event)))
        steps = {role: {"buckets": list(s.buckets), "capture_s": sum(s.capture_info["seconds"].values())}
                 for role, s in placed.static_steps.items()}
        conn.send_bytes(pickle.dumps(("done", {"place_s": place_s, "cuda_initialized": torch.cuda.is_initialized(),
                                               "graphs": placed.graphs, "steps": steps})))
    except BaseException:  # noqa: BLE001 - everything the parent should know about goes back to it
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc()[-3000:])))
    finally:
        conn.close()


def spaces_gpu(name: str, duration, device: str, timeout: float, row: dict):
    """`spaces.GPU(duration=duration)(work.<name>)` as its ZeroGPU path behaves: the duration asked with the call's
    arguments, then a forked worker per call, arguments and events pickled across; what happened goes into `row`."""
    def call(*args):
        row["duration_estimate_s"] = duration(*args)
        row["cuda_initialized_in_parent_before_fork"] = torch.cuda.is_initialized()
        context = multiprocessing.get_context("fork")
        receive, send = context.Pipe(duplex=False)
        started = time.monotonic()
        process = context.Process(target=child, args=(name, pickle.dumps(args), device, send), daemon=True)
        process.start()
        send.close()
        try:
            yield from collect(receive, started + timeout, row)
        finally:
            row["seconds"] = time.monotonic() - started
            process.join(30)  # the child's exit tears down its CUDA context
            if process.is_alive():
                process.kill()
            row["exitcode"] = process.exitcode
            row["cuda_initialized_in_parent_after"] = torch.cuda.is_initialized()
    return call


def collect(receive, deadline: float, row: dict):
    """Yield the child's events until its report, an error, its exit or the deadline (those go into `row`)."""
    names = row.setdefault("events", [])
    while "child" not in row and "error" not in row:
        left = deadline - time.monotonic()
        if left <= 0 or not receive.poll(left):
            row["error"] = "timed out waiting for the child"
            break
        try:
            kind, value = pickle.loads(receive.recv_bytes())
        except EOFError:
            row["error"] = "the child exited without a report"
            break
        if kind == "event":
            names.append(type(value).__name__)
            yield value
        else:
            row["child" if kind == "done" else "error"] = value


def request(label: str, spec: RunSpec, device: str, timeout: float) -> dict:
    """One request through a RunSession of the app's Server, its work forked as ZeroGPU forks it."""
    name, duration, view, good = REQUESTS[label]
    row = {"pair": spec.pair, "request": label, "tokens": spec.max_new_tokens}
    forked = spaces_gpu(name, getattr(work, duration), device, timeout, row)
    session = SERVER.open("zerogpu-check", view)
    args = arguments(spec)[label]
    seen = list(session.events(f"zerogpu check: {label}", spec.pair, forked, *args,
                               baseline_for=spec if label in ("run", "compare") else None))
    last = seen[-1]
    row["session_events"] = [type(e).__name__ for e in seen]
    row["failed"] = getattr(last, "message", None) if type(last).__name__ == "Failed" else None
    row["last_has_result"] = type(last).__name__ in good
    row["ar_cached_in_parent"] = len(SERVER.ar_cache)
    return row


def load_on_cpu(name: str, device: str):
    """The pair as the Space's main process holds it: loaded on the CPU, nothing measured (no GPU there), served by
    the app's pair manager."""
    target, draft = split_pair(name)
    tiny = target.startswith("tiny-random")
    dtype = "fp32" if tiny or device == "cpu" else "bf16"
    pair = load_pair(target, draft, device="cpu", dtype=dtype, packed="off", calibrate=False, capture="off")
    SERVER.pairs.name, SERVER.pairs.serving = name, Serving(name, pair)
    return pair


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--pair", action="append", required=True)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per pair (its four requests)")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    initialized = {"after_imports": torch.cuda.is_initialized()}
    report = {"treeviz": "imported: Run, Compare, Race and Sweep through treeviz/serving, each work in a forked child",
              "requests": [], "cuda_initialized_in_parent": initialized}  # where the parent first touched CUDA
    for name in args.pair:
        started = time.monotonic()
        load_on_cpu(name, args.device)
        initialized[f"after_loading {name}"] = torch.cuda.is_initialized()
        load_s = time.monotonic() - started
        spec = RunSpec(pair=name, prompt=PROMPT, strategy="dynatree", max_new_tokens=args.tokens, stop_on_eos=False)
        SERVER.ar_cache.entries.clear()
        for label in REQUESTS:
            row = request(label, spec, args.device, args.timeout / len(REQUESTS))
            row["parent_load_s"] = load_s
            report["requests"].append(row)
            with open(args.json, "w") as file:
                json.dump(report, file, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
