"""The server side every browser shares: the model pair, the AR cache, the running sessions (one per browser session
and view) and each page's state, in one `Server`, `SERVER`, one per process.

The handlers (and tests) reach it as this module global, never as an argument.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from engine.recipe import RunSpec
from treeviz.serving.ar_cache import ARCache, Baseline
from treeviz.serving.errors import UserError
from treeviz.serving.pairs import PairManager
from treeviz.serving.session import RunSession


@dataclass
class PageState:
    """What a browser session's page shows that a run's last event must respect, written by the page's own handlers:
    the iteration the user scrubbed to and the node inspected once the run had finished (None: the last iteration,
    the default node) and the entropy switch."""
    shown: int | None = None
    node: int | None = None
    entropy: bool = False


class Server:
    """The pair, the AR cache, the running sessions (one per browser session and view) and each page's state."""

    MAX_PAGES = 1024

    def __init__(self):
        self.pairs = PairManager()
        self.ar_cache = ARCache()
        self._sessions: dict[str, RunSession] = {}
        self._pages: OrderedDict[str, PageState] = OrderedDict()
        self._lock = threading.Lock()

    def open(self, browser: str, view: str) -> RunSession:
        """A new session for `view`, superseding (cancelling) the older one of that browser session and view."""
        session = RunSession(self, f"{browser}/{view}")
        with self._lock:
            old = self._sessions.get(session.key)
            self._sessions[session.key] = session
        if old is not None:
            old.cancel(superseded=True)
        return session

    def session_of(self, key: str) -> RunSession:
        """The running session `key`, or a new unregistered one if none runs (the work never calls this: it gets a
        Ticket, which needs no lock)."""
        with self._lock:
            return self._sessions.get(key) or RunSession(self, key)

    def running(self, browser: str) -> list[str]:
        """The views this browser session is running now (busy state as data)."""
        return list(self._live(browser))

    def stop(self, browser: str) -> list[str]:
        """Cancel every running session of `browser`; the views it stopped (none: nothing was running)."""
        live = self._live(browser)
        for session in live.values():
            session.cancel()
        return list(live)

    def _live(self, browser: str) -> dict[str, RunSession]:
        """`browser`'s sessions not cancelled, by view."""
        with self._lock:
            return {key.partition("/")[2]: s for key, s in self._sessions.items()
                    if key.partition("/")[0] == browser and not s.cancelled}

    def close(self, session: RunSession) -> None:
        with self._lock:
            if self._sessions.get(session.key) is session:
                del self._sessions[session.key]

    def page(self, browser: str) -> PageState:
        with self._lock:
            state = self._pages.pop(browser, None) or PageState()
            self._pages[browser] = state
            while len(self._pages) > self.MAX_PAGES:
                self._pages.popitem(last=False)
            return state

    def loaded_pair(self, spec: RunSpec, button: str):
        """The loaded pair for `spec`, read without a lock (the work calls it, in a forked worker on ZeroGPU);
        UserError naming `button` if it is not the one loaded."""
        pair = self.pairs.held(spec.pair)
        if pair is None:
            raise UserError(f"the model pair is not loaded yet: press {button} again")
        return pair

    @staticmethod
    def ar_key(pair, spec: RunSpec) -> tuple:
        """The AR cache's key for `spec` on `pair` (loaded as `spec.pair`), with how AR's forwards run there."""
        steps = pair.describe_capture() if pair.capture_ready and spec.capture != "off" else "eager"
        return ARCache.key(spec.pair, pair.dtype, spec, steps)

    def cached_baseline(self, spec: RunSpec) -> tuple[tuple | None, Baseline | None]:
        """(AR key, the AR cached under it) for `spec` on its loaded pair; (None, None) if that pair is not loaded."""
        pair = self.pairs.held(spec.pair)
        if pair is None:
            return None, None
        key = self.ar_key(pair, spec)
        return key, self.ar_cache.baseline(key)


SERVER = Server()  # one per process
