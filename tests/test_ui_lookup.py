"""Context lookup in the app, through gradio_client on the tiny random pair: a `lookup` run and a DynaTree run with
lookup grafted return nodes marked by source, the tree figure rings them, the inspector and the metrics row say where
nodes came from; the controls of both come from the strategies' Params."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

gradio_client = pytest.importorskip("gradio_client")
from gradio_client import Client  # noqa: E402

from test_ui import DOWNLOAD, METRICS, STATUS, plot_data  # noqa: E402
from test_ui_support import app_url  # noqa: E402
from treeviz.figures.tree_figure import SOURCE_STYLE  # noqa: E402

PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"


@pytest.fixture(scope="module")
def client():
    return Client(app_url(), verbose=False)


def ring_names(figure) -> set[str]:
    """The sources ringed in a tree figure (by the ring traces' names)."""
    labels = {style["label"]: source for source, style in SOURCE_STYLE.items()}
    return {labels[t["name"]] for t in plot_data(figure)["data"] if t.get("name") in labels}


@pytest.mark.parametrize("strategy,params,expected", [
    ("lookup", {"min_match": 1}, {"lookup"}),
    ("dynatree", {"lookup": True, "lookup_min_match": 1}, {"model", "lookup"}),
])
def test_lookup_nodes_are_marked_by_source(client, strategy, params, expected):
    out = client.predict(PROMPT, False, "tiny-random", strategy, "cpu", 24, params=params, api_name="/run")
    assert "tokens/s" in out[STATUS] and "Traceback" not in out[STATUS]
    trace = json.loads(Path(out[DOWNLOAD]).read_text())
    assert trace["schema_version"] == 7 and all(it["lookup"] is not None for it in trace["iterations"])
    sources = {n.get("source", "model") for it in trace["iterations"] for n in it["nodes"]}
    assert expected <= sources and (strategy != "lookup" or not sources & {"model", "both"})
    assert "acceptance · lookup" in out[METRICS]  # per-source acceptance, shown because lookup drafted
    # an iteration with a lookup node: its tree rings the node, the legend names the ring, the inspector says so
    index, node = next((i, n) for i, it in enumerate(trace["iterations"]) for n in it["nodes"]
                       if n.get("source") == "lookup")
    tree = client.predict(index, "per iteration", None, api_name="/scrub")[0]
    assert "lookup" in ring_names(tree)
    assert any(t.get("name") == SOURCE_STYLE["lookup"]["label"] and t.get("showlegend", True)
               for t in plot_data(tree)["data"])
    shown, summary, _ = client.predict(index, node["id"], api_name="/inspect")
    assert shown == node["id"] and "proposed by" in summary and "context lookup" in summary


def test_lookup_and_graft_controls_come_from_the_params():
    from test_ui_support import _APP
    app_url()
    demo = _APP["demo"]
    ids = {getattr(block, "elem_id", None) for block in demo.blocks.values()}
    for name in ("budget", "min_match", "max_match", "max_continuations", "max_len"):
        assert f"tv-param-lookup-{name}" in ids
    for strategy in ("dynatree", "dyspec", "ddtree"):
        for name in ("lookup", "lookup_budget", "lookup_min_match", "lookup_continuations"):
            assert f"tv-param-{strategy}-{name}" in ids
