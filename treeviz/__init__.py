"""treeviz UI package: layout and Plotly figures (plain data in, no tensor math), the Gradio app, and the
background-thread glue to the engine. Nothing here imports torch directly; the engine is only called."""
