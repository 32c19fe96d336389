"""How often a running decode sends the page an update: a bounded rate that also adapts to what an update costs,
so that showing the run never slows the decoding it shows by more than about BUILD_SHARE.

An update costs the decoding twice: the handler builds it (snapshot, tree, text) and Gradio serialises and sends it
before it resumes the generator, both on the decoding's cores; then the browser re-draws Plotly figures on the same
machine when the page runs beside the server (a Space's visitor does not, a local user does). One update cost the
decoding about 0.11 s on the 2-core machine (docs/experiments/design-measurements.md), so updates come at most
every MIN_UPDATE_INTERVAL_S = 0.11 s / BUILD_SHARE, and further apart when one update costs more in this process: after
an update that took u seconds from the start of its build until the generator resumed, the next waits at least u * (1 -
BUILD_SHARE) / BUILD_SHARE (u / (u + wait) <= BUILD_SHARE). Iterations in between are not lost: each update shows the
run so far, and the final view and the trace hold every iteration.
"""
from __future__ import annotations

import time
from typing import Callable

BUILD_SHARE = 0.10                 # the most of the wall time that updates may take from the decoding
BROWSER_UPDATE_COST_S = 0.11       # measured cost of one streamed update to a same-machine browser (above)
MIN_UPDATE_INTERVAL_S = BROWSER_UPDATE_COST_S / BUILD_SHARE  # 1.1 s


class UpdateThrottle:
    """`due()`: may an update be sent now? `sent(started)`: one was, its build begun at `started` (clock time)."""

    def __init__(self, min_interval: float = MIN_UPDATE_INTERVAL_S, share: float = BUILD_SHARE,
                 clock: Callable[[], float] = time.perf_counter):
        self.min_interval, self.share, self.clock = min_interval, share, clock
        self.next_at = float("-inf")   # the first update goes at once: the time to the first tree matters
        self.last_cost = 0.0
        self.sent_count = 0

    def due(self) -> bool:
        return self.clock() >= self.next_at

    def sent(self, started: float) -> None:
        now = self.clock()
        self.last_cost = max(0.0, now - started)
        self.sent_count += 1
        self.next_at = now + self.wait_after(self.last_cost)

    def wait_after(self, cost: float) -> float:
        """The pause after an update that cost `cost` seconds: at least the bounded rate's interval, and long enough
        that updates take at most `share` of the wall time."""
        return max(self.min_interval, cost * (1.0 - self.share) / self.share)
