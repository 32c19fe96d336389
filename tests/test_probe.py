"""The format probe (engine/cpu/formats.py) times each shape group as a forward reads it: from memory. Each group is
timed on enough of its own layers to fill the last-level cache, and every sweep starts on a flushed cache."""
import re

import pytest
import torch

from engine.cpu import formats
from engine.cpu.kernels import linear_bytes, named_routed_linears, route_linears, routed_linears
from engine.models import tiny_random_model

LAYER = re.compile(r"\.layers\.(\d+)\.")


@pytest.fixture
def routed():
    model = tiny_random_model(seed=0, num_layers=8)  # q, o 16 KB each; k, v 8 KB; gate, up, down 32 KB (fp32)
    route_linears(model)
    return model


def test_each_group_is_probed_on_the_fewest_first_layers_whose_weights_fill_the_cache(routed, monkeypatch):
    cache = 100 << 10
    monkeypatch.setattr(formats, "last_level_cache", lambda: cache)
    probed = {id(layer) for layers in formats.probe_groups(routed).values() for layer in layers}
    members: dict[str, list[tuple[int | None, object]]] = {}
    for name, layer in named_routed_linears(routed):
        match = LAYER.search(name)
        members.setdefault(layer.group, []).append((int(match.group(1)) if match else None, layer))
    taken = {}
    for group, layers in members.items():
        inside = [(index, layer) for index, layer in layers if index is not None]
        assert all(id(layer) in probed for index, layer in layers if index is None), group  # the head, whole
        if not inside:
            continue
        chosen = [layer for index, layer in inside if id(layer) in probed]
        assert chosen == [layer for _, layer in inside[:len(chosen)]], group  # the first layers, in order
        size = sum(formats._plain_bytes(layer) for layer in chosen)
        last = formats._plain_bytes(chosen[-1])
        assert size - last < cache, group  # no more than it takes
        assert size >= cache or len(chosen) == len(inside), group  # enough, or every layer there is
        taken[group] = len({index for index, layer in inside if id(layer) in probed})
    # the small k, v weights are probed on more layers than the wide gate and up: the point of counting per group
    assert taken["64x32"] == 7 and taken["64x128"] == 2, taken


def test_every_sweep_of_the_probe_starts_on_a_flushed_cache(routed, monkeypatch):
    events = []

    class Recorded(formats.CacheFlush):
        def __call__(self):
            events.append("flush")
            super().__call__()

    monkeypatch.setattr(formats, "CacheFlush", Recorded)
    monkeypatch.setattr(formats, "last_level_cache", lambda: 1 << 20)
    layers = formats.probe_groups(routed)["64x128"]
    for layer in layers:
        layer.register_forward_hook(lambda *_: events.append("call"))
    seconds = formats.time_formats(layers, ["plain"], ladder=(1, 2), repeats=2)
    assert set(seconds["plain"]) == {1, 2}
    sweep = ["flush"] + ["call"] * len(layers)
    assert events == sweep * (2 * (1 + 2)), events[:12]  # per rung: a warm-up and two samples, each flushed first


def test_each_group_s_bytes_per_format_are_its_own(routed, monkeypatch):
    # MKL pads its packed layout by shape (a 1536x256 weight to 6.7 times its bytes, a 1536x8960 one to 1.24): one
    # ratio for the whole model priced the wide groups by the narrow ones' padding (or the reverse)
    if formats.format_unavailable("mkl", torch.device("cpu"), torch.float32):
        pytest.skip("MKL's packed GEMM is not offered on this CPU")
    monkeypatch.setattr(formats, "last_level_cache", lambda: 1 << 20)
    monkeypatch.setattr(formats, "REPEATS", 1)
    seconds, size = formats._probe(routed, ["plain", "mkl"], None, [])
    assert set(size) == set(seconds) == {layer.group for layer in routed_linears(routed)}
    for group, ratios in size.items():
        layer = next(m for m in routed_linears(routed) if m.group == group)
        packed = torch.ops.mkl._mkl_reorder_linear_weight(layer.weight.detach(), 16)
        assert ratios["plain"] == 1.0
        assert ratios["mkl"] == pytest.approx(packed.numel() * packed.element_size() / formats._plain_bytes(layer))
    assert len({round(r["mkl"], 6) for r in size.values()}) > 1, size  # the shapes pad differently


def test_a_model_that_fits_the_cache_is_timed_from_it(routed, monkeypatch):
    # its forwards read it from the cache, so the probe does too (and a tiny model's probe stays fast)
    flushes = []

    class Recorded(formats.CacheFlush):
        def __call__(self):
            flushes.append(1)
            super().__call__()

    monkeypatch.setattr(formats, "CacheFlush", Recorded)
    monkeypatch.setattr(formats, "REPEATS", 1)
    model_bytes = linear_bytes(routed)
    for cache, flushed in ((model_bytes * 2, False), (model_bytes // 4, True)):
        flushes.clear()
        monkeypatch.setattr(formats, "last_level_cache", lambda cache=cache: cache)
        formats._probe(routed, ["plain"], None, [])
        assert bool(flushes) == flushed, cache


def test_the_probe_holds_one_group_s_copies_at_a_time(routed, monkeypatch):
    # each group fills the last-level cache, and a VM may report its whole socket's: copies of every group at once
    # took gigabytes of a first start's memory (docs/experiments/2026-12-07-xeon-amx.md). int8: made on every CPU
    monkeypatch.setattr(formats, "last_level_cache", lambda: 1 << 20)
    monkeypatch.setattr(formats, "REPEATS", 1)
    timed = []
    time_formats = formats.time_formats

    def recorded(layers, paths, **kwargs):
        holding = {layer.group for layer in routed_linears(routed) if set(layer.paths) - {"plain"}}
        timed.append((layers[0].group, holding))
        return time_formats(layers, paths, **kwargs)

    monkeypatch.setattr(formats, "time_formats", recorded)
    formats._probe(routed, ["plain", "int8"], None, [])
    groups = {layer.group for layer in routed_linears(routed)}
    assert {group for group, _ in timed} == groups
    assert all(holding == {group} for group, holding in timed), timed
    assert all(set(layer.paths) == {"plain"} for layer in routed_linears(routed))  # and none after
