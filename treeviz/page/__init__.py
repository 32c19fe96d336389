"""The page: the Gradio app's layout (ui.py, teaching_ui.py), its components declared once (components.py), the
handlers that turn a request's events into component updates (handlers.py, teaching_handlers.py), the component
values built from a RunResult (views.py), the strategy controls, trace replays, and the page's static files.

May import treeviz.serving (requests, events, SERVER) and treeviz.figures; nothing below imports the page.
"""
