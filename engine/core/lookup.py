"""Drafts that cost nothing: continuations looked up in the context (prompt + generated text), as a token tree.

`LookupIndex` holds the committed token stream and finds where its recent tokens occurred before: the longest
suffix of the stream (between `min_match` and `max_match` tokens) that also ends earlier in the stream, and what
followed those earlier occurrences. `build_lookup_tree` merges the best continuations into a trie under a node of a
`DraftTree` (shared prefixes become one path), within a node budget.

The index is one hash per n-gram order: its query stays flat as the stream grows (every order's occurrences are one
dict lookup away, and only the most recent `SCAN` are read), and it is the simplest of the indexes compared
(`python -m scripts.lab.lookup_timing`; docs/experiments/design-measurements.md).

What q means for lookup nodes: a lookup proposal is deterministic given the committed context, so lookup children
are recorded as child_mode "topk": each a draw from the point mass on its token (engine/verify/base.py). That is
what the sampling rules read; tree.q / child_dist of a node expanded by lookup hold the continuations' support (the
share of matched continuations through each child; 1.0 on a lone chain), for display only; a lookup child of a
model-expanded node keeps the model's q for display. The rules that check "topk" children losslessly at any
temperature accept lookup trees: greedy, token matching / NSS, NaiveTree, SpecInfer, Traversal, and on a single
chain Naive and Block; SpecTr and Khisti (i.i.d. draws only) refuse them. Lookup never adds a child beside sampled
("iid" / "without_replacement") siblings: a node has one child mode (engine/verify/base.py `child_draws`), and a
deterministic sibling among i.i.d. draws is neither.
"""
from __future__ import annotations

import torch

from engine.core.tree import DraftTree

SCAN = 256  # occurrences read per match length (the most recent ones): bounds a query on long, repetitive streams


class LookupIndex:
    """The committed stream and, for every n-gram of order min_match..max_match in it, the positions that follow
    each of its occurrences (in increasing order)."""

    def __init__(self, min_match: int = 2, max_match: int = 8):
        if not 1 <= min_match <= max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        self.min_match, self.max_match = min_match, max_match
        self.tokens: list[int] = []
        self.follows: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions right after its occurrences
        self.last_match = 0  # match length behind the last `continuations` answer (0: none)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens) -> None:
        """Commit `tokens` at the end of the stream (incremental: earlier entries are never touched)."""
        stream, follows = self.tokens, self.follows
        for token in tokens:
            stream.append(int(token))
            end = len(stream)
            for k in range(self.min_match, min(self.max_match, end) + 1):
                follows.setdefault(tuple(stream[end - k:end]), []).append(end)

    def continuations(self, max_continuations: int, max_len: int, tail=()) -> list[tuple[list[int], float]]:
        """Up to `max_continuations` distinct continuations of the stream followed by `tail` (tokens not committed,
        e.g. a tree path), best first, each with its support in (0, 1].

        Longest match first: every earlier occurrence of the longest matching suffix gives the tokens that followed
        it (at most `max_len`); distinct ones rank by frequency, then by recency. Shorter matches fill the remaining
        slots. Support = the share of that match length's occurrences (the most recent SCAN) that continue this way.
        """
        seq = self.tokens[-self.max_match:] + [int(t) for t in tail]  # only the last max_match tokens are matched
        n, end = len(self.tokens), len(seq)
        out: list[tuple[list[int], float]] = []
        seen: set[tuple[int, ...]] = set()
        self.last_match = 0
        for k in range(min(self.max_match, end), self.min_match - 1, -1):
            # the most recent SCAN occurrences that something follows (the stream's own end is the last entry)
            ends = [e for e in self.follows.get(tuple(seq[end - k:end]), ())[-SCAN - 1:] if e < n][-SCAN:]
            if not ends:
                continue
            self.last_match = self.last_match or k
            stats: dict[tuple[int, ...], list[int]] = {}  # continuation -> [count, most recent position]
            for e in ends:
                entry = stats.setdefault(tuple(self.tokens[e:e + max_len]), [0, e])
                entry[0], entry[1] = entry[0] + 1, e
            for cont, (count, _) in sorted(stats.items(), key=lambda kv: (-kv[1][0], -kv[1][1])):
                if cont not in seen:
                    seen.add(cont)
                    out.append((list(cont), count / len(ends)))
                    if len(out) >= max_continuations:
                        return out
        return out


