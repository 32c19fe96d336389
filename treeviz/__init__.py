"""treeviz: the Gradio app over the engine. Figures and layout take plain trace records; the handlers iterate the
engine's decoding loop themselves (no worker threads); nothing here does tensor math. See ARCHITECTURE.md."""
