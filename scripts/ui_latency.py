"""How fast the app streams: time from Run to the first tree, and the app's cost per iteration on top of decoding.

    python -m scripts.ui_latency                      # tiny random pair, 5 runs of 96 tokens
    python -m scripts.ui_latency --pair default --runs 2

Launches the app in this process on 127.0.0.1 and calls /run through gradio_client. Per run it records the wall time
from submit to the first update holding a tree, and (wall time of the whole call - the decode time the run itself
measured, `metrics.total_s`) / iterations: what streaming, figures and transport add per target pass (fixed
per-call costs such as the final charts and the trace file are spread over the iterations). Then, in process, the
cost of building one streamed update (snapshot + tree, text and metrics row) at every iteration of one run.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def has_tree(output) -> bool:
    tree = output[3]  # scrubber, status, download, tree, ...
    return isinstance(tree, dict) and tree.get("type") == "plotly" and '"markers' in tree.get("plot", "")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="tiny-random")
    parser.add_argument("--strategy", default="dynatree")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)

    from gradio_client import Client
    from treeviz.ui import build_demo, launch_kwargs
    demo = build_demo(initial_pair=args.pair)
    demo.queue(default_concurrency_limit=4)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True, **launch_kwargs())
    client = Client(f"http://127.0.0.1:{port}/", verbose=False)
    firsts, per_iter = [], []
    try:
        # One prompt throughout: the first run warms up, loads the pair and measures the AR baseline (cached per
        # prompt afterwards), so the later calls hold only this strategy's decoding plus the app's own work.
        for i in range(args.runs + 1):
            t0 = time.perf_counter()
            job = client.submit("def f(n):\n", False, args.pair, args.strategy, "cpu", args.max_new_tokens,
                                api_name="/run")
            first = None
            while not job.done():
                if first is None and any(has_tree(o) for o in job.outputs()):
                    first = time.perf_counter() - t0
                time.sleep(0.005)
            outputs = job.outputs()
            out = outputs[-1]
            updates = sum("decoding with" in str(o[1]) for o in outputs)  # streamed updates (status line)
            wall = time.perf_counter() - t0
            first = first if first is not None else wall
            trace = json.loads(Path(out[2]).read_text())
            m = trace["metrics"]
            if i == 0:
                continue
            firsts.append(first)
            per_iter.append((wall - m["total_s"]) / m["iterations"])
            print(f"run {i}: first tree {first * 1000:.0f} ms, {m['iterations']} iterations in {updates} streamed "
                  f"updates, decode {m['total_s'] * 1000:.0f} ms, call {wall * 1000:.0f} ms")
    finally:
        demo.close()
    print(f"median time Run -> first tree: {statistics.median(firsts) * 1000:.0f} ms")
    print(f"median (call - decode) / iteration: {statistics.median(per_iter) * 1000:.1f} ms")
    update_cost(args)


def update_cost(args) -> None:
    from engine.session import RunSpec
    from treeviz import handlers
    from treeviz.runs import BACKEND, Cancel, Step
    from treeviz.throttle import BUILD_SHARE, MIN_UPDATE_INTERVAL_S
    from treeviz.tree_figure import grow_frame
    spec = RunSpec(pair=args.pair, prompt="def f(n):\n", strategy=args.strategy, max_new_tokens=args.max_new_tokens)
    pair = BACKEND.pairs.ready(args.pair)
    costs, frame = [], None
    for item in BACKEND.decode(pair, spec, Cancel()):
        if isinstance(item, Step):  # what handlers.LiveUpdates builds for one update, at every iteration
            t0 = time.perf_counter()
            snap = item.run.snapshot()
            frame = grow_frame(frame, snap.iterations[-1])
            handlers._streamed(spec, snap, frame)
            costs.append(time.perf_counter() - t0)
    print(f"building one streamed update: median {statistics.median(costs) * 1000:.1f} ms, "
          f"max {max(costs) * 1000:.1f} ms over {len(costs)} iterations (sent at most every "
          f"{MIN_UPDATE_INTERVAL_S:.2f} s, and at least {(1 - BUILD_SHARE) / BUILD_SHARE:.0f}x an update's cost apart)")


if __name__ == "__main__":
    main()
