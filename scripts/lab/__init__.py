"""Lab probes: one-off measurements, each behind a lab note in docs/experiments/ (its docstring's first line names it),
kept so that note's numbers can be measured again: `python -m scripts.lab.NAME --help`. Nothing imports them."""
