"""The exported teaching page in a real headless Chromium from a file:// URL (no server): three plots, and play
buttons that play. Screenshots of the race and the step-through go to $TREEVIZ_SCREENSHOTS (else the test's tmp dir)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

sync_api = pytest.importorskip("playwright.sync_api")

from engine.core.trace import load_run  # noqa: E402
from engine.recipe import RunSpec, start_run  # noqa: E402
from treeviz.figures.export import export_html  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
GALLERY = Path(__file__).resolve().parent.parent / "assets" / "traces" / "default_chat_dynatree_paper.json"

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="no chromium at /usr/bin/chromium")


def decode(pair, strategy: str):
    run = start_run(pair, RunSpec(pair="tiny-random", prompt="Once upon a time", strategy=strategy,
                                  max_new_tokens=32))
    for _ in run:
        pass
    return run.result


def trace_text(page, div: str, index: int) -> str:
    return page.evaluate(f"() => document.getElementById('{div}').data[{index}].text[0]")


def title(page, div: str) -> str:
    return page.evaluate(f"() => document.getElementById('{div}').layout.title.text")


def test_exported_page_plays_offline(tmp_path, related_pair):
    page_path = export_html(tmp_path / "class.html", [("AR", decode(related_pair, "ar")),
                                                      ("DynaTree", decode(related_pair, "dynatree"))],
                            load_run(GALLERY))
    shots = Path(os.environ.get("TREEVIZ_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda err: errors.append(str(err)))
            page.route("http*://**", lambda route: route.abort())  # offline: the page must need nothing
            page.goto(page_path.as_uri())
            page.wait_for_selector("#tv-replay .main-svg")
            assert page.locator(".js-plotly-plot").count() == 3
            clock = page.evaluate("() => document.getElementById('tv-race').data.length") - 1
            assert trace_text(page, "tv-race", clock) == "t = 0 ms"
            page.locator("#tv-race .updatemenu-button", has_text="▶ 1×").click()
            page.wait_for_function(f"() => document.getElementById('tv-race').data[{clock}].text[0] !== 't = 0 ms'")
            page.wait_for_timeout(1500)  # a tiny race lasts milliseconds: it has finished
            assert "winner" in page.evaluate("() => JSON.stringify(document.getElementById('tv-race').data)")
            page.locator("#tv-race").screenshot(path=str(shots / "teaching_race.png"))
            before = title(page, "tv-step")
            page.locator("#tv-step .updatemenu-button", has_text="play").click()
            page.wait_for_function(f"() => document.getElementById('tv-step').layout.title.text !== {before!r}")
            assert "step 2/" in title(page, "tv-step")
            page.locator("#tv-step .updatemenu-button", has_text="pause").click()
            rail = page.locator("#tv-step .slider-rail-rect").bounding_box()
            page.mouse.click(rail["x"] + rail["width"] - 3, rail["y"] + rail["height"] / 2)  # the slider's end
            page.wait_for_function("() => document.getElementById('tv-step').layout.title.text.includes('commit')")
            page.locator("#tv-step").screenshot(path=str(shots / "teaching_step.png"))
            # Plotly rejects an interrupted animation's promise with no reason ("undefined"): pausing, or stepping
            # while a play runs, does that by design. Anything else is a real error.
            assert [e for e in errors if e != "undefined"] == [], errors
        finally:
            browser.close()
