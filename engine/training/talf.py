"""TALF: tree-aware draft training (the SALF/TALF paper, §3.2 and Algorithm 1).

Every position s of a training sequence is the root of a tree that the *target* builds with EAGLE-2's beam search
(k children per expanded node, the k best by path probability V expanded at each depth, `depth` levels of tokens).
Each node n the target expanded carries the target's next-token distribution p_child(n); the draft is trained with

    L = sum over roots, sum over the root's expanded nodes n of  CE(p_child(n), q_child(n))

and all nodes of all trees of a sequence go through the draft in ONE forward with tree attention: the sequence rows
are causal, and a tree node sees its root's prefix, its ancestors and itself (engine/core/kv.py's additive masks), at
position = position of its root + depth (ARCHITECTURE.md). With depth 3 and k = 4 (the paper's values) a root gets
1 + 4 + 4 = 9 loss nodes; depth 1 is plain token-level distillation on the sequence (the baseline), and k = 1 walks
the target's greedy path (close to HASS, as the paper notes).

Soft labels are stored as the target's top `label_topk` probabilities per node plus the *tail* mass 1 - sum(top-k)
(the full vocabulary would be ~11 GB per 512-token sequence of the default pair). The tail is not renormalised
away: it is one extra class, matched by the draft's own mass outside those ids, so the loss is the exact cross-entropy
between the two distributions coarsened to (top-k ids, everything else).

The labels are made without gradients by the target (one cached forward per depth); the tree shape is then fixed
and reused across epochs, as in the paper.

`load_adapter(model, path)` loads a LoRA adapter trained by scripts/train_talf.py (peft) onto a draft and merges it, so
the decoder sees a plain model.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.core import kv


class TalfError(ValueError):
    """Settings or inputs TALF cannot train with; the message says what to change."""


@dataclass
class TreeBatch:
    """B training sequences of L tokens with their target trees, as T = L + (depth-1)*L*k rows each.

    Rows 0..L-1 are the sequence (row s is the root of position s's tree); then each depth's expanded nodes, k per
    root. `parent` is -1 for sequence rows. Every row carries a soft label (the target's distribution after it)."""
    input_ids: torch.Tensor     # [B, T] long
    position_ids: torch.Tensor  # [B, T] long
    parent: torch.Tensor        # [B, T] long
    visible: torch.Tensor       # [B, T, T] bool: row i attends to column j
    depth: torch.Tensor         # [T] long: 0 for sequence rows
    label_ids: torch.Tensor     # [B, T, K] long, the target's top-K ids, most probable first
    label_probs: torch.Tensor   # [B, T, K] float32
    label_tail: torch.Tensor    # [B, T] float32: target mass outside the top-K
    seq_len: int

    @property
    def roots(self) -> int:
        return self.input_ids.shape[0] * self.seq_len

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        """Additive [B, 1, T, T] mask in the model dtype."""
        return kv.additive_mask(self.visible, dtype)[0, 0][:, None]


def _labels(logits: torch.Tensor, label_topk: int):
    probs = torch.softmax(logits.float(), dim=-1)
    top_p, top_ids = probs.topk(label_topk, dim=-1)
    tail = (1.0 - top_p.sum(-1)).clamp_min(0.0)
    return top_ids, top_p, tail


@torch.no_grad()
def target_tree_batch(target, ids: torch.Tensor, k: int = 4, depth: int = 3, label_topk: int = 32) -> TreeBatch:
    """The target builds one beam tree per position of each sequence in `ids` [B, L] and labels every node."""
    if ids.dim() != 2 or ids.shape[1] < 1:
        raise TalfError(f"ids must be [batch, length] with length >= 1, got shape {tuple(ids.shape)}")
    vocab = target.config.vocab_size
    if not 1 <= k <= label_topk < vocab:
        raise TalfError(f"need 1 <= k ({k}) <= label_topk ({label_topk}) < vocabulary size ({vocab})")
    if depth < 1:
        raise TalfError(f"depth must be >= 1, got {depth}")
    device = target.device
    ids = ids.to(device)
    B, L = ids.shape
    T = L + (depth - 1) * L * k
    visible = torch.zeros(B, T, T, dtype=torch.bool, device=device)
    visible[:, :L, :L] = torch.ones(L, L, dtype=torch.bool, device=device).tril()
    input_ids = torch.zeros(B, T, dtype=torch.long, device=device)
    positions = torch.zeros(B, T, dtype=torch.long, device=device)
    parent = torch.full((B, T), -1, dtype=torch.long, device=device)
    depths = torch.zeros(T, dtype=torch.long, device=device)
    label_ids = torch.zeros(B, T, label_topk, dtype=torch.long, device=device)
    label_probs = torch.zeros(B, T, label_topk, dtype=torch.float32, device=device)
    label_tail = torch.zeros(B, T, dtype=torch.float32, device=device)
    input_ids[:, :L] = ids
    positions[:, :L] = torch.arange(L, device=device)

    cache = kv.new_cache(target)
    logits = target(input_ids=ids, position_ids=positions[:, :L], past_key_values=cache, use_cache=True).logits
    label_ids[:, :L], label_probs[:, :L], label_tail[:, :L] = _labels(logits, label_topk)

    batch = torch.arange(B, device=device)[:, None, None]
    front = torch.arange(L, device=device)[None, :, None].expand(B, L, 1)  # [B, L, m] rows expanded last
    front_value = torch.zeros(B, L, 1, device=device)                     # log V of those rows
    base = L
    for level in range(1, depth):
        # Children of every front node: its top-k tokens; keep the k best per root by path probability (beam).
        child_p = label_probs[batch, front, :k]                              # [B, L, m, k]
        child_ids = label_ids[batch, front, :k]
        value = (front_value[..., None] + child_p.clamp_min(1e-30).log()).flatten(2)  # [B, L, m*k]
        front_value, pick = value.topk(k, dim=-1)                            # [B, L, k]
        new_parent = front.gather(2, pick // k)
        new_tokens = child_ids.flatten(2).gather(2, pick)
        rows = base + torch.arange(L * k, device=device).view(1, L, k).expand(B, L, k)
        new_parent, new_tokens, flat = new_parent.reshape(B, -1), new_tokens.reshape(B, -1), rows[0].reshape(-1)
        n = flat.numel()
        input_ids[:, flat] = new_tokens
        parent[:, flat] = new_parent
        depths[flat] = level
        positions[:, flat] = positions.gather(1, new_parent) + 1
        # a node sees what its parent sees, and itself
        visible[:, flat] = visible[torch.arange(B, device=device)[:, None], new_parent]
        visible[:, flat, flat] = True
        mask = kv.additive_mask(visible[:, flat, : base + n], target.dtype)[0, 0][:, None]
        logits = target(input_ids=new_tokens, position_ids=positions[:, flat], attention_mask=mask,
                        past_key_values=cache, use_cache=True).logits
        label_ids[:, flat], label_probs[:, flat], label_tail[:, flat] = _labels(logits, label_topk)
        front, base = rows, base + n
    return TreeBatch(input_ids, positions, parent, visible, depths, label_ids, label_probs, label_tail, L)


def soft_cross_entropy(logits: torch.Tensor, label_ids: torch.Tensor, label_probs: torch.Tensor,
                       label_tail: torch.Tensor) -> torch.Tensor:
    """Per-row CE between (top-K target probs, tail mass) and the draft's (probs of those ids, mass elsewhere)."""
    logits = logits.float()
    log_norm = logits.logsumexp(-1)
    top = logits.gather(-1, label_ids) - log_norm[..., None]
    rest = logits.scatter(-1, label_ids, float("-inf")).logsumexp(-1) - log_norm
    return -(label_probs * top).sum(-1) - label_tail * rest


def draft_logits(draft, batch: TreeBatch) -> torch.Tensor:
    """The draft's logits at every row of the batch: all trees of all sequences in one forward."""
    device = next(draft.parameters()).device
    return draft(input_ids=batch.input_ids.to(device), position_ids=batch.position_ids.to(device),
                 attention_mask=batch.mask(draft.dtype).to(device)).logits


def tree_loss(draft, batch: TreeBatch) -> torch.Tensor:
    """TALF's loss: the sum of the per-node cross-entropies of each root's tree, averaged over roots."""
    logits = draft_logits(draft, batch)
    per_node = soft_cross_entropy(logits, batch.label_ids.to(logits.device), batch.label_probs.to(logits.device),
                                  batch.label_tail.to(logits.device))
    return per_node.sum() / batch.roots


def node_path(batch: TreeBatch, b: int, row: int) -> list[int]:
    """The token sequence a row stands for: its root's prefix, then the tree path down to the row."""
    path = []
    while row >= batch.seq_len:
        path.append(int(batch.input_ids[b, row]))
        row = int(batch.parent[b, row])
    return batch.input_ids[b, : row + 1].tolist() + path[::-1]


# -- LoRA adapters (peft) -------------------------------------------------------------------------------------------
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def add_lora(model, rank: int = 16, alpha: int = 32, dropout: float = 0.0):
    """Wrap `model` with trainable LoRA matrices on every attention and MLP projection (peft)."""
    from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(LORA_TARGETS),
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def load_adapter(model, path: str | Path, merge: bool = True, trainable: bool = False):
    """Load a TALF LoRA adapter saved by scripts/train_talf.py onto `model` (the draft it was trained on).

    merge=True folds the adapter into the weights and returns a plain model, so the decoder, kernel packing and
    quantisation see an ordinary draft; merge=False returns the peft wrapper (with trainable=True, ready to train on:
    scripts/train_talf.py lora --resume). Call it before prepare_kernels: peft
    can only wrap plain nn.Linear layers, not the routed ones kernel preparation puts in their place."""
    path = Path(path).expanduser()
    if not (path / "adapter_config.json").is_file():
        raise TalfError(f"{path} is not a LoRA adapter folder (no adapter_config.json); train one with "
                        "`python -m scripts.train_talf lora --out PATH`")
    from peft import PeftModel
    try:
        wrapped = PeftModel.from_pretrained(model, str(path), is_trainable=trainable)
    except (ValueError, RuntimeError) as err:  # routed / packed linears, or an adapter of another model's shapes
        raise TalfError(f"cannot load the adapter {path} onto this draft ({str(err)[:300]}). Load it onto the "
                        "draft it was trained on, right after loading and before engine.models.prepare_kernels "
                        "wraps the linears.") from None
    if trainable or not merge:
        return wrapped
    return wrapped.merge_and_unload().eval()
