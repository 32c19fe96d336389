"""Attention for grouped-query models over a tree mask, without repeating the cache's key/value heads.

transformers' SDPA path, given a mask and more than one query row, repeats each key/value head once per query head
in its group (6x the cache for Qwen2.5-1.5B) before calling SDPA: every layer of every tree forward copies its whole
cache. Here the query heads of a group are folded into rows instead, q [B, Hkv * g, n, D] -> [B, Hkv, g * n, D], and
the mask's rows repeated to match ([1, 1, g * n, L], small): SDPA then reads each key/value head once. The result
is the same attention, reshaped back.

`TREE_SDPA` is registered with transformers' AttentionInterface; models use it by name (`use_tree_sdpa`).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.integrations.sdpa_attention import sdpa_attention_forward

TREE_SDPA = "tree_sdpa"


def tree_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
              **kwargs):
    """transformers' attention-function contract ([B, H, n, D] in, [B, n, H, D] out); grouped-query heads folded
    into rows where there is a mask and no position bias, else transformers' own SDPA path."""
    groups = getattr(module, "num_key_value_groups", 1)
    if groups == 1 or attention_mask is None or kwargs.get("position_bias") is not None or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    _, heads, n, dim = query.shape
    kv_heads = heads // groups
    # head h = kv * groups + j -> rows j * n + i of group kv (a copy first: a view of the projection is transposed)
    folded = query.contiguous().view(1, kv_heads, groups * n, dim)
    mask = attention_mask.expand(1, 1, n, attention_mask.shape[-1]).repeat(1, 1, groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling)
    # [1, Hkv, g * n, D] -> [1, H, n, D] by splitting the rows (a reshape makes export guard on n: a dynamic-rows
    # package could not be built)
    return out.unflatten(2, (groups, n)).flatten(1, 2).transpose(1, 2).contiguous(), None


AttentionInterface.register(TREE_SDPA, tree_sdpa)
# without a mask function of its own, transformers would hand a custom attention no mask at all (causal rows over a
# cache would then be aligned top-left by SDPA's is_causal): it builds the masks it builds for sdpa
AttentionMaskInterface.register(TREE_SDPA, sdpa_mask)


def use_tree_sdpa(model) -> None:
    """Switch `model` (loaded with sdpa) to `tree_sdpa`; a model on eager attention keeps it."""
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(TREE_SDPA)


@contextmanager
def folded_attention(model):
    """`model` on tree_sdpa inside the block (a model on sdpa is switched, and back afterwards; eager attention is
    kept): what captured steps and the compiled AR trace. Compiled, SDPA becomes torch's fused CPU kernel, and folded
    it reads each key/value head once; traced unfolded with `enable_gqa`, a one-row draft package took 1.4-2x longer
    (more the longer the cache) and the compiled AR 6-8 % longer (docs/experiments/2026-12-06-zen4.md, "The captured
    steps' attention")."""
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation == "sdpa":
        model.set_attn_implementation(TREE_SDPA)
    try:
        yield
    finally:
        if implementation == "sdpa":
            model.set_attn_implementation(implementation)
