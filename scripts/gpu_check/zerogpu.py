"""ZeroGPU's process model, emulated in a fresh process, so that CUDA was never initialised in the parent:

    python -m scripts.gpu_check.zerogpu --device cuda --pair tiny-random --pair "shape:A + shape:B" --json OUT.json

The parent loads each pair on the CPU (a Space loads its pair at import time; ZeroGPU's `spaces` keeps the weights
off the GPU until a request runs), checks that CUDA is not initialised, and forks one child per request
(multiprocessing "fork", as `spaces.GPU` does). The request's arguments (a RunSpec and the session's key) cross as
pickle bytes; the child places the pair on the GPU (the first CUDA call of the process tree), turns CUDA graphs on (so
they are captured inside the child, inside its time slot), runs the Run request's work, treeviz/serving/work.py
`decode_events` where treeviz imports (else the engine's equivalent: the run, then AR on the same prompt), and sends
every event back pickled. The parent times the request from the fork to the child's last message, capture and
placement included, and sets that beside the `duration` callable's estimate (`run_seconds`: what ZeroGPU would
reserve for it). On a CPU the same runs with the pair left on the CPU, eager.
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
from scripts.gpu_check.app import PROMPT, engine_run, treeviz_runs  # noqa: E402


def place(pair, device: torch.device):
    """The pair as the child runs it: on the GPU with graphs on (its models moved there now), or unchanged."""
    if device.type != "cuda":
        return pair
    for model in (pair.target, pair.draft):
        if model is not None:
            model.to(device)
    return replace(pair, device=device, capture="cuda-graphs", static_steps={}, captured={}, capture_info={})


def work(runs, pair, spec: RunSpec, key: str):
    """The Run request's events in the child: treeviz's decode_events on the placed pair (the state PairManager.load
    leaves, the pair now on the GPU), or the engine's equivalent."""
    if runs is None:
        return engine_run(pair, spec)
    manager = runs.SERVER.pairs
    manager.name = manager.loaded_name = spec.pair
    manager.pair = pair
    return runs.decode_events(spec, key)


def child(runs, pair, payload: bytes, device: str, conn) -> None:
    """The forked worker: unpickle the request, place the pair, send each event pickled, then a report. One CPU
    thread: the parent's OpenMP workers do not exist in a forked child, and a parallel region that expects them
    never ends (seen on a CPU: the child hung in libgomp's barrier inside its first matmul)."""
    try:
        torch.set_num_threads(1)
        spec, key = pickle.loads(payload)
        started = time.monotonic()
        placed = place(pair, torch.device(device))
        place_s = time.monotonic() - started
        for event in work(runs, placed, spec, key):
            conn.send_bytes(pickle.dumps(("event", event)))
        steps = {role: {"buckets": list(s.buckets), "capture_s": sum(s.capture_info["seconds"].values())}
                 for role, s in placed.static_steps.items()}
        conn.send_bytes(pickle.dumps(("done", {"place_s": place_s, "cuda_initialized": torch.cuda.is_initialized(),
                                               "graphs": placed.graphs, "steps": steps})))
    except BaseException:  # noqa: BLE001 - everything the parent should know about goes back to it
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc()[-3000:])))
    finally:
        conn.close()


def request(runs, pair, spec: RunSpec, device: str, timeout: float) -> dict:
    """One forked request, timed from the fork to the child's last message."""
    key = f"zerogpu-check/{spec.pair}"
    out = {"pair": spec.pair, "tokens": spec.max_new_tokens,
           "cuda_initialized_in_parent_before_fork": torch.cuda.is_initialized()}
    if runs is not None:
        out["duration_estimate_s"] = runs.run_seconds(spec, key)
    payload = pickle.dumps((spec, key))
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    started = time.monotonic()
    process = context.Process(target=child, args=(runs, pair, payload, device, send), daemon=True)
    process.start()
    send.close()
    out.update(collect(receive, started + timeout))
    out["seconds"] = time.monotonic() - started
    process.join(30)  # the child's exit tears down its CUDA context
    if process.is_alive():
        process.kill()
    out["exitcode"] = process.exitcode
    out["cuda_initialized_in_parent_after"] = torch.cuda.is_initialized()
    return out


def collect(receive, deadline: float) -> dict:
    """The child's messages until its report, an error, its exit or the deadline."""
    events, out = [], {}
    while "child" not in out and "error" not in out:
        left = deadline - time.monotonic()
        if left <= 0 or not receive.poll(left):
            out["error"] = "timed out waiting for the child"
            break
        try:
            kind, value = pickle.loads(receive.recv_bytes())
        except EOFError:
            out["error"] = "the child exited without a report"
            break
        if kind == "event":
            events.append(value)
        else:
            out["child" if kind == "done" else "error"] = value
    out["events"] = [type(e).__name__ for e in events]
    out["last_has_result"] = bool(events) and bool(getattr(events[-1], "iterations", None)
                                                   or getattr(getattr(events[-1], "result", None), "iterations", None))
    return out


def load_on_cpu(name: str, device: str):
    """The pair as the Space's main process holds it: loaded on the CPU, nothing measured (no GPU there)."""
    target, draft = split_pair(name)
    tiny = target.startswith("tiny-random")
    dtype = "fp32" if tiny or device == "cpu" else "bf16"
    return load_pair(target, draft, device="cpu", dtype=dtype, packed="off", calibrate=False, capture="off")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--pair", action="append", required=True)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    initialized = {"after_imports": torch.cuda.is_initialized()}
    runs, why = treeviz_runs()
    initialized["after_treeviz_import"] = torch.cuda.is_initialized()
    report = {"treeviz": f"skipped: {why}; the engine's equivalent ran in the child" if why
              else "imported: decode_events ran in the child", "requests": [],
              "cuda_initialized_in_parent": initialized}  # where the parent first touched CUDA, if it did
    for name in args.pair:
        started = time.monotonic()
        pair = load_on_cpu(name, args.device)
        initialized[f"after_loading {name}"] = torch.cuda.is_initialized()
        spec = RunSpec(pair=name, prompt=PROMPT, strategy="dynatree", max_new_tokens=args.tokens, stop_on_eos=False)
        row = request(runs, pair, spec, args.device, args.timeout)
        row["parent_load_s"] = time.monotonic() - started - row["seconds"]
        report["requests"].append(row)
        with open(args.json, "w") as file:
            json.dump(report, file, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
