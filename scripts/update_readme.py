"""Rewrite the README's per-strategy parameter tables from the strategies' declarations.

    python scripts/update_readme.py

The tables sit between the "## Strategies" introduction and the paragraph on DynaTree's ablation switches;
tests/test_cli.py fails when they drift from the code.
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.cli import strategy_docs  # noqa: E402

START = "**`ar`**"
END = "DynaTree's four mechanisms"


def main():
    readme = ROOT / "README.md"
    text = readme.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(head + strategy_docs() + "\n" + END + tail)


if __name__ == "__main__":
    main()