def follow(index: LookupIndex, tokens: list[int]) -> LookupIndex:
    """The index of the context `tokens`: `index` extended by the tokens committed since it last saw the context, or
    a fresh index with its settings when `tokens` does not continue what it saw (a new run, an edited context)."""
    seen = index.tokens
    if tokens[:len(seen)] != seen:
        index = LookupIndex(index.min_match, index.max_match)
    index.extend(tokens[len(index.tokens):])
    return index


def _may_expand(tree: DraftTree, node: int) -> bool:
    """Whether a deterministic child may join `node`'s children: it has none, or they are deterministic too."""
    return not tree.children[node] or tree.child_mode.get(node, "topk") == "topk"


def _plan(tree: DraftTree, under: int, conts, budget: int):
    """Walk the continuations in rank order; returns, per continuation, the part that fits with its support
    (existing nodes are free, new ones count against `budget`, and none goes beside sampled siblings)."""
    planned: set[tuple[int, ...]] = set()
    kept = []
    for cont, weight in conts:
        node, path = under, ()
        for token in cont:
            child = tree.child_with_token(node, token) if node is not None else None
            if child is None and (path + (token,)) not in planned:
                if len(planned) >= budget or (node is not None and not _may_expand(tree, node)):
                    break
                planned.add(path + (token,))
            node, path = child, path + (token,)
        if path:
            kept.append((path, weight))
    return kept


def build_lookup_tree(tree: DraftTree, index: LookupIndex, budget: int, max_continuations: int, max_len: int,
                      under: int = 0, vocab_size: int | None = None, device=None) -> list[int]:
    """Merge the index's best continuations after `under` into `tree` as a trie under node `under`; returns the new
    node ids. At most `budget` nodes are added; a continuation through an existing child with the same token reuses
    it (its source becomes "both" where the model put it). The index must hold the committed stream up to the root.

    Children added to a node that had none get child_mode "topk" and, when the width of the target's rows is known
    (`vocab_size` and `device`, else those of a distribution already in the tree), a child_dist of the continuations'
    support; the sampling rules need that tensor (they read it as point masses). Without it only the greedy rule can
    check the tree (the others refuse it: "no recorded draft distribution")."""
    if index.tokens and index.tokens[-1] != tree.root_token:
        raise ValueError("the lookup index must end with the tree's root (the last committed token)")
    tail = [tree.tokens[v] for v in tree.path_to(under)[1:]]
    kept = _plan(tree, under, index.continuations(max_continuations, max_len, tail), budget)
    # support[path]: weight of the kept continuations through `path`; onward[path]: of those that go on past it
    support: dict[tuple[int, ...], float] = {}
    onward: dict[tuple[int, ...], float] = {}
    for path, weight in kept:
        for i in range(len(path)):
            support[path[:i + 1]] = support.get(path[:i + 1], 0.0) + weight
            onward[path[:i]] = onward.get(path[:i], 0.0) + weight
    like = next(iter(tree.child_dist.values()), None)
    width = vocab_size or (len(like) if like is not None else None)
    device = device or (like.device if like is not None else None)
    added, expanded = [], set()
    for path, _ in kept:
        node = under
        for i, token in enumerate(path):
            child = tree.child_with_token(node, token)
            if child is None:
                if node not in tree.child_dist:
                    expanded.add(node)
                q = (support[path[:i + 1]] / onward[path[:i]] if node in expanded
                     else float(tree.child_dist[node][token]))
                child = tree.add(node, token, q, rank=len(tree.children[node]))
                tree.source[child] = "lookup"
                tree.child_mode[node] = "topk"
                added.append(child)
            elif tree.source[child] == "model":
                tree.source[child] = "both"
            node = child
    for node in expanded:
        if width is not None:
            dist = torch.zeros(width, device=device)
            for child in tree.children[node]:
                dist[tree.tokens[child]] = tree.q[child]
            tree.child_dist[node] = dist
    return added
