"""The ar-compiled baseline (engine/compiled.py): the compiled step decodes what the engine's AR decodes."""
import pytest
import torch

from engine.compiled import CompileError, CompiledAR, compile_available
from engine.decoder import Decoder, encode_prompt
from engine.kernels import router_of
from engine.models import tiny_random_pair
from engine.sampling import Sampling
from engine.strategies import make_strategy

PROMPT = "def f(x):\n    return"


@pytest.fixture(scope="module")
def compiled():
    """One compile for the module (the production mode: max-autotune, frozen weights) on a packed, routed pair,
    so the routed linears' switch to their plain path inside the graph is exercised too."""
    pair = tiny_random_pair(None, seed=0, dtype=torch.float32, packed=True)
    router_of(pair.target).install(["packed"])
    return pair, CompiledAR(pair.target, max_len=128)


def engine_ar(pair, prompt, n, sampling=None, stop_on_eos=False):
    return Decoder(pair, make_strategy("ar"), sampling=sampling).generate(prompt, max_new_tokens=n,
                                                                          stop_on_eos=stop_on_eos)


def test_greedy_equals_the_engine_ar_token_for_token(compiled):
    pair, ar = compiled
    for prompt in (PROMPT, "hello", "x" * 40):  # prompts of other lengths reuse the same graph and cache
        out = ar.generate(encode_prompt(pair.tokenizer, prompt), 40)
        assert out["output_ids"] == engine_ar(pair, prompt, 40).output_ids
        assert out["new_tokens"] == 40 and out["tpot_s"] > 0 and out["ttft_s"] < out["total_s"]
    assert ar.compile_s is not None and ar.compile_s > 0
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
    with pytest.raises(CompileError, match="static cache of 128 positions"):
        ar.generate(ids, 128)


def test_compile_is_refused_with_a_reason_off_cpu():
    assert compile_available(torch.device("cpu")) is None  # this machine has g++: the bench default uses it
    assert "CPU-only" in compile_available(torch.device("meta"))
