"""Lab probe behind docs/experiments/2026-11-25-captured-steps.md ("The app") and 2026-11-26-every-cpu.md.

The app with captured steps, measured from outside: how long a start takes to its first live tree and to its
captured steps, then Races of AR against a strategy on the steps the app runs.

    python -m scripts.lab.app_capture --pair default --races 8 --json race.json     # the cache as it is
    python -m scripts.lab.app_capture --pair default --races 8 --browser            # Races clicked in Chromium
    TREEVIZ_CACHE=/tmp/fresh python -m scripts.lab.app_capture --pair default       # a first start (compiles meanwhile)

Launches the app in this process (scripts/ui_latency.py `start_app`) and talks to it through gradio_client only:
/run until its first update holds a tree, then the pair's status line until no captured step is pending, then
/race per prompt of the set (or, with --browser, the Race button clicked in headless Chromium, /usr/bin/chromium,
and the race's headline read from the page). Times are wall seconds from this process's start.
"""
from __future__ import annotations

import argparse
import json
import re
import resource
import time

START = time.monotonic()

from engine.core.prompts import load_prompt_set  # noqa: E402 - the clock starts before the imports
from scripts.ui_latency import has_tree, start_app  # noqa: E402


def since_start() -> float:
    return round(time.monotonic() - START, 1)


def first_tree(client, pair: str, prompt: str, strategy: str) -> dict:
    """Seconds until /run's first update with a tree, and until it ends; the steps the run took."""
    job = client.submit(prompt, False, pair, strategy, "auto", 48, api_name="/run")
    seen = None
    while not job.done():
        if seen is None and any(has_tree(o) for o in job.outputs()):
            seen = since_start()
        time.sleep(0.2)
    job.result()
    return {"first_tree_s": seen or since_start(), "run_done_s": since_start()}


def wait_for_capture(backend, timeout: float) -> dict:
    """Poll the pair's capture line (what the page shows) until nothing is pending."""
    deadline = time.monotonic() + timeout
    while backend.pairs.status().capture and time.monotonic() < deadline:
        time.sleep(2.0)
    status = backend.pairs.status()
    return {"captured_ready_s": since_start(), "pending": status.capture, "description": status.description}


def races(client, pair: str, strategy: str, prompts: list[dict], tokens: int) -> list[dict]:
    out = []
    for entry in prompts:
        summary = client.predict(entry["prompt"], False, pair, [strategy], tokens, 0.0, 1.0, 0, 0, "auto",
                                 api_name="/race")[-1]  # the State output is not in the API
        lanes = {lane["label"]: lane for lane in summary["lanes"]}
        ar, tree = lanes["AR"], summary["lanes"][-1]
        row = {"name": entry["name"], "ar_s": round(ar["decode_s"], 2), "tree_s": round(tree["decode_s"], 2),
               "speedup": round(tree["speedup_vs_ar"], 2), "steps": tree["steps"], "ar_steps": ar["steps"]}
        print(row, flush=True)
        out.append(row)
    return out


HEADLINE = re.compile(r"(\S+) ([\d.]+)× AR \(AR ([\d.]+) (m?s) ÷ \S+ ([\d.]+) (m?s)\)")


def browser_races(port: int, prompts: list[dict]) -> list[dict]:
    """The Race button clicked per prompt in a real Chromium; each race's headline as the page shows it."""
    from playwright import sync_api
    out = []
    status = "document.querySelector('#tv-race-status').innerText"
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1440, "height": 1000})
        page.goto(f"http://127.0.0.1:{port}/")
        page.wait_for_selector("#tv-prompt textarea", timeout=60_000)
        page.get_by_role("tab", name="Race", exact=True).click()  # a tab's components render when it opens
        page.wait_for_selector("#tv-race-btn", timeout=60_000)
        for entry in prompts:
            page.fill("#tv-prompt textarea", entry["prompt"])
            page.click("#tv-race-btn")
            page.wait_for_function(f"!{status}.includes('winner')", timeout=60_000)
            page.wait_for_function(f"{status}.includes('winner')", timeout=600_000)
            text = page.evaluate(status)
            match = HEADLINE.search(text)
            if match is None:
                raise RuntimeError(f"no race headline on the page: {text!r}")
            label, factor, ar, ar_unit, tree, tree_unit = match.groups()
            scale = lambda v, unit: float(v) / (1000 if unit == "ms" else 1)  # noqa: E731
            row = {"name": entry["name"], "strategy": label, "speedup": float(factor),
                   "ar_s": scale(ar, ar_unit), "tree_s": scale(tree, tree_unit), "page": text}
            print({k: v for k, v in row.items() if k != "page"}, flush=True)
            out.append(row)
        browser.close()
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="default")
    parser.add_argument("--strategy", default="dynatree")
    parser.add_argument("--prompt-set", default="code", help="code or prose (text prompts)")
    parser.add_argument("--races", type=int, default=8, help="prompts of the set to race (0: none)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--capture-timeout", type=float, default=1800.0)
    parser.add_argument("--browser", action="store_true", help="click the Race button in headless Chromium")
    parser.add_argument("--json", help="write the measurements here")
    args = parser.parse_args(argv)

    from gradio_client import Client

    from treeviz.serving.server import SERVER
    demo, port = start_app(args.pair)
    client = Client(f"http://127.0.0.1:{port}/", verbose=False)
    prompts = [p for p in load_prompt_set(args.prompt_set) if p["kind"] != "chat"]  # /race takes text prompts here
    report = {"pair": args.pair, "app_up_s": since_start()}
    report.update(first_tree(client, args.pair, prompts[0]["prompt"], args.strategy))
    print(report, flush=True)
    report.update(wait_for_capture(SERVER, args.capture_timeout))
    print(report, flush=True)
    report["races"] = (browser_races(port, prompts[:args.races]) if args.browser else
                       races(client, args.pair, args.strategy, prompts[:args.races], args.max_new_tokens))
    if report["races"]:
        ar = sum(r["ar_s"] for r in report["races"])
        tree = sum(r["tree_s"] for r in report["races"])
        report["set_speedup"] = round(ar / tree, 3)  # total AR time / total tree time over the set (same tokens)
        print(f"{args.strategy} over the set: {report['set_speedup']}x AR ({ar:.1f} s vs {tree:.1f} s)")
    report["max_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)  # Linux: KiB
    print(f"peak resident memory of the app's process: {report['max_rss_gib']} GiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    demo.close()


if __name__ == "__main__":
    main()
