"""One iteration as the trace keeps it: the `IterationRecord` the UI, the benchmarks and the `auto` sizer read.

Built from what the iteration produced (the drafted tree, the target's logits over it, the rule's verdict): every
node with its draft and target probabilities and its outcome, and what the node inspector shows (the top of p and q
after every expanded node).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.core.sampling import Sampling
from engine.core.trace import (ACCEPTED, BONUS, REJECTED, ROOT, TOP_K, UNREACHED, IterationCost, IterationRecord,
                               NodeRecord, StageTimes)
from engine.core.tree import DraftTree
from engine.verify import Verdict

if TYPE_CHECKING:
    from engine.measure.costs import PairCosts


def iteration_record(index: int, root_pos: int, tree: DraftTree, verdict: Verdict, new: list[int],
                     params: dict) -> IterationRecord:
    """The record of one iteration as decoding needs it (the tree's shape, every node's outcome, what was
    committed); its times, draft forwards and cost are the decoder's to fill in, and what only a reader needs (the
    target's p, the top-10 p and q, decoded texts) `complete_record` adds after the timed section."""
    path = verdict.path
    on_path = set(path)
    nodes = []
    for i, token in enumerate(tree.tokens):
        parent = tree.parents[i]
        status = (ROOT if i == 0 else ACCEPTED if i in on_path else REJECTED if parent in on_path else UNREACHED)
        nodes.append(NodeRecord(
            id=i, parent=parent, token=token, text="", depth=tree.depths[i], q=tree.q[i] if i else None,
            rank=tree.ranks[i] if i else None, path_q=tree.path_q[i], p=None, status=status,
            accept_prob=verdict.accept_prob.get(i), draws=tree.multiplicity(i) if i else 1, source=tree.source[i]))
    last = path[-1]
    bonus_q = tree.bonus_q
    if bonus_q is None and last in tree.child_dist:
        bonus_q = float(tree.child_dist[last][verdict.bonus])
    nodes.append(NodeRecord(
        id=len(tree), parent=last, token=verdict.bonus, text="", depth=tree.depths[last] + 1, q=bonus_q, rank=None,
        path_q=tree.path_q[last] * bonus_q if bonus_q is not None else None, p=None, status=BONUS,
        resampled=verdict.resampled, source="target"))
    return IterationRecord(
        index=index, position=root_pos, nodes=nodes, accepted_path=path, bonus_token=verdict.bonus, bonus_text="",
        new_tokens=list(new), drafted=tree.num_drafted, accepted=min(len(path) - 1, len(new)), draft_forwards=0,
        params=params, times=StageTimes(), extra=dict(tree.extra), lookup=tree.lookup, selector=tree.selector)


def complete_record(record: IterationRecord, tokenizer, sampling: Sampling, tree: DraftTree,
                    logits: torch.Tensor) -> None:
    """Fill in what the reader of a record needs (the app's views, --json), from the iteration's tensors: every
    node's target probability p and text, the top of p after every node the target scored and of q after every node
    the draft expanded. Runs outside the decode time (engine/decoder.py DecodeRun): none of it is decoding."""
    bonus = record.nodes[-1]
    parents = sorted({p for p in tree.parents if p >= 0} | {bonus.parent})
    rows = logits[parents].float()
    # p as the rule saw it: the processed target distribution when sampling, the softmax when greedy.
    probs = torch.softmax(rows, dim=-1) if sampling.greedy else sampling.process(rows)
    row_of = {p: i for i, p in enumerate(parents)}
    next_p = top_k(tokenizer, probs)
    next_q = _draft_top_k(tokenizer, tree, [p for p in row_of if p in tree.child_dist], probs)
    texts = tokenizer.batch_decode([[node.token] for node in record.nodes])
    for node, text in zip(record.nodes, texts):
        node.text = text
        if node.parent >= 0:
            node.p = float(probs[row_of[node.parent], node.token])
        if node.status != BONUS:
            node.next_p = next_p[row_of[node.id]] if node.id in row_of else []
            node.next_q = next_q.get(node.id, [])
    record.bonus_text = bonus.text


def _draft_top_k(tokenizer, tree: DraftTree, drafted: list[int], probs: torch.Tensor) -> dict[int, list[list]]:
    """The top of q after every node in `drafted` (nodes whose children the draft drew), one topk row per distinct q
    tensor: DDTree's nodes of one depth share their depth's q."""
    shared = {id(tree.child_dist[p]): tree.child_dist[p] for p in drafted}
    q_rows = torch.stack(list(shared.values())).float() if shared else probs[:0]
    top_q = dict(zip(shared, top_k(tokenizer, q_rows)))
    return {p: top_q[id(tree.child_dist[p])] for p in drafted}


def top_k(tokenizer, probs: torch.Tensor) -> list[list[list]]:
    """Per row of `probs` [rows, V]: its TOP_K most probable tokens as [token, probability (4 significant digits:
    display data, kept small in traces), text]. One topk over all rows and one batched decode."""
    top = torch.topk(probs, min(TOP_K, probs.shape[-1]), dim=-1)
    ids, values = top.indices.tolist(), top.values.tolist()
    texts = iter(tokenizer.batch_decode([[t] for row in ids for t in row]))
    return [[[t, float(f"{v:.4g}"), next(texts)] for t, v in zip(row_ids, row_values)]
            for row_ids, row_values in zip(ids, values)]


def margins(logits: torch.Tensor) -> list[float]:
    """Target's top-1 minus top-2 logit per row: how close a greedy choice was to flipping."""
    top = torch.topk(logits.float(), 2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def iteration_cost(costs: PairCosts, draft_rows: list[int], verify_rows: int, times: StageTimes,
                   context: int | None = None) -> IterationCost:
    """Predicted (from the measured cost table `costs`, at `context` committed tokens) beside measured seconds of an
    iteration's draft and verify."""
    predicted = costs.predict(draft_rows, verify_rows, context=context)
    return IterationCost(
        draft_rows=list(draft_rows), verify_rows=verify_rows, predicted_draft_s=predicted["draft_s"],
        predicted_verify_s=predicted["verify_s"], predicted_s=predicted["total_s"],
        measured_draft_s=times.draft, measured_verify_s=times.verify, measured_s=times.draft + times.verify)
