"""A real headless Chromium (Playwright) against the app on 127.0.0.1 with the tiny random pair; the gallery trace
it opens with is a committed real-model trace."""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
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


@contextmanager
def app_page(tmp_path):
    """A fresh page on the app in a real Chromium, the folder screenshots go to, and the page errors seen; the test
    asserts on the errors itself, so a failure says what the page reported."""
    shots = SHOTS or tmp_path
    shots.mkdir(parents=True, exist_ok=True)
    url = app_url()
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda err: errors.append(str(err)))
            page.goto(url)
            yield page, shots, errors
        finally:
            browser.close()


def plot_traces(page, elem_id: str) -> list[dict]:
    """The data of the Plotly figure inside component `elem_id`, as the page holds it (name, type, points)."""
    return page.evaluate(f"""() => {{
        const gd = document.querySelector('#{elem_id} .js-plotly-plot');
        return gd ? gd.data.map(t => ({{name: t.name || '', type: t.type || 'scatter',
                                        n: (t.x || []).length, status: t.customdata ? t.customdata[0][1] : null}}))
                  : [];
    }}""")


def click_node(page, status: str) -> None:
    """A real mouse click on the first node of the given outcome in the tree figure."""
    index = next(i for i, t in enumerate(plot_traces(page, "tv-tree")) if t["status"] == status)
    scatter = sum(1 for t in plot_traces(page, "tv-tree")[:index] if t["type"] == "scatter")
    page.locator("#tv-tree .scatterlayer .trace").nth(scatter).locator(".points path").first.click(force=True)


def test_gallery_inspector_and_panels_in_a_real_browser(tmp_path):
    """The first view: a real-model gallery trace with its text; a node click opens the inspector with both
    distributions; the calibration and cost panels draw from the replayed trace (no model involved)."""
    from treeviz.page.replay import gallery_traces
    default = json.loads(gallery_traces()[0].read_text())
    assert not str(default["config"]["target"]).startswith("tiny"), "the gallery opens on a real-model trace"
    with app_page(tmp_path) as (page, shots, errors):
        page.wait_for_selector(POINTS, timeout=60_000)
        page.wait_for_function("document.querySelector('#tv-run-status').innerText.includes('replaying')",
                               timeout=30_000)
        # real text: the trace's own output, word for word
        words = " ".join(default["output_text"].split()[:6])
        shown = " ".join(page.locator("#tv-text").inner_text().replace("⏎", " ").split())
        assert words and words in shown, (words, shown[:300])
        assert "speedup" in page.locator("#tv-throughput").inner_text()
        page.screenshot(path=str(shots / "10_gallery_first_view.png"), full_page=False)

        click_node(page, "rejected")
        page.wait_for_function("document.querySelector('#tv-inspector').innerText.includes('rejected')",
                               timeout=30_000)
        page.wait_for_function("""() => {
            const gd = document.querySelector('#tv-inspector-plot .js-plotly-plot');
            return gd && gd.data && gd.data.filter(t => t.type === 'bar').length === 2; }""", timeout=30_000)
        node = page.locator("#tv-node input").input_value()
        assert node and f"{node} ·" in page.locator("#tv-inspector").inner_text()
        assert "the target's choice was" in page.locator("#tv-inspector").inner_text()
        page.locator("#tv-inspector-plot").scroll_into_view_if_needed()
        page.screenshot(path=str(shots / "11_node_inspector.png"), full_page=False)

        page.get_by_role("tab", name="Calibration").click()
        page.wait_for_selector("#tv-calibration .js-plotly-plot .scatterlayer .trace", timeout=30_000)
        lines = plot_traces(page, "tv-calibration")
        assert lines[0]["name"].startswith("y = x") and any(t["n"] >= 2 for t in lines[1:]), lines
        page.locator("#tv-calibration").scroll_into_view_if_needed()
        page.screenshot(path=str(shots / "12_calibration.png"), full_page=False)

        page.get_by_role("tab", name="Costs").click()
        page.wait_for_selector("#tv-costs .js-plotly-plot .scatterlayer .trace", timeout=30_000)
        names = {t["name"] for t in plot_traces(page, "tv-costs") if t["n"]}
        assert {"verify, measured", "verify, predicted (cost table)", "iteration, measured",
                "break-even: AR for the same tokens"} <= names, names
        page.locator("#tv-costs").scroll_into_view_if_needed()
        page.screenshot(path=str(shots / "13_costs.png"), full_page=False)
        assert not errors, errors


