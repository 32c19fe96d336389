"""How fast the app streams: time from Run to the first tree, and the app's cost per iteration on top of decoding.

    python -m scripts.ui_latency                      # tiny random pair, 5 runs of 96 tokens
    python -m scripts.ui_latency --pair default --runs 2
    python -m scripts.ui_latency --pair default --browser --prompt-set code --runs 4   # in a real Chromium

Launches the app in this process on 127.0.0.1 and calls /run through gradio_client. Per run it records the wall time
from submit to the first update holding a tree, and (wall time of the whole call - the decode time the run itself
measured, `metrics.total_s`) / iterations: what streaming, figures and transport add per target pass (fixed
per-call costs such as the final charts and the trace file are spread over the iterations). Then, in process, the
cost of building one streamed update (snapshot + tree, text and metrics row) at every iteration of one run.

`--browser` drives the page in headless Chromium (/usr/bin/chromium, Playwright) instead, one Run per prompt of a
prompt set, and measures how far behind the decoder the page is: the server stamps the end of every iteration and
of the run (it wraps the runs `treeviz.serving.work.start_run` builds, to read the clock; nothing else changes), the
page stamps every change of the run's status line (a MutationObserver), both on this machine's wall clock. Printed per
run: the delay of each streamed update (page shows iteration k minus the decoder finished k) and the final view's
(page shows the finished run minus the decoder's last token).
"""
from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

from engine.core.trace import load_run

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(pair: str):
    """The app in this process on a free local port, serving in the background: (demo, port)."""
    from treeviz.page.ui import build_demo, launch_kwargs
    demo = build_demo(initial_pair=pair)
    demo.queue(default_concurrency_limit=4)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True, **launch_kwargs())
    return demo, port


def has_tree(output) -> bool:
    tree = output[3]  # scrubber, status, download, tree, ...
    return isinstance(tree, dict) and tree.get("type") == "plotly" and '"markers' in tree.get("plot", "")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="tiny-random")
    parser.add_argument("--strategy", default="dynatree")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--browser", action="store_true", help="measure the page's lag in headless Chromium")
    parser.add_argument("--prompt-set", default="code",
                        help="--browser: the prompts, one Run each (up to --runs), with the page's own strategy and "
                             "max new tokens (DynaTree, 48)")
    args = parser.parse_args(argv)
    if args.browser:
        browser_lag(args)
        return

    from gradio_client import Client
    demo, port = start_app(args.pair)
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
            m = load_run(out[2]).metrics
            if i == 0:
                continue
            firsts.append(first)
            per_iter.append((wall - m.total_s) / m.iterations)
            print(f"run {i}: first tree {first * 1000:.0f} ms, {m.iterations} iterations in {updates} streamed "
                  f"updates, decode {m.total_s * 1000:.0f} ms, call {wall * 1000:.0f} ms")
    finally:
        demo.close()
    print(f"median time Run -> first tree: {statistics.median(firsts) * 1000:.0f} ms")
    print(f"median (call - decode) / iteration: {statistics.median(per_iter) * 1000:.1f} ms")
    update_cost(args)


def update_cost(args) -> None:
    from functools import partial

    from engine.recipe import RunSpec
    from treeviz.page.handlers import RunView
    from treeviz.serving import work
    from treeviz.serving.events import Iteration
    from treeviz.serving.server import SERVER, PageState
    from treeviz.serving.throttle import BUILD_SHARE, MIN_UPDATE_INTERVAL_S, UpdateThrottle
    spec = RunSpec(pair=args.pair, prompt="def f(n):\n", strategy=args.strategy, max_new_tokens=args.max_new_tokens)
    SERVER.pairs.ready(args.pair)
    plain, costs, view = work.UpdateThrottle, [], RunView(spec, "per iteration", PageState())
    work.UpdateThrottle = partial(UpdateThrottle, min_interval=0.0, share=1.0)  # an update at every iteration
    try:
        for event in work.decode_events(spec, SERVER.open("ui-latency", "run").ticket(spec)):
            if isinstance(event, Iteration):  # what the Run handler builds for one streamed update
                t0 = time.perf_counter()
                view.update(event)
                costs.append(time.perf_counter() - t0)
    finally:
        work.UpdateThrottle = plain
    print(f"building one streamed update: median {statistics.median(costs) * 1000:.1f} ms, "
          f"max {max(costs) * 1000:.1f} ms over {len(costs)} iterations (sent at most every "
          f"{MIN_UPDATE_INTERVAL_S:.2f} s, and at least {(1 - BUILD_SHARE) / BUILD_SHARE:.0f}x an update's cost apart)")


