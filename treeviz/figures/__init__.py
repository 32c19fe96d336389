"""Figures: Plotly figures and HTML drawn from engine.core.trace records alone (the draft tree and its layout, the
charts, the node inspector, step-through, the race, the sweep curves, the standalone HTML export).

May import engine.core.trace and engine.measure (plain Python over records) and plotly; never gradio, never a model,
never treeviz.serving or treeviz.page: a gallery trace or an uploaded one draws with no model loaded.
"""
