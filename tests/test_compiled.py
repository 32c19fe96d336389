"""The ar-compiled baseline (engine/bench/compiled.py): the compiled step decodes what the engine's AR decodes."""

import pytest
import torch

from engine.bench.compiled import CompileError, CompiledAR, compile_available
from engine.core.attention import TREE_SDPA, folded_attention
from engine.core.prompts import encode_prompt
from engine.core.sampling import Sampling
from engine.cpu.kernels import router_of
from engine.decoder import Decoder
from engine.models import tiny_random_pair
from engine.strategies import make_strategy

PROMPT = "def f(x):\n    return"


@pytest.fixture(scope="module")
def compiled():
    """One compile for the module (the production mode: max-autotune, frozen weights) on a packed, routed pair,
    so the routed linears' switch to their plain path inside the graph is exercised too."""
    pair = tiny_random_pair(None, seed=0, dtype=torch.float32, packed=True)
    router_of(pair.target).install(["packed"])
    return pair, CompiledAR(pair.target, cache_step=64)


def engine_ar(pair, prompt, n, sampling=None, stop_on_eos=False):
    return Decoder(pair, make_strategy("ar"), sampling=sampling).generate(prompt, max_new_tokens=n,
                                                                          stop_on_eos=stop_on_eos)


def test_greedy_equals_the_engine_ar_token_for_token(compiled):
    pair, ar = compiled
    sizes = []
    for prompt in (PROMPT, "hello", "x" * 40, PROMPT):  # two cache sizes, each graph used again after the other
        out = ar.generate(encode_prompt(pair.tokenizer, prompt), 40)
        assert out["output_ids"] == engine_ar(pair, prompt, 40).output_ids
        assert out["new_tokens"] == 40 and out["tpot_s"] > 0 and out["ttft_s"] < out["total_s"]
        sizes.append(out["cache_size"])
    assert sizes == [64, 64, 128, 64] and set(ar.compile_s) == {64, 128} and min(ar.compile_s.values()) > 0
    assert router_of(pair.target).forced is None  # the plain path was forced only while compiled code ran


def test_sampling_uses_the_seeded_processed_distribution(compiled):
    """Same Sampling, same seed: the engine's AR and the compiled one draw the same tokens (both sample the
    processed p with one generator seeded by the run's seed)."""
    pair, ar = compiled
    for sampling in (Sampling(temperature=1.0, seed=3), Sampling(temperature=0.7, top_k=20, top_p=0.9, seed=11)):
        out = ar.generate(encode_prompt(pair.tokenizer, PROMPT), 30, sampling)
        assert out["output_ids"] == engine_ar(pair, PROMPT, 30, sampling).output_ids


def test_stops_at_eos_and_refuses_what_does_not_fit(compiled):
    pair, ar = compiled
    ids = encode_prompt(pair.tokenizer, PROMPT)
    free = ar.generate(ids, 30)["output_ids"]
    eos = free[5]
    out = ar.generate(ids, 30, eos_ids=(eos,))["output_ids"]
    assert out == free[: free.index(eos) + 1]
    with pytest.raises(CompileError, match="exceeds the model's 2048"):
        ar.generate(ids, 2048)


def test_cache_sizes_round_up_and_warm_up_compiles_each_once(compiled):
    pair, ar = compiled
    assert [ar.cache_size(t) for t in (1, 64, 65, 128, 129)] == [64, 64, 128, 128, 192]
    ar.warm_up(encode_prompt(pair.tokenizer, PROMPT), [70, 150, 190])
    assert {128, 192} <= set(ar.compile_s)
    ids = encode_prompt(pair.tokenizer, "y" * 100)
    assert ar.cache_size(len(ids) + 40) == 192
    assert ar.generate(ids, 40)["output_ids"] == engine_ar(pair, "y" * 100, 40).output_ids


def test_a_cache_size_past_torchs_recompile_limit_is_refused(compiled, monkeypatch):
    """Past dynamo's limit a new size would silently run eagerly, and the baseline would no longer be compiled."""
    pair, ar = compiled
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", len(ar.caches))
    with pytest.raises(CompileError, match="cache sizes"):
        ar.generate(encode_prompt(pair.tokenizer, PROMPT), 64 * (max(ar.caches) // 64 + 1))


def test_folded_attention_switches_sdpa_and_restores_it():
    """A model on sdpa traces tree_sdpa inside the block and is back on sdpa after, also after an exception; a model
    on eager attention or already on tree_sdpa is left as it is."""
    from engine.models import tiny_random_model
    model = tiny_random_model(0)
    for before, inside in (("sdpa", TREE_SDPA), ("eager", "eager"), (TREE_SDPA, TREE_SDPA)):
        model.set_attn_implementation(before)
        with pytest.raises(KeyError), folded_attention(model):
            assert model.config._attn_implementation == inside
            raise KeyError
        assert model.config._attn_implementation == before


def test_compile_is_refused_with_a_reason_off_cpu():
    assert compile_available(torch.device("cpu")) is None  # this machine has g++: the bench default uses it
    assert "CPU-only" in compile_available(torch.device("meta"))