class StampedRun:
    """A DecodeRun whose every iteration and end are stamped on the wall clock in `marks`; the rest is the run's."""

    def __init__(self, run, strategy: str, marks: list):
        self.run, self.strategy, self.marks = run, strategy, marks

    def __iter__(self):
        k = 0
        for record in self.run:
            self.marks.append((self.strategy, "step", k, time.time()))
            k += 1
            yield record
        self.marks.append((self.strategy, "end", k, time.time()))

    def __getattr__(self, name):
        return getattr(self.run, name)


@contextmanager
def stamped_iterations() -> Iterator[list]:
    """While open, every iteration's end and every run's end are stamped on the wall clock: (strategy, "step" or
    "end", iterations so far, seconds). Wraps the runs treeviz.serving.work builds (`start_run`), and puts it back
    after."""
    from treeviz.serving import work
    plain, marks = work.start_run, []
    work.start_run = lambda pair, spec, *rest: StampedRun(plain(pair, spec, *rest), spec.strategy, marks)
    try:
        yield marks
    finally:
        work.start_run = plain


WATCH_STATUS = """() => { window.__seen = [];  // [wall seconds, status text] at every change
    new MutationObserver(() => window.__seen.push([Date.now() / 1000,
        document.querySelector('#tv-run-status').innerText]))
      .observe(document.querySelector('#tv-run-status'), {subtree: true, childList: true, characterData: true}); }"""
STREAMED = re.compile(r"decoding with \S+: iteration (\d+)")


def lag_of_run(page, prompt: str, marks: list, strategy: str) -> dict:
    """Run `prompt` from the page (its own strategy and max new tokens) and wait until AR is in too; the delay of
    every streamed update the page showed and of the finished view, in seconds after the decoder got there."""
    del marks[:]
    page.evaluate("window.__seen = []")
    page.locator("#tv-prompt textarea").fill(prompt)
    page.click("#tv-run")
    # the new run's first status ("starting…") comes before its finished one: a late redraw of the last run's
    # finished status, after the click, must not count
    page.wait_for_function("""() => { const i = window.__seen.findIndex(([t, s]) => !s.includes('tokens/s'));
        return i >= 0 && window.__seen.slice(i).some(([t, s]) => s.includes('tokens/s') && !s.includes('measuring AR'));
    }""", timeout=600_000)
    seen = page.evaluate("window.__seen")
    seen = seen[next(i for i, (_, text) in enumerate(seen) if "tokens/s" not in text):]
    steps = {k: t for name, kind, k, t in marks if kind == "step" and name == strategy}
    end = next(t for name, kind, _, t in marks if kind == "end" and name == strategy)
    shown = [(t, int(m.group(1))) for t, text in seen if (m := STREAMED.search(text))]
    final = next(t for t, text in seen if "tokens/s" in text)
    return {"iterations": len(steps), "updates": [t - steps[k] for t, k in shown if k in steps], "final": final - end}


def browser_lag(args) -> None:
    """The page's lag on each prompt of the set (the first one run once more before, to warm up; not reported)."""
    from playwright.sync_api import sync_playwright
    from engine.core.prompts import load_prompt_set
    from treeviz.page.ui import DEFAULT_STRATEGY
    prompts = [p for p in load_prompt_set(args.prompt_set) if isinstance(p["prompt"], str)][:args.runs]
    with stamped_iterations() as marks:
        demo, port = start_app(args.pair)
        try:
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=["--headless", "--no-sandbox"])
                page = browser.new_page(viewport={"width": 1440, "height": 1000})
                page.goto(f"http://127.0.0.1:{port}/")
                page.wait_for_selector("#tv-run-status")
                page.evaluate(WATCH_STATUS)
                lag_of_run(page, prompts[0]["prompt"], marks, DEFAULT_STRATEGY)
                for prompt in prompts:
                    row = {"prompt": prompt["name"], **lag_of_run(page, prompt["prompt"], marks, DEFAULT_STRATEGY)}
                    delays = row["updates"] or [0.0]
                    print(f"{row['prompt']}: {row['iterations']} iterations, {len(row['updates'])} streamed updates "
                          f"shown, their delay median {statistics.median(delays):.2f} s, max {max(delays):.2f} s; "
                          f"final view {row['final']:.2f} s after the last token")
                browser.close()
        finally:
            demo.close()


if __name__ == "__main__":
    main()
