"""Rewrite the per-strategy parameter tables in docs/strategies.md from the strategies' declarations.

    python -m scripts.update_readme

The tables run from the first strategy's heading (START) to the paragraph on DynaTree's ablation switches (END);
tests/test_cli.py fails when they drift from the code.
"""
from pathlib import Path

from engine.cli import strategy_docs

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "strategies.md"
START = "**`ar`**"
END = "DynaTree's four mechanisms"


def main():
    text = PAGE.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    PAGE.write_text(head + strategy_docs() + "\n" + END + tail)


if __name__ == "__main__":
    main()
