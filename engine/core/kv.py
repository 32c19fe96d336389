"""KV-cache helpers shared by the target and the draft: tree attention masks and rollback by row copy."""
from __future__ import annotations

import torch
from transformers import DynamicCache


def new_cache(model) -> DynamicCache:
    return DynamicCache(config=model.config)


def cache_length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool [q, k] visibility -> float additive mask [1, 1, q, k]: 0 where visible, dtype-min elsewhere.

    A bool mask is silently misread by some attention paths; an additive mask in the model dtype is not.
    """
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]


def tree_visibility(prefix_len: int, tree_visible: torch.Tensor) -> torch.Tensor:
    """Bool [n, prefix_len + n]: every query sees the whole prefix, and its tree ancestors and itself."""
    n = tree_visible.shape[0]
    prefix = torch.ones(n, prefix_len, dtype=torch.bool, device=tree_visible.device)
    return torch.cat([prefix, tree_visible], dim=1)


def keep_rows(cache: DynamicCache, start: int, rows: list[int]) -> None:
    """Roll the cache back to `start` rows, then append the existing rows `rows` (absolute indices >= start).

    Keys are stored after RoPE at their tree positions, which equal the sequential positions of an accepted path,
    so copying the rows gives exactly what sequential decoding would have written. No re-forward is needed.
    """
    end = start + len(rows)
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        if rows and rows != list(range(start, end)):
            index = torch.tensor(rows, device=layer.keys.device)
            layer.keys[:, :, start:end] = layer.keys.index_select(2, index)
            layer.values[:, :, start:end] = layer.values.index_select(2, index)
        layer.keys = layer.keys[:, :, :end]
        layer.values = layer.values[:, :, :end]
