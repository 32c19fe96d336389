"""The draft phase and greedy verification queued on the device, read back once per iteration.

On the host path every level of a tree reads the draft's probabilities back (to choose children in Python) and the
verification reads the target's argmax: on a GPU each read waits for the device to drain, several times per
iteration. Here a strategy that can say its tree as fixed-size levels (`Strategy.device_plan`: the fixed tree,
DynaTree, EAGLE-2, the linear chain) grows it as tensors (tensor_tree.py), every draft forward and the target's
forward take device inputs (`steps.forward_tensors`), greedy verification runs on the device, and one read brings
back the tree and the accepted path. The tree, the tokens and the records are the host path's for the same
distributions (tests/test_device_draft.py); what differs is the work: every level runs at its planned width whether
or not the tree fills it, and the target verifies the whole budget's rows, which a GPU pays little for and a CPU
pays in full (docs/experiments/2026-11-27-device-draft.md).
"""
from __future__ import annotations

import torch

from engine.core.tensor_tree import Level, TensorTree
from engine.core.tree import DraftTree


def draft(drafter, strategy, plan: list[tuple[int, int]], committed: list[int]) -> TensorTree:
    """The iteration's tree grown on the device by `plan`'s draft forwards, nothing read back."""
    root_pos, device = len(committed) - 1, drafter.device
    tree = TensorTree(committed[-1], strategy.device_budget(), device)
    drafter.begin(DraftTree(root_token=committed[-1]), committed)
    probs = drafter.expand_root_on_device()
    columns = torch.full((tree.capacity + 1,), -1, dtype=torch.long, device=device)  # node -> its draft cache row
    columns[0] = root_pos
    frontier, valid = tree.root_frontier()
    for level, (width, k) in enumerate(plan):
        column = root_pos
        if level:
            valid = valid & (tree.count < tree.capacity)  # the host path stops expanding once the budget is spent
            column = drafter.steps.length
            columns[frontier] = column + torch.arange(width, device=device)
            probs = drafter.expand_on_device(tree.tokens[frontier], root_pos + tree.depths[frontier],
                                             draft_visibility(tree, frontier, valid, columns, root_pos, column))
        tree.levels.append(Level(frontier, valid, probs, column))
        top, tokens = torch.topk(probs, min(k, probs.shape[-1]), dim=-1)
        added = tree.grow(frontier, valid, top, tokens, strategy.device_choose(tree, frontier, valid, top))
        if level + 1 < len(plan):
            frontier, valid = strategy.device_next(tree, added, plan[level + 1][0])
    strategy.device_finish(tree)
    return tree


def verify(tree: TensorTree, drafter, target, strategy, root_pos: int):
    """The target's forward over the tree's rows and greedy verification, then the iteration's one read: (the host
    tree, the accepted path, the bonus token, the target's logits [len(tree), V]). The drafter learns the rows it
    expanded (`finish` keeps them); the target's cache holds the verified rows as `forward` leaves them."""
    n = tree.rows
    logits = target.forward_tensors(tree.tokens[:n], root_pos + tree.depths[:n], tree.visibility(root_pos))
    back = tree.read(*tree.greedy_path(logits, len(tree.levels)))
    host = tree.host_tree(back)
    drafter.adopt({node: tree.levels[index].column + row for index, row, node in tree.expanded(back)})
    strategy.device_built(host)
    return host, back.path, back.bonus, logits[:len(host)]


def draft_visibility(tree: TensorTree, frontier: torch.Tensor, valid: torch.Tensor, columns: torch.Tensor,
                     root_pos: int, column: int) -> torch.Tensor:
    """Bool [W, column + W] over the draft cache for a level's rows: the committed prefix and the root, each node's
    ancestors' rows and its own; a padded row sees its own column only."""
    width = len(frontier)
    ancestors = tree.ancestors[frontier] & (columns >= 0)  # [W, capacity + 1]: those with a draft row
    index = torch.where(ancestors & valid[:, None], columns, column + width)
    visible = torch.zeros(width, column + width + 1, dtype=torch.bool, device=frontier.device)
    visible.scatter_(1, index, True)
    visible[:, : root_pos + 1] = valid[:, None]
    own = torch.arange(width, device=frontier.device)
    visible[own, column + own] = True
    return visible[:, :-1]

