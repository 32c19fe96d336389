"""Serving: requests on the model pair, everything between a handler and the engine.

Holds each request's life cycle (session.py: RunSession, its cancel flag, the wait for the pair and its lock), the
typed events it emits (events.py), the per-process registry of sessions and page state (server.py: SERVER), the
model work behind the GPU boundary (work.py: decode/compare/race/sweep events), the pair manager (pairs.py), the AR
cache, the one compute thread, the update throttle, ZeroGPU (gpu.py) and the plain error sentences (errors.py).

May import the engine and `spaces` (optional); never gradio, plotly, treeviz.page or treeviz.figures: the work yields
records, drawing them is the page's business, and the room runs where gradio is not installed (the GPU check's
machine). Gradio's error type, the one ZeroGPU's worker keeps the words of, is handed in by the page
(gpu.use_page_error); progress is the room's own typed event (events.Progress), which the page renders. This package
imports nothing itself, so app.py can import serving.gpu (and `spaces`) before anything imports torch.
"""
