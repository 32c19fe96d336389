"""Integration on the real offline pair (Qwen2.5-Coder 1.5B target, 0.5B draft), fp32: tree decoding is exact."""
import os

import pytest
import torch

from engine.core.prompts import load_prompt_set
from engine.decoder import Decoder
from engine.models import load_pair
from engine.strategies import make_strategy

PROMPTS = [load_prompt_set("code")[0]["prompt"], load_prompt_set("chat")[1]["prompt"],
           load_prompt_set("prose")[4]["prompt"]]


@pytest.fixture(scope="module")
def default_pair():
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    yield load_pair("default", "default", dtype="fp32", device="cpu")
    torch.set_num_threads(threads)


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_dynatree_and_linear_match_ar(default_pair, index):
    prompt = PROMPTS[index]
    reference = Decoder(default_pair, make_strategy("ar")).generate(prompt, max_new_tokens=48)
    assert len(reference.output_ids) > 8
    for name in ("dynatree", "linear"):
        result = Decoder(default_pair, make_strategy(name)).generate(prompt, max_new_tokens=48)
        assert result.output_ids == reference.output_ids, f"{name} diverged on prompt {index}"
        assert result.metrics.mean_tokens_per_iter > 1.0  # the draft really helps on this pair


@pytest.mark.parametrize("name", ["fixed", "dyspec", "salf", "eagle2", "ddtree", "delayed"])
def test_every_other_strategy_matches_ar_on_one_prompt(default_pair, name):
    reference = Decoder(default_pair, make_strategy("ar")).generate(PROMPTS[0], max_new_tokens=32)
    result = Decoder(default_pair, make_strategy(name)).generate(PROMPTS[0], max_new_tokens=32)
    assert result.output_ids == reference.output_ids
