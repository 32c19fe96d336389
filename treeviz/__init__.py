"""treeviz: the Gradio app over the engine, in three rooms, one direction (pyproject.toml's import contracts):

    page     the Gradio page: layout, components, handlers, views; imports serving and figures
    serving  requests on the model pair: sessions, events, the GPU work, pair, AR cache, compute thread
    figures  Plotly figures and HTML drawn from trace records alone

serving and figures never import each other, so a figure draws a gallery trace with no model and the model work
never waits on drawing. Nothing here does tensor math (the engine does). See ARCHITECTURE.md."""
