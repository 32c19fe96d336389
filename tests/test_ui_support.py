"""Shared by the UI tests: one in-process app on 127.0.0.1 with the tiny random pair (never the real models)."""
from __future__ import annotations

import atexit
import os
import socket

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ["TREEVIZ_PAIR"] = "tiny-random"

_APP: dict = {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def app_url() -> str:
    """Launch the app once per test process; return its URL."""
    if "url" not in _APP:
        from treeviz.page.ui import build_demo, launch_kwargs
        from treeviz.serving.server import SERVER
        demo = build_demo(initial_pair="tiny-random")
        assert SERVER.pairs.name == "tiny-random"  # the real default pair is never loaded here
        demo.queue(default_concurrency_limit=4)
        port = free_port()
        demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True,
                    **launch_kwargs())
        _APP.update(url=f"http://127.0.0.1:{port}/", demo=demo)
        atexit.register(demo.close)
    return _APP["url"]


def backend():
    """The app's backend: the process-wide module global the handlers use (treeviz.serving.server.SERVER)."""
    from treeviz.serving.server import SERVER
    app_url()
    return SERVER
