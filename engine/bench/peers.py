"""Other decoders run on our pairs as peers for the bench: transformers' own `generate` loops. Each returns output
ids, their count and wall seconds; greedy only, as the bench runs them.

`hf_assisted`: transformers' assisted generation (`generate(..., assistant_model=draft)`), a chain drafted by the
pair's draft model. `hf_prompt_lookup`: transformers' prompt lookup decoding (`generate(...,
prompt_lookup_num_tokens=N)`), the target-only peer of the `lookup` strategy: one continuation of up to N tokens
after the latest n-gram match in the prompt and output.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from engine.core.prompts import encode_prompt
from engine.models import ModelPair
from engine.runtime import synchronize


def hf_assisted(pair: ModelPair, prompt, max_new_tokens: int, stop_on_eos: bool = True) -> dict[str, Any]:
    return _timed_generate(pair, prompt, max_new_tokens, stop_on_eos, assistant_model=pair.draft)


def hf_prompt_lookup(pair: ModelPair, prompt, max_new_tokens: int, num_tokens: int = 10,
                     stop_on_eos: bool = True) -> dict[str, Any]:
    return _timed_generate(pair, prompt, max_new_tokens, stop_on_eos, prompt_lookup_num_tokens=num_tokens)


def _timed_generate(pair: ModelPair, prompt, max_new_tokens: int, stop_on_eos: bool, **mode) -> dict[str, Any]:
    """transformers' greedy `generate` in `mode` (its speculative switch), timed like the engine's runs."""
    ids = torch.tensor([encode_prompt(pair.tokenizer, prompt)], device=pair.device)
    eos = pair.eos_token_ids if stop_on_eos else None
    synchronize(pair.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = pair.target.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
            temperature=None, top_p=None, top_k=None, eos_token_id=eos,
            pad_token_id=pair.tokenizer.pad_token_id or (pair.eos_token_ids or [0])[0], **mode)
    synchronize(pair.device)
    seconds = time.perf_counter() - start
    output_ids = out[0, ids.shape[1]:].tolist()
    return {"output_ids": output_ids, "new_tokens": len(output_ids), "total_s": seconds}
