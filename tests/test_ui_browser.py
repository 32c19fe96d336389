"""A real headless Chromium (Playwright) against the app on 127.0.0.1 with the tiny random pair."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

sync_api = pytest.importorskip("playwright.sync_api")

from test_ui_support import app_url  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
POINTS = "#tv-tree .js-plotly-plot .scatterlayer .trace .points path"
SHOTS = Path(os.environ.get("TREEVIZ_SCREENSHOTS", "")) if os.environ.get("TREEVIZ_SCREENSHOTS") else None

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="no chromium at /usr/bin/chromium")


def tree_title(page) -> str:
    return page.locator("#tv-tree .gtitle").first.text_content() or ""


def test_run_and_scrub_in_a_real_browser(tmp_path):
    url = app_url()
    shots = SHOTS or tmp_path
    shots.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1000})
            errors = []
            page.on("pageerror", lambda err: errors.append(str(err)))
            page.goto(url)
            # the gallery trace shows a tree before any run
            page.wait_for_selector(POINTS, timeout=60_000)
            page.screenshot(path=str(shots / "01_gallery.png"), full_page=True)

            page.locator("#tv-prompt textarea").fill("def greet(name):\n")
            page.click("#tv-run")
            page.wait_for_function(
                "document.querySelector('#tv-run-status').innerText.includes('tokens/s')", timeout=90_000)
            page.wait_for_selector(POINTS, timeout=30_000)
            assert page.locator(POINTS).count() >= 2
            assert "matches AR" in page.locator("#tv-badge").inner_text()
            page.screenshot(path=str(shots / "02_run.png"), full_page=True)
            last_title = tree_title(page)

            # scrub to the first iteration: tree, text and metrics follow, no models involved
            slider = page.locator("#tv-scrubber input[type=range]")
            slider.focus()
            page.keyboard.press("Home")
            page.wait_for_function(
                "(document.querySelector('#tv-tree .gtitle') || {}).textContent?.startsWith('iteration 0:')",
                timeout=30_000)
            assert tree_title(page) != last_title
            assert "iteration 0" in page.locator("#tv-metrics").inner_text()
            page.screenshot(path=str(shots / "03_scrubbed.png"), full_page=False)
            assert (shots / "03_scrubbed.png").stat().st_size > 10_000

            # live tuning: committing a new slider value re-runs the prompt by itself (no Run click)
            box = page.locator("#tv-max-new input[type=number]")
            box.fill("12")
            box.press("Enter")
            box.blur()
            page.wait_for_function(
                "document.querySelector('#tv-run-status').innerText.includes('12 tokens in')", timeout=60_000)
            page.screenshot(path=str(shots / "04_retuned.png"), full_page=False)

            # Stop mid-run: the streamed views stay, the status says so, and the pair takes the next run
            box.fill("512")
            box.press("Enter")
            box.blur()
            page.wait_for_function(
                "document.querySelector('#tv-run-status').innerText.includes('decoding with')", timeout=60_000)
            page.click("#tv-stop")
            page.wait_for_function(
                "document.querySelector('#tv-run-status').innerText.includes('stopped')", timeout=30_000)
            assert page.locator(POINTS).count() >= 2
            page.screenshot(path=str(shots / "05_stopped.png"), full_page=False)

            # a strategy parameter reaches the engine by name: D0 = D_max is refused by DynaTree, in one plain line
            d0 = page.locator("#tv-param-dynatree-d0 input[type=number]")
            d0.fill("7")
            d0.press("Enter")
            d0.blur()
            page.wait_for_function(
                "document.querySelector('#tv-run-status').innerText.includes('D0 (7) must be below D_max (7)')",
                timeout=60_000)
            assert not errors, errors
        finally:
            browser.close()
