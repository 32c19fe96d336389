"""AR at its fastest: the bench adds ar-compiled wherever inductor can build it, mapping the target's plain weights back
from its checkpoint (engine/models/checkpoint.py) where the memory plan freed them (engine/bench/tables.py)."""
import pytest
import torch

from engine.bench import tables
from engine.bench.compiled import CACHE_STEP
from engine.cpu.kernels import _file_mapped, named_routed_linears
from engine.models import load_model, load_pair, tiny_random_model, tiny_random_pair, tiny_tokenizer
from engine.models.checkpoint import CheckpointError, map_plain_weights


def saved_tiny(folder, seed=0):
    tiny_random_model(seed).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


def test_freed_plain_weights_map_back_from_the_checkpoint_bit_for_bit(tmp_path):
    model, _, _ = load_model(saved_tiny(tmp_path / "t"), dtype="fp32", device="cpu")
    pair = load_pair(str(tmp_path / "t"), None, dtype="fp32", device="cpu", packed="on", calibrate=False)
    reference = dict(model.named_parameters())
    freed = [name for name, layer in named_routed_linears(pair.target) if "plain" not in layer.paths]
    assert freed  # packed "on": the plain weights made way for a packed format
    assert map_plain_weights(pair.target) == len(freed) and map_plain_weights(pair.target) == 0
    for name, layer in named_routed_linears(pair.target):
        assert "plain" in layer.paths and torch.equal(layer.weight, reference[f"{name}.weight"])
    weight = dict(named_routed_linears(pair.target))[freed[0]].weight
    assert _file_mapped(weight.data_ptr(), weight.data_ptr() + weight.numel() * weight.element_size())  # no copy


def test_a_model_without_a_checkpoint_is_refused_with_a_reason():
    pair = tiny_random_pair(None, packed=True)
    for _, layer in named_routed_linears(pair.target):
        layer.drop("plain")
    with pytest.raises(CheckpointError, match="no safetensors checkpoint"):
        map_plain_weights(pair.target)
    said = []
    assert tables.compiled_baseline(pair, ["ar"], "auto", ["code"], 1, 8, said.append) is None
    assert said and said[0].startswith("ar-compiled left out") and "no safetensors checkpoint" in said[0]


def test_bench_auto_runs_ar_compiled_on_the_mapped_plain_weights(tmp_path):
    """The production path: a pair whose target kept only packed weights; `auto` maps the plain ones back and
    ar-compiled decodes what the engine's AR decodes (fp32: token for token)."""
    pair = load_pair(saved_tiny(tmp_path / "t"), None, dtype="fp32", device="cpu", packed="on")
    said = []
    report = tables.bench(pair, ["ar"], prompt_set="code", limit=2, max_new_tokens=8, compiled_ar="auto",
                          log=said.append)  # two prompts on either side of a cache step
    rows = {r["method"]: r for r in report["rows"]}
    assert rows["ar-compiled"]["exact_match_rate"] == 1.0 and report["config"]["compiled_ar_compile_s"] > 0
    assert any("mapped" in line and "plain weights back" in line for line in said)
    assert len(report["config"]["compiled_ar_cache_sizes"]) == 1  # one graph: one copy of the weights


def test_the_compiled_copy_must_fit_in_free_memory(monkeypatch):
    """Each cache size's graph packs its own copy of the weights: one size for every prompt where two do not fit,
    none (with the reason) where one does not."""
    pair = tiny_random_pair(None)
    need = tables.linear_bytes(pair.target)
    totals = [100, 500]  # two sizes at CACHE_STEP
    monkeypatch.setattr(tables, "available_memory", lambda: 2 * need + tables.RESERVE)
    assert tables._cache_step(pair, totals) == CACHE_STEP and tables._compile_memory(pair) is None
    assert tables._cache_step(pair, totals, mapped=True) == 2 * CACHE_STEP  # mapped back: memory is short here
    monkeypatch.setattr(tables, "available_memory", lambda: need + tables.RESERVE)
    assert tables._cache_step(pair, totals) == 2 * CACHE_STEP and tables._compile_memory(pair) is None
    monkeypatch.setattr(tables, "available_memory", lambda: need + tables.RESERVE - 1)
    assert "copy of the target's weights" in tables._compile_memory(pair)
    said = []
    assert tables.compiled_baseline(pair, ["ar"], "auto", ["code"], 1, 8, said.append) is None
    assert said and said[0].startswith("ar-compiled left out") and "available" in said[0]
    with pytest.raises(ValueError, match="cannot run"):
        tables.compiled_baseline(pair, ["ar"], "on", ["code"], 1, 8, said.append)
