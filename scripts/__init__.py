"""Command-line tools around the engine, run as modules from the repository root: `python -m scripts.NAME --help`."""
