"""Drafts whose embedding table differs from the target's only by padding rows (Qwen2.5-7B: 152,064 rows, 0.5B:
151,936; one tokenizer of 151,665 ids). `check_same_vocab` (pair.py) admits such a pair; `match_draft_width` then makes
the draft look like a draft of the target's width, so nothing downstream sees two widths:

  * its logits come out `width` wide: -inf appended where the draft is narrower, cut where it is wider. The draft's
    q is then exactly 0 on ids it lacks -- ids no tokenizer produces -- and verification stays lossless (greedy
    exact): the target still scores every id;
  * ids past the draft's table fed to it (the target may still sample one of its padding rows: its distribution,
    its business) become `fallback` instead of indexing out of range (a CUDA device-side assert kills the process).
    That only changes what the draft proposes after such an id, never what is accepted.
"""
from __future__ import annotations

import torch
from torch import nn


class WidthHead(nn.Module):
    """The draft's output head, its logits padded with -inf or cut to `width` columns."""

    def __init__(self, head: nn.Module, rows: int, width: int):
        super().__init__()
        self.head, self.rows, self.width = head, int(rows), int(width)
        self.vocab_rows = getattr(head, "vocab_rows", None)  # a trimmed head's V' (costs key the table by it)

    @property
    def weight(self) -> torch.Tensor:  # transformers reads the output embeddings' weight for dtype and device
        return self.head.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(x)
        if self.rows >= self.width:
            return logits[..., : self.width]
        pad = logits.new_full((*logits.shape[:-1], self.width - self.rows), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    def extra_repr(self) -> str:
        return f"rows={self.rows}, width={self.width}"


class GuardedEmbedding(nn.Module):
    """The draft's input embedding; ids past its table read `fallback`'s row."""

    def __init__(self, embedding: nn.Embedding, fallback: int):
        super().__init__()
        self.embedding, self.fallback = embedding, int(fallback)
        self.rows = embedding.num_embeddings

    @property
    def weight(self) -> torch.Tensor:  # tied heads and transformers' helpers read it
        return self.embedding.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(torch.where(ids < self.rows, ids, self.fallback))


def match_draft_width(draft, width: int, fallback: int = 0) -> bool:
    """Give `draft` the target's vocabulary width (see the module docstring); False when it already has it."""
    rows = draft.config.get_text_config().vocab_size
    if rows == width:
        return False
    draft.set_output_embeddings(WidthHead(draft.get_output_embeddings(), rows, width))
    if rows < width:
        draft.set_input_embeddings(GuardedEmbedding(draft.get_input_embeddings(), fallback))
    return True
