"""Every experiment script runs end to end on the tiny pair and writes its table and figure."""
import json

import pytest

from scripts import experiments


@pytest.mark.parametrize("name", list(experiments.EXPERIMENTS))
def test_experiment_writes_table_and_figure(tmp_path, name):
    experiments.main([name, "--out", str(tmp_path), "--pair", "tiny-random", "--tokens", "6"])
    table = (tmp_path / f"{name}.md").read_text()
    rows = json.loads((tmp_path / f"{name}.json").read_text())
    assert table.count("\n|") >= len(rows) >= 1 and "python -m scripts.experiments" in table
    assert "plotly" in (tmp_path / f"{name}.html").read_text().lower()
    if name != "calibration":
        assert all(r["L_bar"] >= 1 and r["speedup"] > 0 for r in rows)
    else:
        assert all(0 <= r["accepted"] <= 1 and r["lo"] <= r["mean_q"] <= r["hi"] for r in rows)


def test_mask_blocks_counts_tiles_of_the_ancestor_mask():
    from engine.core.trace import IterationRecord, NodeRecord, StageTimes
    chain = [NodeRecord(id=i, parent=i - 1, token=0, text="", depth=i, q=None, rank=None, path_q=None, p=None,
                        status="accepted") for i in range(4)]
    it = IterationRecord(index=0, position=0, nodes=chain, accepted_path=[0, 1, 2, 3], bonus_token=0, bonus_text="",
                         new_tokens=[0], drafted=3, accepted=3, draft_forwards=3, params={}, times=StageTimes())
    assert experiments.mask_blocks(it, 2) == 3  # a 4x4 lower triangle in 2x2 tiles: two diagonal, one below
    assert experiments.mask_blocks(it, 4) == 1
