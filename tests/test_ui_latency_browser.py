"""scripts/ui_latency.py --browser, the measurement of how far the page trails the decoder, run as its users run it
(a subprocess with the tiny random pair and the real headless Chromium)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("playwright.sync_api")
pytestmark = pytest.mark.skipif(not Path("/usr/bin/chromium").exists(), reason="no chromium at /usr/bin/chromium")
ROOT = Path(__file__).resolve().parent.parent
LINE = re.compile(r"^(\S+): (\d+) iterations, (\d+) streamed updates shown, their delay median (-?[\d.]+) s, "
                  r"max (-?[\d.]+) s; final view (-?[\d.]+) s after the last token$", re.M)


def test_the_page_lag_is_measured_after_the_decoder_on_both_clocks():
    """Every number is a page time minus the decoder's time for the same iteration: the page can only show what the
    decoder already made, so a delay at or below zero would mean the stamps or their matching are wrong."""
    out = subprocess.run([sys.executable, "-m", "scripts.ui_latency", "--pair", "tiny-random", "--browser",
                          "--prompt-set", "code", "--runs", "2"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = LINE.findall(out.stdout)
    assert [r[0] for r in rows] == ["textwrap.dedent", "calendar.isleap"], out.stdout
    for name, iterations, updates, median, worst, final in rows:
        assert int(iterations) >= 1
        assert float(final) > 0
        if int(updates):
            assert 0 < float(median) <= float(worst)