def test_run_and_scrub_in_a_real_browser(tmp_path):
    with app_page(tmp_path) as (page, shots, errors):
        # the gallery trace shows a tree before any run
        page.wait_for_selector(POINTS, timeout=60_000)
        page.screenshot(path=str(shots / "01_gallery.png"), full_page=True)

        page.locator("#tv-prompt textarea").fill("def greet(name):\n")
        page.click("#tv-run")
        page.wait_for_function(
            "document.querySelector('#tv-run-status').innerText.includes('tokens/s')", timeout=90_000)
        page.wait_for_selector(POINTS, timeout=30_000)
        assert page.locator(POINTS).count() >= 2
        page.wait_for_function("document.querySelector('#tv-badge').innerText.includes('matches AR')",
                               timeout=60_000)
        assert "×" in page.locator("#tv-metrics").inner_text()  # the speedup, once AR is in
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
        page.wait_for_function(  # the run streams: the status counts iterations while the tree grows
            "document.querySelector('#tv-run-status').innerText.includes('decoding with')", timeout=60_000)
        page.screenshot(path=str(shots / "04b_streaming.png"), full_page=False)
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
        d0.fill("4")
        d0.blur()

        # Compare: the metrics row follows each compared method, ending on the last one ticked
        box.fill("16")
        box.blur()
        page.get_by_role("tab", name="Compare").click()
        page.click("#tv-compare")
        page.wait_for_function(
            "document.querySelector('#tv-run-status').innerText.includes('compared')", timeout=180_000)
        ticked = [label.inner_text().strip() for label in page.locator("#tv-compare-methods label").all()
                  if label.locator("input").is_checked()]
        metrics = page.locator("#tv-metrics").inner_text()
        assert metrics.split("\n")[1].strip() == ticked[-1], (metrics, ticked)
        assert "×" in metrics
        page.screenshot(path=str(shots / "06_compare.png"), full_page=True)
        assert not errors, errors


def test_the_precision_switch_in_a_real_browser(tmp_path):
    """Clicking fp32 loads the pair in float32 (under its own name where this CPU's auto is bf16), and the next run
    says float32 and equals AR token for token; auto brings the pair back."""
    from treeviz.serving.pairs import with_precision
    exact = with_precision("tiny-random", "fp32")  # "tiny-random (fp32)", or "tiny-random" where auto is fp32
    with app_page(tmp_path) as (page, shots, errors):
        page.wait_for_selector(POINTS, timeout=60_000)
        page.locator("#tv-precision label", has_text="fp32: exact").click()  # "auto (fp32 here)" on a float32 CPU
        page.wait_for_function(f"document.querySelector('#tv-pair input').value === {json.dumps(exact)}",
                               timeout=30_000)
        page.wait_for_function("document.querySelector('#tv-model-status').innerText.includes('dtype: float32')",
                               timeout=90_000)
        page.locator("#tv-prompt textarea").fill("def greet(name):\n")
        page.click("#tv-run")
        page.wait_for_function(
            "document.querySelector('#tv-run-status').innerText.includes('float32 on')", timeout=90_000)
        page.wait_for_function("document.querySelector('#tv-badge').innerText.includes('matches AR')",
                               timeout=60_000)
        page.screenshot(path=str(shots / "precision_fp32.png"), full_page=False)
        page.locator("#tv-precision label", has_text="auto (").click()
        page.wait_for_function("document.querySelector('#tv-pair input').value === 'tiny-random'", timeout=30_000)
        assert not errors, errors
