"""The teaching views in a real headless Chromium (Debian's /usr/bin/chromium): the step-through walks draft ->
verify -> commit, the race shows two lanes and a winner, the sweep draws, Stop stops a sweep.

Editing "max new tokens" (a slider: leaving its box releases it) starts a Run, as live tuning does, at the moment the
Race or Sweep button is clicked. Before each view had its own cancel flag, that Run superseded the race whenever it
reached the server a few milliseconds after it, and the race's status stayed at "warming up" for good (this test
timed out now and then in the full suite); the race now goes on and the Run waits for the pair.
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

pytest.importorskip("gradio_client")


def plot_titles(page, elem_id: str) -> str:
    return page.evaluate(f"() => (document.querySelector('#{elem_id} .js-plotly-plot')?.layout?.title?.text) || ''")


def shot(page, shots: Path, elem_id: str, name: str) -> Path:
    page.locator(f"#{elem_id}").scroll_into_view_if_needed()
    path = shots / name
    page.locator(f"#{elem_id}").screenshot(path=str(path))
    assert path.stat().st_size > 10_000
    return path


def test_race_step_through_and_sweep_in_a_real_browser(tmp_path):
    browser = pytest.importorskip("test_ui_browser")
    with browser.app_page(tmp_path) as (page, shots, errors):
        page.wait_for_selector(browser.POINTS, timeout=60_000)  # the gallery trace: no model needed for the steps
        page.locator("#tv-scrubber input[type=range]").focus()
        page.keyboard.press("Home")
        page.wait_for_function("(document.querySelector('#tv-tree .gtitle') || {}).textContent?.startsWith("
                               "'iteration 0:')", timeout=30_000)

        # step through iteration 0: play, and the title walks draft -> verify -> commit
        page.get_by_role("tab", name="Step through", exact=True).click()
        page.wait_for_function("(document.querySelector('#tv-step .js-plotly-plot')?.layout?.title?.text || '')"
                               ".startsWith('iteration 0, step 1/')", timeout=30_000)
        page.locator("#tv-step .updatemenu-button").first.click()  # ▶ play
        seen, deadline = [], time.time() + 90  # each step's caption starts with its phase
        while time.time() < deadline and not (seen and seen[-1].startswith("commit")):
            caption = re.sub(r"<[^>]+>", "", plot_titles(page, "tv-step").split("<br>")[-1])
            if not seen or caption != seen[-1]:
                seen.append(caption)
                if caption.startswith("verify") and not any(c.startswith("verify") for c in seen[:-1]):
                    shot(page, shots, "tv-step", "ui_step.png")
            time.sleep(0.1)
        phases = [c.split()[0].rstrip(",:") for c in seen]
        order = [p for k, p in enumerate(phases) if p in ("draft", "verify", "commit") and p not in phases[:k]]
        assert order == ["draft", "verify", "commit"], seen

        # the race: two lanes, decoded unobserved, replayed; the winner marked once it plays to the end
        page.locator("#tv-max-new input[type=number]").fill("32")
        page.get_by_role("tab", name="Race", exact=True).click()
        page.click("#tv-race-btn")
        race_status = "document.querySelector('#tv-race-status').innerText"
        try:
            page.wait_for_function(f"{race_status}.includes('winner')", timeout=180_000)
        except Exception as err:  # say where the race stood, not only that it timed out
            raise AssertionError(f"no winner; race status: {page.evaluate(race_status)!r}") from err
        assert "fair measurement" in page.locator("#tv-race-status").inner_text()
        lanes = page.evaluate("() => document.querySelector('#tv-race .js-plotly-plot').data"
                              ".filter(t => t.mode === 'text' && t.x[0] === 0).map(t => t.text[0])")
        assert lanes == ["<b>AR</b>", "<b>dynatree</b>"], lanes
        page.locator("#tv-race .updatemenu-button").first.click()  # ▶ 1×: the tiny pair races in a blink
        page.wait_for_function("document.querySelector('#tv-race .js-plotly-plot').innerText?.includes('winner') || "
                               "[...document.querySelectorAll('#tv-race text')].some(t => t.textContent.includes("
                               "'★ winner'))", timeout=60_000)
        shot(page, shots, "tv-race-tab", "ui_race.png")

        # the sweep: three sizes and AR, the curves drawn when it completes
        page.get_by_role("tab", name="Sweep", exact=True).click()
        page.locator("#tv-sweep-min input").fill("2")
        page.locator("#tv-sweep-max input").fill("16")
        points = page.locator("#tv-sweep-points input[type=number]")
        points.fill("3")
        points.blur()
        page.click("#tv-sweep-btn")
        page.wait_for_function("document.querySelector('#tv-sweep-status').innerText.includes('sweep done')",
                               timeout=300_000)
        curves = browser.plot_traces(page, "tv-sweep")
        assert {"L̄", "acceptance", "measured tokens/s"} <= {t["name"] for t in curves if t["n"] == 3}, curves
        assert page.locator("#tv-sweep .scatterlayer .trace .points path").count() >= 9
        shot(page, shots, "tv-sweep-tab", "ui_sweep.png")

        # Stop mid-sweep: the sweep's status line says it stopped, and the page takes the next run
        page.locator("#tv-max-new input[type=number]").fill("400")
        page.locator("#tv-sweep-max input").fill("64")
        points.fill("6")
        points.blur()
        page.click("#tv-sweep-btn")
        sweep_status = "document.querySelector('#tv-sweep-status').innerText"
        try:  # any run done but not the last: a fast machine may pass '1 of 7' between two polls of the page
            page.wait_for_function(f"/ [1-6] of 7 runs done/.test({sweep_status})", timeout=300_000)
        except Exception as err:  # say where the sweep and the page's Run stood, not only that it timed out
            raise AssertionError(f"sweep status: {page.evaluate(sweep_status)!r}; run status: "
                                 f"{page.locator('#tv-run-status').inner_text()!r}") from err
        page.click("#tv-stop")
        page.wait_for_function("document.querySelector('#tv-sweep-status').innerText.includes('sweep stopped')",
                               timeout=30_000)
        assert not errors, errors
