"""Other libraries' speculative decoders, run on our pairs as peers for the bench (same result shape as
`engine.bench.hf_assisted`: output ids, their count, wall seconds).

`hf_prompt_lookup`: transformers' prompt lookup decoding (`generate(..., prompt_lookup_num_tokens=N)`), the
target-only peer of the `lookup` strategy: one continuation of up to N tokens after the latest n-gram match in the
prompt and output. Greedy only, as the bench runs it.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from engine.models import ModelPair
from engine.prompts import encode_prompt
from engine.runtime import synchronize


def hf_prompt_lookup(pair: ModelPair, prompt, max_new_tokens: int, num_tokens: int = 10,
                     stop_on_eos: bool = True) -> dict[str, Any]:
    ids = torch.tensor([encode_prompt(pair.tokenizer, prompt)], device=pair.device)
    eos = pair.eos_token_ids if stop_on_eos else None
    synchronize(pair.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = pair.target.generate(
            ids, attention_mask=torch.ones_like(ids), prompt_lookup_num_tokens=num_tokens,
            max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
            eos_token_id=eos, pad_token_id=pair.tokenizer.pad_token_id or (pair.eos_token_ids or [0])[0])
    synchronize(pair.device)
    seconds = time.perf_counter() - start
    output_ids = out[0, ids.shape[1]:].tolist()
    return {"output_ids": output_ids, "new_tokens": len(output_ids), "total_s": seconds}
